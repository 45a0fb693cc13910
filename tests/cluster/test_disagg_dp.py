"""A decode instance with DP attention (`dsakv serve --role decode --tp-size 2 --dp-size 2 --enable-dp-attention
--ep-size 2`) fed by a TP-1 prefill, over each real transfer backend: two DP rank processes, each its own pool,
scheduler, requests and transfer engine (RPC on --port + rank), the MoE expert-parallel over both in lockstep.

Checked: tokens equal the single-rank colocated engine (greedy and seeded; a TP-2 prefill too, each request's
keys spread over both prefill ranks); the router finds rank 1 from rank 0's
health and spreads the requests over both ranks by load; each DP rank receives exactly its own requests' keys
(bytes per (prefill rank, DP rank) pair == the layout figure x its requests' pages); per-rank health rows; clean
pools. kill -9 of DP rank 1 under load: only its request fails (naming it and its exit status), the group
re-forms over rank 0 whose request finishes with the single-rank tokens, 0 pages leaked; the restarted rank
rejoins and is routed to again.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.transfer.rank_assign import RankId, assign
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
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

pytestmark = [pytest.mark.timeout(420)]

ARCH = "glm_moe_dsa"
LENGTHS = (17, 23, 29, 31)  # two pages each: a rank's bytes are 2 pages x its request count
PAGES_EACH = 2
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=600, ignore_eos=True)  # decodes for seconds: the kill lands mid-decode
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)
LONG_SEEDED = SamplingParams(max_new_tokens=600, ignore_eos=True, temperature=0.9, top_k=40, seed=78)
DP = DP_ARGS

g = torch.Generator().manual_seed(41)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {
        "greedy": eng.generate(PROMPTS, GREEDY),
        "sampled": eng.generate(PROMPTS[:2], SAMPLED),
        "long": eng.generate(PROMPTS[:2], LONG_SEEDED),
    }


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, tmp_path_factory):
    backend = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"decode-dp-{backend}"))
    try:
        spec = ModelSpec.from_path(tiny_path(ARCH))
        port = free_ports(2)  # rank r listens on port + r
        decode = cluster.decode("ddp2", backend, True, port=port, extra=[*DP, "--worker-name", "ddp2"])
        prefill = cluster.prefill("p1", backend, True, (spec.num_layers,))
        ptp = cluster.prefill("p2", backend, True, (spec.num_layers,), extra=["--tp-size", "2"])
        cluster.wait_healthy([*prefill, *ptp, decode], timeout=240)
        ranks = cluster.dp_ranks(decode, 2)
        router = cluster.router([prefill[0].addr], [decode.addr])  # rank 1 comes from rank 0's health
        wait_for(lambda: len(router.peers.usable_pairs()) == 2, 90, "both DP ranks paired", cluster.procs)
        yield backend, cluster, decode, ranks, prefill, router, ptp
    finally:
        cluster.close()


def test_decode_dp2_tokens_routing_and_bytes_per_rank(world, reference):
    backend, cluster, decode, ranks, prefill, router, _ = world
    spec = ModelSpec.from_path(tiny_path(ARCH))
    for r, addr in enumerate(ranks):
        h = fetch_health(addr)
        assert h.ok and h.down is None and h.pages_total == NUM_PAGES, h
        assert (h.dp_rank, h.dp_size, h.dp_addrs) == (r, 2, ranks), h
        assert h.name == f"ddp2.dp{r}"

    got = run_requests(router, PROMPTS, GREEDY, f"{backend}-dp-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert {(r, e) for _, r, e in got} == {("length", None)}
    got = run_requests(router, PROMPTS[:2], SAMPLED, f"{backend}-dp-s")
    assert [t for t, _, _ in got] == reference["sampled"], got

    # the router spreads by load: four long requests submitted at once decode two on each rank
    rids = [f"{backend}-dp-spread-{i}" for i in range(4)]
    for rid, p in zip(rids, PROMPTS, strict=True):
        router.submit(rid, list(p), LONG)
    wait_for(lambda: [fetch_health(a).running for a in ranks] == [2, 2], 60, "two requests on each rank", cluster.procs)
    rows = {row["addr"]: row for row in router.health()["decode"]}
    assert [(rows[a]["dp_rank"], rows[a]["instance"], rows[a]["in_flight"]) for a in ranks] == [
        (0, ranks[0], 2),
        (1, ranks[0], 2),
    ], rows
    for rid in rids:
        router.abort(rid)
    assert_clean([*ranks, prefill[0].addr], procs=cluster.procs)

    # each DP rank received its own requests' keys only: pages x the layout's bytes per page, exactly
    lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    per_request = PAGES_EACH * lay.bytes_per_page
    keys = list(lay.by_key)
    a = assign({RankId(0, 0, 0): keys}, {RankId(0, 0, 0): keys}, {k: b.page_bytes for k, b in lay.by_key.items()})
    assert a.transfers(RankId(0, 0, 0)) == len(keys)  # one receiver per key: the DP rank that holds the request
    hs = [fetch_health(a) for a in ranks]
    started = [h.counters["started"] for h in hs]
    assert sum(started) == len(PROMPTS) + 2 + 4 and min(started) >= 2, started
    for r, h in enumerate(hs):
        assert h.kv_bytes_pairs == {f"p1:0->dp{r}": started[r] * per_request}, (started, h.kv_bytes_pairs)
        assert h.counters["kv_bytes"] == started[r] * per_request

    def rows0() -> list[tuple[int, str, int, int, int, int]]:  # per-rank rows as of the last lockstep round
        h0 = fetch_health(ranks[0])
        return [(x.rank, x.addr, x.pages_used, x.pages_total, x.running, x.waiting) for x in h0.dp_ranks or []]

    # the rounds after the aborts reach rank 0's rows later than each rank's own books (ci, under load: one round
    # behind): wait for them, then they must read exactly the clean pools
    want_rows = [(0, ranks[0], 0, NUM_PAGES, 0, 0), (1, ranks[1], 0, NUM_PAGES, 0, 0)]
    wait_for(lambda: rows0() == want_rows, 30, "rank 0's per-rank rows clean", cluster.procs)
    labs = [
        f'{{role="decode",addr="{a}",name="ddp2.dp{r}",instance="{ranks[0]}",dp_rank="{r}"}}'
        for r, a in enumerate(ranks)
    ]

    def gauges() -> list[tuple[float, float]]:  # the router's /metrics, one series per DP rank (its last health poll)
        m = router.metrics()
        return [(m[f"instance_up{lab}"], m[f"instance_pages_used{lab}"]) for lab in labs]

    wait_for(lambda: gauges() == [(1.0, 0.0), (1.0, 0.0)], 10, "the router's gauges per DP rank", cluster.procs)


def test_tp2_prefill_into_dp2_decode_spreads_each_rank_keys_over_both_senders(world, reference):
    """Prefill TP 2 -> decode DP 2: each request's keys go to its DP rank only, each key from one of the two
    prefill ranks (the sender rule over a one-part link), both senders carrying bytes; tokens == one rank."""
    backend, cluster, decode, ranks, prefill, _, ptp = world
    before = [dict(fetch_health(a).kv_bytes_pairs or {}) for a in ranks]
    started = [fetch_health(a).counters["started"] for a in ranks]
    router = cluster.router([ptp[0].addr], [decode.addr])
    wait_for(lambda: len(router.peers.usable_pairs()) == 2, 90, "both DP ranks paired with p2", cluster.procs)
    got = run_requests(router, PROMPTS, GREEDY, f"{backend}-tp2dp-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    spec = ModelSpec.from_path(tiny_path(ARCH))
    lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    assert_clean([*ranks, ptp[0].addr], procs=cluster.procs)
    total = 0
    for r, a in enumerate(ranks):
        h = fetch_health(a)
        new = {k: v - before[r].get(k, 0) for k, v in (h.kv_bytes_pairs or {}).items() if k.startswith("p2:")}
        n = h.counters["started"] - started[r]
        assert sum(new.values()) == n * PAGES_EACH * lay.bytes_per_page, (n, new)  # its own requests' keys, once
        if n:  # every request's keys spread over both prefill ranks (no rank-0 hotspot, no dummy transfer)
            assert sorted(new) == [f"p2:0.tp0->dp{r}", f"p2:0.tp1->dp{r}"] and min(new.values()) > 0, new
        total += n
    assert total == len(PROMPTS)


def children(pid: int) -> list[int]:
    return child_pids(pid)


def rows0(addr: str) -> list[tuple[int, bool, str | None]]:
    """Rank 0's per-rank view: (DP rank, up, why down)."""
    return [(x.rank, x.up, x.down) for x in fetch_health(addr).dp_ranks or []]


