"""A prefill instance with DP attention x PP (`dsakv serve --role prefill --pp-size 2 --tp-size 2 --dp-size 2
--enable-dp-attention --ep-size 2 --prefix-cache`, started without --pp-rank): four processes (DP rank d, stage s;
prefill/dp_pp.py), each DP rank a pipeline of its own with its own pools and prefix cache, each stage's two DP ranks
the EP group of its MoE layers; mooncake into a TP-1 decode and nixl into a decode with DP attention (2 ranks),
through the router (over real HTTP for the tokens).

Checked: greedy and seeded tokens equal the single-rank engine; one request at a time, cached nowhere, the router
places it by load (the rank whose prefix cache holds fewer pages has more free) until both ranks served; the bytes
each (prefill (d, s), decode rank) pair gains are exactly its pages x stage s's bytes per page, from DP rank d's two
stages only, into one decode rank; prefix affinity per rank (a prompt sharing 2 pages one rank caches goes there:
32 hit tokens there, none on the other); SIGTERM stops every process with exit 0 (each stage's EP group sees its DP
rank 1 exit 0, nothing reported down). kill -9 of (d=1, s=1) while a request of DP rank 1 is in its transfer: that
request fails naming DP rank 1's stage 1, (1, 0) leaves, both stages' EP groups re-form without DP rank 1; rank 0's
row says why, (0, 1)'s names the SIGKILL; the router routes to DP rank 0 only, which serves the single-rank tokens
(all experts now its own) and leaks no page.
"""

from __future__ import annotations

import concurrent.futures
import os
import signal

import httpx
import pytest
import torch

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.router.routing import page_hashes
from dsakv.engine.dp import pid_gone
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.serve.app import create_app
from dsakv.serve.tokenizer import load_tokenizer
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import (
    DP_ARGS,
    NUM_PAGES,
    PAGE_SIZE,
    Cluster,
    assert_clean,
    free_ports,
    run_requests,
    wait_for,
    worker_config,
)
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.testing.servers import MODEL, LiveServer
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(420)]

ARCH = "glm_moe_dsa"
PARTITION = (7, 5)
P = len(PARTITION)
LENGTHS = (17, 23, 41)
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)

g = torch.Generator().manual_seed(47)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
FRESH = [torch.randint(2, 512, (34,), generator=g).tolist() for _ in range(6)]  # 2 whole pages + 2 tokens each
TAILS = [torch.randint(2, 512, (8,), generator=g).tolist() for _ in FRESH]
AGAIN = [p[:32] + t for p, t in zip(FRESH, TAILS, strict=True)]  # FRESH[i]'s 2 whole pages, then 8 new tokens


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {
        "greedy": eng.generate(PROMPTS, GREEDY),
        "sampled": eng.generate(PROMPTS, SAMPLED),
        "fresh": eng.generate(FRESH, GREEDY),
        "again": eng.generate(AGAIN, GREEDY),
    }


def start(cluster: Cluster, name: str, extra: list[str] = (), backend: str = "mooncake", dp_decode: bool = False):
    """A TP-1 decode (or one with DP attention, 2 ranks) and the DP 2 x PP 2 prefill (its user command: it starts
    the stages, each stage its DP rank 1); (prefill command, decode, its ranks' addresses, every DP rank's stage
    addresses [[s0, s1], ..])."""
    from dsakv.engine.argv import engine_argv

    dport = free_ports(2)
    decode = cluster.decode("dec", backend, True, port=dport, extra=[*(DP_ARGS if dp_decode else []), "--worker-name",
                            "dec"])  # fmt: skip
    dranks = [f"127.0.0.1:{dport + r}" for r in range(2 if dp_decode else 1)]
    port = free_ports(2 * (P + 1))  # DP rank d: stage s on port + d (P + 1) + s, its rendezvous on + P
    args = ["--role", "prefill", "--port", str(port), "--transfer-backend", backend, "--pp-size", str(P)]
    args += ["--pp-partition", ",".join(map(str, PARTITION)), "--worker-name", name, *DP_ARGS, "--prefix-cache"]
    args += [*engine_argv(worker_config(True)), *extra]
    prefill = cluster._serve(name, f"127.0.0.1:{port}", args)
    cells = [[f"127.0.0.1:{port + d * (P + 1) + s}" for s in range(P)] for d in range(2)]
    for a in [*dranks, *(a for row in cells for a in row)]:
        wait_for(lambda a=a: fetch_health(a).ok, 300, f"{a} healthy", cluster.procs)
    return prefill, decode, dranks, cells


