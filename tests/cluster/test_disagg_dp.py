"""A decode instance with DP attention (`dsakv serve --role decode --tp-size 2 --dp-size 2 --enable-dp-attention
--ep-size 2`) fed by a TP-1 prefill, over each real transfer backend: two DP rank processes, each its own pool,
scheduler, requests and transfer engine (RPC on --port + rank), the MoE expert-parallel over both in lockstep.

Checked: tokens equal the single-rank colocated engine (greedy and seeded; a TP-2 prefill too, each request's
keys spread over both prefill ranks); the router finds rank 1 from rank 0's
health and spreads the requests over both ranks by load; each DP rank receives exactly its own requests' keys
(bytes per (prefill rank, DP rank) pair == the layout figure x its requests' pages); per-rank health rows; clean
pools. kill -9 of DP rank 1: the EP all-to-all needs every rank, so the whole instance fails all its requests,
each naming the dead rank, rank 0 says down and holds no page; the prefill holds nothing.
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
DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]

g = torch.Generator().manual_seed(41)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "sampled": eng.generate(PROMPTS[:2], SAMPLED)}


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
        ranks = [decode.addr, f"127.0.0.1:{port + 1}"]
        wait_for(lambda: fetch_health(ranks[1]).ok, 60, "DP rank 1 healthy", cluster.procs)
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


def test_dp_rank_killed_fails_the_instance_names_it_leaks_nothing(world):
    """kill -9 of DP rank 1 while each rank decodes one request: both fail (rank 0's naming the dead rank and its
    signal, rank 1's naming its DP rank as unavailable); rank 0 says down, frees every page; the prefill holds
    nothing; the router routes nothing there."""
    backend, cluster, decode, ranks, prefill, router, _ = world
    rids = [f"{backend}-kill-{i}" for i in range(2)]
    for rid, p in zip(rids, PROMPTS[:2], strict=True):
        router.submit(rid, list(p), LONG)
    wait_for(
        lambda: [fetch_health(a).running for a in ranks] == [1, 1],
        60,
        "one request decoding on each rank",
        cluster.procs,
    )
    (rank1,) = children(decode.pid)
    os.kill(rank1, signal.SIGKILL)
    errors = []
    for rid in rids:
        end = None
        for ev in router.events(rid, 60):
            if ev.finished:
                end = (ev.finish_reason, ev.error or "")
        assert end is not None and end[0] == "error", (rid, end)
        errors.append(end[1])
    dead = f"DP rank down: dp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
    assert sum(dead in e for e in errors) == 1, errors
    assert (
        sum(
            f"decode {ranks[1]} (DP rank 1 of 2 of the decode instance at {ranks[0]}) is unavailable" in e
            for e in errors
        )
        == 1
    ), errors
    h = fetch_health(ranks[0])
    assert not h.ok and h.down is not None and h.down.startswith(dead), h.down
    assert_clean([ranks[0], prefill[0].addr], procs=[decode, *prefill])
    wait_for(lambda: not router.peers.usable_pairs(), 30, "no DP rank routable", [decode, *prefill])


def test_dp_serve_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Bad DP combinations of `dsakv serve` exit 2 with an error naming the value (nothing starts)."""
    from dsakv.cli.main import main

    model = str(tiny_path(ARCH))
    cases = [
        (["--role", "prefill", *DP], "dsakv serve --role prefill --enable-dp-attention is not supported yet"),
        ([*DP, "--pp-size", "2"], "--pp-size 2 with --tp-size 2 is not supported yet"),
        (["--role", "decode", "--pp-size", "2", *DP], "--enable-dp-attention with --role decode --pp-size 2"),
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
