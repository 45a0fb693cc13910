"""A prefill instance with DP attention (`dsakv serve --role prefill --tp-size 2 --dp-size 2 --enable-dp-attention
--ep-size 2 --prefix-cache`): two rank processes, each a whole prefill of its own (RPC on --port + rank, its own pool,
prefix cache, scheduler, transfer engine), the MoE expert-parallel over both in lockstep; mooncake into a TP-1 decode
and nixl into a decode with DP attention (DP 2), through the router over real HTTP.

Checked: the router finds prefill rank 1 from rank 0's health and spreads requests over both ranks (each rank's
submitted counter, the router's per-rank rows and /metrics series); tokens equal the single-rank engine (greedy and
seeded); each rank sends its own requests' keys (the DP decode's bytes per (prefill rank, decode rank) pair); prefix
affinity per prefill rank (a repeated prompt goes to the rank that caches it: its hit tokens); kill -9 of prefill
rank 1 with a request on each rank: only rank 1's request fails, naming it; the router takes it out of routing; rank
0's request and new requests finish with the single-rank tokens; 0 pages leaked on the survivor; rank 1 restarts and
is routed to again. The transfers wait DELAY s (--debug-transfer-delay) so a request stays on its rank for a while.
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
)
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.testing.listen import child_pids
from dsakv.testing.servers import MODEL, LiveServer

pytestmark = [pytest.mark.timeout(420)]

ARCH = "glm_moe_dsa"
DP = DP_ARGS
DELAY = "2.0"  # seconds each prefill rank waits before a transfer: a request is on its rank that long at least
LENGTHS = (17, 23, 29, 31)  # two pages each
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)

g = torch.Generator().manual_seed(43)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]
SHARED = [torch.randint(2, 512, (70,), generator=g).tolist() for _ in range(2)]  # 4 whole pages + 6 tokens each
FRESH = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (19, 21)]  # cached nowhere: placed by load


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {
        "greedy": eng.generate(PROMPTS, GREEDY),
        "sampled": eng.generate(PROMPTS, SAMPLED),
        "shared": eng.generate(SHARED, GREEDY),
        "fresh": eng.generate(FRESH, GREEDY),
    }


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, tmp_path_factory):
    """mooncake: prefill DP 2 -> decode TP 1; nixl: prefill DP 2 -> decode DP 2."""
    backend = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"prefill-dp-{backend}"))
    server = None
    try:
        spec = ModelSpec.from_path(tiny_path(ARCH))
        port = free_ports(2)  # prefill rank r listens on port + r
        dport = free_ports(2)
        ddp = [*DP, "--worker-name", "dec"] if backend == "nixl" else ["--worker-name", "dec"]
        decode = cluster.decode("dec", backend, True, port=dport, extra=ddp)
        extra = [*DP, "--prefix-cache", "--debug-transfer-delay", DELAY]
        (prefill,) = cluster.prefill("pdp", backend, True, (spec.num_layers,), port=port, extra=extra)
        cluster.wait_healthy([prefill, decode], timeout=240)
        pranks = cluster.dp_ranks(prefill, 2)
        dranks = cluster.dp_ranks(decode, 2 if backend == "nixl" else 1)
        router = cluster.router([prefill.addr], [decode.addr])  # rank 1 of each comes from its rank 0's health
        want = len(pranks) * len(dranks)
        wait_for(lambda: len(router.peers.usable_pairs()) == want, 90, "every rank pair handshaken", cluster.procs)
        server = LiveServer(create_app(router, MODEL, load_tokenizer(tiny_path(ARCH), 512))).start()
        yield backend, cluster, prefill, pranks, dranks, router, server
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


def settled(prefills: list[str], decodes: list[str], procs=()) -> None:
    """Every decode holds no page; every prefill rank holds no job and no page but its prefix cache's; all balance."""
    assert_clean(decodes, procs=procs)

    def clean(a: str) -> bool:
        h = fetch_health(a)
        return (h.jobs, h.pages_used - (h.cache_pages or 0), h.integrity) == (0, 0, "ok")

    for a in prefills:
        wait_for(lambda a=a: clean(a), 20, f"prefill {a}: no job, no page but the cache's, integrity ok", procs)


def submitted(addrs: list[str]) -> list[int]:
    return [fetch_health(a).counters["submitted"] for a in addrs]