def finish(router, rid: str, timeout: float = 180.0) -> tuple[list[int], str | None, str]:
    toks: list[int] = []
    end: tuple[str | None, str] | None = None
    for ev in router.events(rid, timeout):
        toks += ev.new_token_ids
        if ev.finished:
            end = (ev.finish_reason, ev.error or "")
    assert end is not None, rid
    return toks, end[0], end[1]


def test_dp_rank_killed_fails_only_its_requests_the_group_reforms_and_it_rejoins(world, reference):
    """kill -9 of DP rank 1 while each rank decodes one long request: rank 1's request fails naming its DP rank and
    its exit status; the group re-forms over rank 0 (rank 1's experts loaded onto it), whose request goes on with
    its KV to tokens == the single-rank engine (seeded sampling, 600 tokens); rank 0's health row says rank 1 down;
    new requests succeed on rank 0;
    rank 0 restarts rank 1, which rejoins at a round boundary and is routed to again (tokens == one rank); every
    pool clean; killed again while idle, it is restarted again."""
    backend, cluster, decode, ranks, prefill, router, _ = world
    rids = [f"{backend}-kill-{i}" for i in range(2)]
    for rid, p in zip(rids, PROMPTS[:2], strict=True):  # seeded sampling: the held step draws nothing twice
        router.submit(rid, list(p), LONG_SEEDED)
    wait_for(
        lambda: [fetch_health(a).running for a in ranks] == [1, 1],
        60,
        "one request decoding on each rank",
        cluster.procs,
    )
    before = fetch_health(ranks[0]).counters["started"]
    (rank1,) = children(decode.pid)
    os.kill(rank1, signal.SIGKILL)
    dead = f"dp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
    wait_for(lambda: rows0(ranks[0]) == [(0, True, None), (1, False, dead)], 30, "rank 1 down in rank 0's rows")
    h = fetch_health(ranks[0])
    assert h.ok and h.down is None and h.running == 1, h  # rank 0's long request still decoding

    # new requests while rank 1 is down (its restart waits 1 s, then loads the model): all on rank 0
    got = run_requests(router, PROMPTS, GREEDY, f"{backend}-dp-down", timeout=120)
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert fetch_health(ranks[0]).counters["started"] == before + len(PROMPTS)

    ends = [finish(router, rid) for rid in rids]
    failed = [i for i, (_, reason, _) in enumerate(ends) if reason == "error"]
    assert len(failed) == 1, ends
    (lost,) = failed
    kept = 1 - lost
    lost_err = ends[lost][2]
    assert f"decode {ranks[1]} (DP rank 1 of 2 of the decode instance at {ranks[0]}) is unavailable" in lost_err
    assert f"its instance's rank 0 says: {dead}" in lost_err, lost_err
    assert ends[kept][1] == "length" and ends[kept][0] == reference["long"][kept], ends[kept][1:]
    assert_clean([ranks[0], prefill[0].addr], procs=[decode, *prefill])

    # rank 0 restarted rank 1; it rejoined (the group of 2 again, home experts) and is routed to again
    wait_for(lambda: rows0(ranks[0]) == [(0, True, None), (1, True, None)], 240, "rank 1 rejoined", cluster.procs)
    (again,) = children(decode.pid)
    assert again != rank1
    h1 = fetch_health(ranks[1])
    assert h1.ok and h1.name == "ddp2.dp1" and h1.pid == again and h1.counters["started"] == 0, h1
    wait_for(lambda: len(router.peers.usable_pairs()) == 2, 90, "both DP ranks paired again", cluster.procs)
    got = run_requests(router, PROMPTS, GREEDY, f"{backend}-dp-back", timeout=120)
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert fetch_health(ranks[1]).counters["started"] >= 1  # the router spreads them over both ranks again
    assert_clean([*ranks, prefill[0].addr], procs=cluster.procs)

    # killed again while the instance idles (a round's all_gather breaks, not a step): down, restarted, back
    os.kill(again, signal.SIGKILL)
    dead = f"dp rank 1 (pid {again}) was killed by signal 9 (SIGKILL)"
    wait_for(lambda: rows0(ranks[0]) == [(0, True, None), (1, False, dead)], 30, "rank 1 down again")
    wait_for(lambda: rows0(ranks[0]) == [(0, True, None), (1, True, None)], 240, "rank 1 back again", cluster.procs)
    (third,) = children(decode.pid)
    assert third not in (rank1, again) and fetch_health(ranks[1]).pid == third