@pytest.fixture(scope="module", params=(("mooncake", False), ("nixl", True)), ids=("mooncake-tp1", "nixl-dp2"))
def world(request, tmp_path_factory):
    """mooncake: into a TP-1 decode; nixl: into a decode with DP attention (2 ranks)."""
    backend, dp_decode = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"prefill-dp-pp-{backend}"))
    server = None
    try:
        prefill, decode, dranks, cells = start(cluster, "pdp", backend=backend, dp_decode=dp_decode)
        router = cluster.router([cells[0][0]], [decode.addr])  # DP rank 1 of each comes from its rank 0's health
        want = 2 * len(dranks)
        wait_for(lambda: len(router.peers.usable_pairs()) == want, 120, "every rank pair", cluster.procs)
        server = LiveServer(create_app(router, MODEL, load_tokenizer(tiny_path(ARCH), 512))).start()
        yield cluster, prefill, dranks, cells, router, server
    finally:
        if server is not None:
            server.stop()
        cluster.close()


def http_complete(server, prompts, params: SamplingParams) -> list[dict]:
    """POST /v1/completions with token-id prompts (one request each, all at once): the JSON replies in order."""

    def one(p: list[int]) -> dict:
        body = {"model": MODEL, "prompt": p, "max_tokens": params.max_new_tokens, "ignore_eos": True}
        body["temperature"] = params.temperature
        if params.temperature:
            body.update(top_k=params.top_k, seed=params.seed)
        r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def stage_bytes(s: int, pages: int) -> int:
    spec = ModelSpec.from_path(tiny_path(ARCH))
    a = sum(PARTITION[:s])
    lay = KVLayout(spec, a, a + PARTITION[s], kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    return pages * lay.bytes_per_page


def settled(cells: list[list[str]], decode: list[str], procs=()) -> None:
    """No page on any decode rank; every cell holds no job and no page but its prefix cache's, its books balanced."""
    assert_clean(decode, procs=procs)

    def clean(a: str) -> bool:
        h = fetch_health(a)
        return (h.jobs, h.pages_used - (h.cache_pages or 0), h.integrity) == (0, 0, "ok")

    for a in (a for row in cells for a in row):
        wait_for(lambda a=a: clean(a), 30, f"prefill cell {a}: no job, no page but the cache's", procs)


def cell_bytes(cells: list[list[str]]) -> list[list[int]]:
    """The bytes each (DP rank d, stage s) cell wrote to the decode so far (its transfer engine's count)."""
    return [[fetch_health(a).transfer.bytes for a in row] for row in cells]


def pairs_of(addrs: list[str]) -> list[dict[str, int]]:
    return [dict(fetch_health(a).kv_bytes_pairs or {}) for a in addrs]


def router_current(router, ranks: list[str]) -> bool:
    """The router's view of each rank's free pages is the rank's own (its placement by load is decided on it)."""
    views = [router.peers.prefills[a].health for a in ranks]
    return all(v is not None and v.pages_free == fetch_health(a).pages_free for v, a in zip(views, ranks, strict=True))


def submitted(addrs: list[str]) -> list[int]:
    return [fetch_health(a).counters["submitted"] for a in addrs]


def test_prefill_dp2_pp2_tokens_bytes_and_ranks(world, reference):
    cluster, prefill, dranks, cells, router, server = world
    ranks = [row[0] for row in cells]
    for d, row in enumerate(cells):
        for s, a in enumerate(row):
            h = fetch_health(a)
            assert (h.ok, h.name, h.stage, h.num_stages, h.pages_total) == (True, f"pdp.dp{d}", s, P, NUM_PAGES), h
            assert (h.dp_rank, h.dp_size, h.dp_addrs) == (d, 2, ranks), h
    rows = {row["addr"]: row for row in router.health()["prefill"]}
    assert [(rows[a]["dp_rank"], rows[a]["instance"], rows[a]["num_stages"]) for a in ranks] == [
        (0, ranks[0], P),
        (1, ranks[0], P),
    ], rows

    for params, ref in ((GREEDY, reference["greedy"]), (SAMPLED, reference["sampled"])):
        got = http_complete(server, PROMPTS, params)
        assert [c["choices"][0]["token_ids"] for c in got] == ref, got
    settled(cells, dranks, cluster.procs)

    # one at a time, cached nowhere: placed by load; its two stages send its keys, nothing else
    def check(d: int, i: int, before: list[list[int]], pairs: list[dict[str, int]]) -> None:
        gained = [[n - b for n, b in zip(x, y, strict=True)] for x, y in zip(cell_bytes(cells), before, strict=True)]
        pages = ceil_div(len(FRESH[i]), PAGE_SIZE)
        want = [[stage_bytes(s, pages) if r == d else 0 for s in range(P)] for r in range(2)]
        assert gained == want, (d, gained, want)
        if len(dranks) > 1:  # a DP decode: one of its ranks got every key, from DP rank d's cells, each once
            diff = [{k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)} for a, b in
                    zip(pairs_of(dranks), pairs, strict=True)]  # fmt: skip
            (r,) = [r for r, x in enumerate(diff) if x]
            assert diff[r] == {f"pdp.dp{d}:{s}->dp{r}": want[d][s] for s in range(P)}, diff

    holders = place_fresh(world, reference, check)
    assert sorted(holders) == [0, 1], holders  # both DP ranks served