def test_prefill_dp2_tokens_per_rank_over_http(world, reference):
    backend, cluster, prefill, pranks, dranks, router, server = world
    for r, a in enumerate(pranks):
        h = fetch_health(a)
        assert h.ok and h.down is None and h.pages_total == NUM_PAGES, h
        assert (h.name, h.dp_rank, h.dp_size, h.dp_addrs) == (f"pdp.dp{r}", r, 2, pranks), h
    rows = {row["addr"]: row for row in router.health()["prefill"]}
    assert [(rows[a]["dp_rank"], rows[a]["instance"], rows[a]["ok"]) for a in pranks] == [
        (0, pranks[0], True),
        (1, pranks[0], True),
    ], rows

    before = submitted(pranks)
    bytes_before = [dict(fetch_health(a).kv_bytes_pairs or {}) for a in dranks]
    for params, ref in ((GREEDY, reference["greedy"]), (SAMPLED, reference["sampled"])):
        got = http_complete(server, PROMPTS, params)
        assert [c["choices"][0]["token_ids"] for c in got] == ref, got
        assert {c["choices"][0]["finish_reason"] for c in got} == {"length"}
    per_rank = [n - b for n, b in zip(submitted(pranks), before, strict=True)]
    assert sum(per_rank) == 2 * len(PROMPTS) and min(per_rank) >= 1, per_rank  # both prefill ranks served
    settled(pranks, dranks, cluster.procs)

    def rows0() -> list[tuple]:  # rank 0's per-rank rows, as of the last lockstep round
        return [(x.rank, x.addr, x.pages_total, x.running, x.waiting, x.up) for x in fetch_health(pranks[0]).dp_ranks]

    want = [(r, a, NUM_PAGES, 0, 0, True) for r, a in enumerate(pranks)]
    wait_for(lambda: rows0() == want, 30, "rank 0's per-rank rows", cluster.procs)
    labs = [f'{{role="prefill",addr="{a}",name="pdp.dp{r}",instance="{pranks[0]}",dp_rank="{r}"}}' for r, a in
            enumerate(pranks)]  # fmt: skip
    m = router.metrics()
    assert [m[f"instance_picked_total{lab}"] >= n for lab, n in zip(labs, per_rank, strict=True)] == [True, True]
    assert [m[f"instance_up{lab}"] for lab in labs] == [1.0, 1.0]
    if backend == "nixl":  # decode DP 2: each prefill rank wrote its own requests' keys, each decode rank its own
        spec = ModelSpec.from_path(tiny_path(ARCH))
        lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
        new: dict[str, int] = {}
        for d, a in enumerate(dranks):
            for k, v in (fetch_health(a).kv_bytes_pairs or {}).items():
                if v - bytes_before[d].get(k, 0):
                    new[k] = v - bytes_before[d].get(k, 0)
        assert {k.split("->")[0] for k in new} == {"pdp.dp0:0", "pdp.dp1:0"}, new
        assert sum(new.values()) == 2 * len(PROMPTS) * 2 * lay.bytes_per_page, new  # 2 pages each, once


def test_prefix_affinity_per_prefill_rank(world, reference):
    """Two prompts at once land one on each rank (load); each again: it goes to the rank that caches it (4 whole
    pages: 64 hit tokens there), with the single-rank tokens."""
    backend, cluster, prefill, pranks, dranks, router, server = world
    before = submitted(pranks)
    got = http_complete(server, SHARED, GREEDY)
    assert [c["choices"][0]["token_ids"] for c in got] == reference["shared"], got
    placed = [n - b for n, b in zip(submitted(pranks), before, strict=True)]
    assert placed == [1, 1], placed

    def owners() -> list[list[int]]:  # per prompt, its pages each rank caches as the router's mirror has it
        aff = router.peers.affinity
        return [[aff.matched(a, page_hashes(p, PAGE_SIZE)) for a in pranks] for p in SHARED]

    mirrored = wait_for(lambda: sorted(owners()) == [[0, 4], [4, 0]] and owners(), 30, "each rank's cache mirrored")
    hits = [fetch_health(a).prefix_cache["hit_tokens"] for a in pranks]
    aff = [router.peers.prefills[a].picked_affinity for a in pranks]
    for i, p in enumerate(SHARED):  # one at a time: load cannot decide
        got = http_complete(server, [p], GREEDY)
        assert got[0]["choices"][0]["token_ids"] == reference["shared"][i], got
    hits2 = [fetch_health(a).prefix_cache["hit_tokens"] for a in pranks]
    assert [h2 - h for h2, h in zip(hits2, hits, strict=True)] == [64, 64], (mirrored, hits, hits2)
    aff2 = [router.peers.prefills[a].picked_affinity for a in pranks]
    assert [x2 - x for x2, x in zip(aff2, aff, strict=True)] == [1, 1], (aff, aff2)
    settled(pranks, dranks, cluster.procs)