def test_dp_serve_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad DP combinations of `dsakv serve` exit 2 with an error naming the value (nothing starts)."""
    from dsakv.cli.main import main

    model = str(tiny_path(ARCH))
    cases = [
        (["--role", "prefill", "--port", "65531", "--pp-size", "2", *DP], "--port 65531 with --dp-size 2 --pp-size 2"),
        ([*DP, "--pp-size", "2", "--prefix-cache"], "--pp-size 2 with the prefix cache (--prefix-cache / --hicache-*)"),
        (["--role", "decode", "--pp-size", "2", "--port", "65531", *DP], "cell (DP rank d, stage s) listens on"),
        (["--role", "decode", "--port", "65535", *DP], "--port 65535 with --dp-size 2: DP rank r listens on"),
        (["--role", "decode", *DP[:4], "--enable-dp-attention", "--ep-size", "1"], "give --ep-size 2, not 1"),
        (
            ["--role", "decode", "--tp-size", "3", "--dp-size", "3", "--enable-dp-attention", "--ep-size", "3"],
            "n_routed_experts = 8 is not divisible by --ep-size 3",
        ),
    ]
    for extra, msg in cases:
        port = [] if "--port" in extra else ["--port", str(free_ports(3))]
        assert main(["serve", "--model", model, *port, *extra]) == 2, extra
        assert msg in capsys.readouterr().err, extra