def place_fresh(world, reference, check=None) -> dict[int, int]:
    """Send FRESH prompts (cached nowhere yet) one at a time until each DP rank caches one: each goes to the rank
    with more free pages (load), and 2 whole pages of it stay in that rank's cache, so the lead moves. {DP rank:
    FRESH index it caches}; `check(d, i, cell bytes before, decode pairs before)` after each."""
    cluster, prefill, dranks, cells, router, server = world
    ranks = [row[0] for row in cells]
    aff = router.peers.affinity
    holders: dict[int, int] = {}
    for i, prompt in enumerate(FRESH):
        cached = [r for r in range(2) if aff.matched(ranks[r], page_hashes(prompt, PAGE_SIZE)) == 2]
        if cached:
            holders.setdefault(cached[0], i)
            continue
        if len(holders) == 2:
            break
        wait_for(lambda: router_current(router, ranks), 30, "the router's view of both ranks current")
        before, sent, pairs = cell_bytes(cells), submitted(ranks), pairs_of(dranks)
        (out,) = run_requests(router, [prompt], GREEDY, f"fresh-{i}-{len(holders)}", timeout=120)
        assert out == (reference["fresh"][i], "length", None), out
        (d,) = [r for r, (n, b) in enumerate(zip(submitted(ranks), sent, strict=True)) if n != b]
        if check is not None:
            check(d, i, before, pairs)
        settled(cells, dranks, cluster.procs)
        mine = page_hashes(prompt, PAGE_SIZE)
        wait_for(lambda a=ranks[d], h=mine: aff.matched(a, h) == 2, 30, "its pages mirrored by the router")
        holders.setdefault(d, i)
    return holders


def test_prefix_affinity_per_dp_rank(world, reference):
    """A prompt whose first 2 pages one DP rank caches (and the other not) goes to that rank, whatever the load,
    with 32 hit tokens there and the single-rank tokens; for each rank."""
    cluster, prefill, dranks, cells, router, server = world
    ranks = [row[0] for row in cells]
    holders = place_fresh(world, reference)
    assert sorted(holders) == [0, 1], holders
    for d, i in sorted(holders.items()):
        hits, sent = [fetch_health(a).prefix_cache["hit_tokens"] for a in ranks], submitted(ranks)
        picked = router.peers.prefills[ranks[d]].picked_affinity
        (out,) = run_requests(router, [AGAIN[i]], GREEDY, f"again-{i}", timeout=120)
        assert out == (reference["again"][i], "length", None), out
        gained = [n - b for n, b in zip(submitted(ranks), sent, strict=True)]
        hit = [h2 - h for h2, h in zip((fetch_health(a).prefix_cache["hit_tokens"] for a in ranks), hits, strict=True)]
        assert (gained, hit) == ([int(r == d) for r in range(2)], [32 * (r == d) for r in range(2)]), (d, gained, hit)
        assert router.peers.prefills[ranks[d]].picked_affinity == picked + 1
        settled(cells, dranks, cluster.procs)


def test_prefill_dp_pp_sigterm_stops_every_process(world):
    """SIGTERM to the command: (0, 0)'s stop round stops (1, 0), each (d, 0) sends STOP down its pipeline; each EP
    group sees its DP rank 1 exit 0, both stages exit 0, the command exits 0, nothing is reported down."""
    cluster, prefill, dranks, cells, router, server = world
    pids = [fetch_health(a).pid for row in cells for a in row]
    prefill.signal(signal.SIGTERM)
    assert prefill.wait(120) == 0, prefill.tail(60)
    log = prefill.tail(400)
    for s in range(P):
        assert f"DP group stopped: dp rank 1 pipeline stage {s} exited 0" in log, log[-4000:]
    assert "prefill: stopped: stage 0 exited 0, stage 1 exited 0" in log, log[-4000:]
    assert "Traceback" not in log and "DP rank down" not in log, log[-4000:]
    wait_for(lambda: all(pid_gone(p) for p in pids), 30, "every prefill process gone")