def test_prefill_dp_rank_killed_fails_only_its_requests(world, reference):
    backend, cluster, prefill, pranks, dranks, router, server = world
    rids = [f"{backend}-pkill-{i}" for i in range(2)]
    for rid, p in zip(rids, FRESH, strict=True):
        router.submit(rid, list(p), GREEDY)
    jobs = wait_for(lambda: [fetch_health(a).jobs for a in pranks] == [1, 1], 10, "one request on each prefill rank")
    (rank1,) = child_pids(prefill.pid)
    os.kill(rank1, signal.SIGKILL)
    ends = run_requests_events(router, rids)
    failed = [i for i, (_, reason, _) in enumerate(ends) if reason == "error"]
    assert len(failed) == 1, ends
    (lost,) = failed
    assert f"prefill pdp.dp1 stage 0 at {pranks[1]} is " in ends[lost][2], ends[lost]
    assert ends[1 - lost][1] == "length" and ends[1 - lost][0] == reference["fresh"][1 - lost], (jobs, ends)

    # the router took rank 1 out of routing (its error with rank 0's reason: the exit status)
    dead = f"dp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
    wait_for(lambda: not router.peers.prefills[pranks[1]].ok, 30, "the router marks prefill rank 1 down")
    assert all(p == pranks[0] for p, _ in router.peers.usable_pairs()), router.peers.usable_pairs()
    err = router.peers.prefills[pranks[1]].error or ""
    assert pranks[1] in err, err
    wait_for(
        lambda: [(x.rank, x.up, x.down) for x in fetch_health(pranks[0]).dp_ranks or []][1:] in ([(1, False, dead)],
                [(1, True, None)]), 30, "rank 1 down (or back) in rank 0's rows")  # fmt: skip

    got = run_requests(router, PROMPTS, GREEDY, f"{backend}-pdp-after", timeout=120)
    assert [t for t, _, _ in got] == reference["greedy"], got
    settled(pranks[:1], dranks, [prefill])  # 0 pages leaked on the survivor (and the decode)

    # rank 0 restarts rank 1: it rejoins and is paired and routed to again
    wait_for(lambda: router.peers.prefills[pranks[1]].ok, 240, "prefill rank 1 back", cluster.procs)
    (again,) = child_pids(prefill.pid)
    assert again != rank1 and fetch_health(pranks[1]).pid == again
    want = len(pranks) * len(dranks)
    wait_for(lambda: len(router.peers.usable_pairs()) == want, 90, "rank 1 paired again", cluster.procs)
    settled(pranks, dranks, cluster.procs)


def test_prefill_dp_stops_cleanly(world):
    """SIGTERM to rank 0: the stop round reaches rank 1, both stop, rank 0 exits 0 having seen rank 1 exit 0."""
    backend, cluster, prefill, pranks, dranks, router, server = world
    (rank1,) = child_pids(prefill.pid)
    prefill.signal(signal.SIGTERM)
    assert prefill.wait(60) == 0, prefill.tail()
    assert "DP group stopped: dp rank 1 exited 0" in prefill.tail(200), prefill.tail()
    wait_for(lambda: pid_gone(rank1), 10, "rank 1 gone")


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


def test_prefill_dp_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """What prefill DP attention does not do yet is refused by name before anything starts (exit 2)."""
    from dsakv.cli.main import main

    model = str(tiny_path(ARCH))
    pre = ["--role", "prefill", *DP]
    four = ["--tp-size", "4", "--dp-size", "4", "--ep-size", "4"]
    cases = [
        (["--pp-size", "2", "--port", "65531"], "--pp-size 2: DP rank d uses --port + d x 3 .. + 2 (its stages and"),
        (["--pp-size", "2", "--speculative-num-steps", "2"], "--enable-dp-attention with --role prefill --specul"),
        (["--speculative-num-steps", "2"], "--enable-dp-attention with --role prefill --speculative-num-steps is not"),
        (["--prefix-cache", "--hicache-ratio", "2"], "--enable-dp-attention with --role prefill and a host or storage"),
        (["--port", "65533", *four], "--port 65533 with --dp-size 4: DP rank r listens on --port + r, up to 65536"),
        (["--tp-size", "3", "--dp-size", "3", "--ep-size", "3"], "n_routed_experts = 8 is not divisible by --ep-size"),
    ]
    for extra, msg in cases:
        port = [] if "--port" in extra else ["--port", str(free_ports(3))]
        assert main(["serve", "--model", model, *port, *pre, *extra]) == 2, extra
        assert msg in capsys.readouterr().err, extra
    argv = ["serve", "--role", "router", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10", *DP]
    assert main(argv) == 2
    assert "--enable-dp-attention is not supported: the router runs no model" in capsys.readouterr().err