def test_prefill_dp_pp_cell_killed_only_its_dp_rank_fails(tmp_path, reference):
    """kill -9 of (DP rank 1, stage 1) while a request of DP rank 1 waits in its transfer (--debug-transfer-delay):
    that request fails naming DP rank 1; (1, 0) leaves; each stage's EP group re-forms without DP rank 1 (its
    experts loaded onto DP rank 0); the router takes rank 1 out with rank 0's reason; DP rank 0 keeps serving with
    the single-rank tokens and leaks no page; (0, 1) names the dead cell and its signal."""
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        prefill, decode, dranks, cells = start(cluster, "pk", ["--debug-transfer-delay", "2.0"])
        ranks = [row[0] for row in cells]
        router = cluster.router([ranks[0]], [decode.addr])
        wait_for(lambda: len(router.peers.usable_pairs()) == 2, 120, "both DP ranks paired", cluster.procs)
        for i in (0, 2):  # until DP rank 0 caches more pages (PROMPTS[0]: 1 whole page, PROMPTS[2]: 2) ...
            if fetch_health(ranks[0]).cache_pages > fetch_health(ranks[1]).cache_pages:
                break
            wait_for(lambda: router_current(router, ranks), 30, "the router's view of both ranks current")
            (out,) = run_requests(router, [PROMPTS[i]], GREEDY, f"before-{i}", timeout=120)
            assert out == (reference["greedy"][i], "length", None), out
            settled(cells, dranks, cluster.procs)  # its pages released into its rank's cache
        assert fetch_health(ranks[0]).cache_pages > fetch_health(ranks[1]).cache_pages
        wait_for(lambda: router_current(router, ranks), 30, "the router's view of both ranks current")
        router.submit("lost", list(PROMPTS[1]), GREEDY)  # ... so the next goes to DP rank 1 (more free pages)
        where = lambda: [fetch_health(a).jobs for row in cells for a in row]  # noqa: E731
        wait_for(lambda: where()[3] == 1, 30, f"the request on (1, 1), transferring (jobs per cell: {where()})")
        victim, leaver = fetch_health(cells[1][1]).pid, fetch_health(cells[1][0]).pid
        os.kill(victim, signal.SIGKILL)
        toks, reason, error = run_requests_events(router, ["lost"])[0]
        assert reason == "error" and f"prefill pk.dp1 stage 1 at {cells[1][1]} is dead" in error, (toks, error)

        wait_for(lambda: pid_gone(leaver), 60, "(1, 0) left the instance", [prefill])
        wait_for(lambda: not router.peers.prefills[ranks[1]].ok, 30, "the router marks DP rank 1 down")
        assert [p for p, _ in router.peers.usable_pairs()] == [ranks[0]], router.peers.usable_pairs()
        # (1, 0)'s exit and why it left (noted in stage 0's EP group store before it exited: its pipeline broke)
        left = f"dp rank 1 pipeline stage 0 (pid {leaver}) exited with status 3: it left: DP rank down: dp rank 1"
        # DP rank 1's row by its rank: between a re-form and the next lockstep round rank 0's health has no row of
        # its own (LockstepEngine.rows is empty), only the down rows
        row1 = lambda: [(x.rank, x.up, x.down or "") for x in fetch_health(ranks[0]).dp_ranks if x.rank == 1]  # noqa: E731
        wait_for(lambda: [(r, u) for r, u, _ in row1()] == [(1, False)], 30, "DP rank 0's row of DP rank 1: down")
        why = row1()[0][2]
        assert why.startswith(left) and why.endswith("): not restarted (restart the instance)"), why
        killed = f"dp rank 1 pipeline stage 1 (pid {victim}) was killed by signal 9 (SIGKILL): not restarted"
        killed += " (restart the instance)"
        assert [(x.rank, x.up, x.down) for x in fetch_health(cells[0][1]).dp_ranks] == [(1, False, killed)]

        got = run_requests(router, PROMPTS, GREEDY, "after", timeout=120)  # rank 0 alone, all experts
        assert got == [(t, "length", None) for t in reference["greedy"]], got
        assert fetch_health(ranks[0]).ok and prefill.alive()
        settled([cells[0]], dranks, [prefill])  # 0 pages leaked on DP rank 0 (and the decode)
    finally:
        cluster.close()


def run_requests_events(router, rids: list[str], timeout: float = 120.0) -> list[tuple[list[int], str | None, str]]:
    out = []
    for rid in rids:
        toks: list[int] = []
        end: tuple[str | None, str] = (None, "")
        for ev in router.events(rid, timeout):
            toks += ev.new_token_ids
            if ev.finished:
                end = (ev.finish_reason, ev.error or "")
        out.append((toks, *end))
    return out
