"""Decode pipeline stages (`dsakv serve --role decode --pp-size N --pp-partition ...`) fed by a prefill pipeline
(PP 4, 5,3,2,2) over each real transfer backend: one prefill, two pipelined decodes (PP 2: 6,6 and PP 3: 7,3,2,
whose stage 1, layers 7-9, holds no producer), one router per decode. The tiny model's producers are 0, 1, 2, 6
and 10, so prefill stage 2 (layers 8-9) holds none either.

Checked: tokens equal a colocated engine; every decode stage holds only its layers' keys; the bytes landed per
(prefill stage, decode stage) pair equal the layout figure for their common keys, exactly; a failing pair
(--debug-fail-transfer on prefill stage 2) fails only its request and every stage frees its pages; every stage
reports its own pool and pages in its health.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import pytest
import torch

from dsakv.config import split_layers
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import (
    NUM_PAGES,
    PAGE_SIZE,
    Cluster,
    Proc,
    assert_clean,
    free_ports,
    run_requests,
    wait_for,
)
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(420)]

PREFILL = (5, 3, 2, 2)
DECODES = {"d2": (6, 6), "d3": (7, 3, 2)}
LENGTHS = (7, 23, 41)
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=60, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)


def _prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts(LENGTHS, 14)
EXTRA = _prompts((19, 30), 15)  # the failing-pair round: one of these fails, the other is served


def decode_pp(cluster: Cluster, name: str, backend: str, partition: Sequence[int]) -> list[Proc]:
    """Every stage of a pipelined decode worker, stage k at port + k (as `--pp-size N` without --pp-rank starts)."""
    return cluster.decode_pp(name, backend, partition)


def layout(spec: ModelSpec, span: tuple[int, int]) -> KVLayout:
    return KVLayout(spec, span[0], span[1], kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)


def common_keys(spec: ModelSpec, src: tuple[int, int], dst: tuple[int, int]) -> set[str]:
    return {str(k) for k in layout(spec, src).by_key.keys() & layout(spec, dst).by_key.keys()}


def common_bytes_per_page(spec: ModelSpec, src: tuple[int, int], dst: tuple[int, int]) -> int:
    """The layout figure: bytes per page of the keys a prefill stage (layers src) and a decode stage (dst) share."""
    a, b = layout(spec, src).by_key, layout(spec, dst).by_key
    return sum(a[k].page_bytes for k in a.keys() & b.keys())


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(
        tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    )
    return {
        "greedy": eng.generate(PROMPTS, GREEDY),
        "sampled": eng.generate(PROMPTS[:2], SAMPLED),
        "extra": eng.generate(EXTRA, GREEDY),
        "long": eng.generate(PROMPTS[:2], LONG),
    }


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, tmp_path_factory):
    backend = request.param
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp(f"decode-pp-{backend}"))
    try:
        decodes = {name: decode_pp(cluster, name, backend, part) for name, part in DECODES.items()}
        # prefill stage 2 (layers 8-9, no producer) fails its 11th transfer to a decode stage 1: the first of the
        # failing round (2 x 5 requests before it, each sent to one decode's stage 1 by that stage)
        port = free_ports(len(PREFILL) + 1)
        prefill = cluster.prefill("p4", backend, True, PREFILL, port=port, ranks=(0, 1, 3))
        prefill[2:2] = cluster.prefill(
            "p4", backend, True, PREFILL, port=port, ranks=(2,), extra=["--debug-fail-transfer", "1:11"]
        )
        everything = [*prefill, *(p for procs in decodes.values() for p in procs)]
        cluster.wait_healthy(everything, timeout=240)
        routers = {name: cluster.router([prefill[0].addr], [procs[0].addr]) for name, procs in decodes.items()}
        for r in routers.values():
            assert r.wait_ready(90), r.health()
        yield backend, cluster, decodes, prefill, routers
    finally:
        cluster.close()


def test_decode_pipeline_tokens_bytes_and_failing_pair(world, reference):
    backend, cluster, decodes, prefill, routers = world
    spec = ModelSpec.from_path(tiny_path("glm_moe_dsa"))
    pre_ranges = split_layers(spec.num_layers, len(PREFILL), PREFILL)
    fronts = {name: procs[0].addr for name, procs in decodes.items()}

    # every decode stage holds only its layers (KV, index-K for producers only) and its own pool
    for name, procs in decodes.items():
        ranges = split_layers(spec.num_layers, len(DECODES[name]), DECODES[name])
        for k, p in enumerate(procs):
            h = fetch_health(p.addr)
            a, b = ranges[k]
            assert (h.role, h.stage, h.num_stages, h.layers) == ("decode", k, len(procs), [a, b - 1])
            assert h.pages_total == NUM_PAGES and h.ok, h
            assert h.bytes_per_token == layout(spec, (a, b)).bytes_per_token
        front = fetch_health(procs[0].addr)
        assert [s.layers for s in front.pipeline or []] == [[a, b - 1] for a, b in ranges]
    assert fetch_health(decodes["d3"][1].addr).layers == [7, 9]  # the stage without producers

    pages: dict[str, int] = {}
    for name, router in routers.items():
        got = run_requests(router, PROMPTS, GREEDY, f"{backend}-{name}")
        assert [t for t, _, _ in got] == reference["greedy"], (name, got)
        assert {(r, e) for _, r, e in got} == {("length", None)}
        got = run_requests(router, PROMPTS[:2], SAMPLED, f"{backend}-{name}-s")
        assert [t for t, _, _ in got] == reference["sampled"], (name, got)
        pages[name] = sum(ceil_div(n, PAGE_SIZE) for n in (*LENGTHS, *LENGTHS[:2]))

    # bytes per (prefill stage, decode stage) pair == pages x the layout figure for their common keys
    for name, part in DECODES.items():
        dec_ranges = split_layers(spec.num_layers, len(part), part)
        want = {}
        for i, src in enumerate(pre_ranges):
            for j, dst in enumerate(dec_ranges):
                if max(src[0], dst[0]) < min(src[1], dst[1]):
                    want[f"p4:{i}->{j}"] = pages[name] * common_bytes_per_page(spec, src, dst)
        h = fetch_health(fronts[name])
        assert h.kv_bytes_pairs == want, (name, h.kv_bytes_pairs, want)
        assert h.counters["kv_bytes"] == sum(want.values())
    # prefill stage 2 (8-9) and d3's stage 1 (7-9): no producer on either side, so KV only; d3's stage 2 (10-11)
    # gets prefill stage 3's producer 10 index-K too
    assert common_keys(spec, pre_ranges[2], (7, 10)) == {"L8/kv", "L9/kv"}
    assert common_keys(spec, pre_ranges[3], (10, 12)) == {"L10/kv", "L10/index_k", "L11/kv"}

    # the failing pair: prefill stage 2's next transfer to a decode stage 1 fails: only that request fails
    for name, router in routers.items():
        got = run_requests(router, EXTRA, GREEDY, f"{backend}-{name}-fail")
        failed = [g for g in got if g[1] == "error"]
        served = [(i, g) for i, g in enumerate(got) if g[1] != "error"]
        if name == "d2":
            assert len(failed) == 1 and "injected failure" in (failed[0][2] or ""), got
            assert len(served) == 1 and served[0][1][0] == reference["extra"][served[0][0]], got
        else:
            assert [g[0] for g in got] == reference["extra"], got

    for procs in decodes.values():  # every later stage ran every decode step and mirrored stage 0's pages
        for p in procs[1:]:
            c = fetch_health(p.addr).counters
            assert c["steps"] >= GREEDY.max_new_tokens - 1 and c["pages_peak"] >= ceil_div(41 + 1, PAGE_SIZE), c
            assert c["breaks"] == 0, c
    # nothing held on any stage of either decode, nor on any prefill stage; every stage's books balance
    assert_clean([p.addr for procs in decodes.values() for p in procs], procs=cluster.procs)
    assert_clean([p.addr for p in prefill], procs=cluster.procs)

    # the router's per-stage views: each stage's pool and pages in its /health table and labelled /metrics gauges
    for name, router in routers.items():
        addr, ranges = fronts[name], split_layers(spec.num_layers, len(DECODES[name]), DECODES[name])

        def gauges(what: str, router=router, addr=addr, n=len(ranges)) -> list[float | None]:
            m = router.metrics()
            return [m.get(f'decode_stage_{what}{{addr="{addr}",stage="{k}"}}') for k in range(n)]

        wait_for(lambda g=gauges, n=len(ranges): g("pages_used") == [0.0] * n, 10, f"{name}: stage gauges at 0")
        assert gauges("pages_total") == [float(NUM_PAGES)] * len(ranges)
        assert gauges("bytes_per_token") == [float(layout(spec, r).bytes_per_token) for r in ranges]
        assert gauges("up") == gauges("integrity_ok") == [1.0] * len(ranges)
        row = next(r for r in router.health()["decode"] if r["addr"] == addr)
        assert [(s["stage"], s["layers"], s["pages_used"]) for s in row["stages"]] == [
            (k, [a, b - 1], 0) for k, (a, b) in enumerate(ranges)
        ]


def test_decode_stage_killed_mid_decode_fails_its_requests_then_rejoins(world, reference):
    """Kill d2's stage 1 while two requests decode: both fail with the pipeline's error, every page comes back on
    stage 0 and on the prefill; the stage restarts, the pipeline re-forms (a new boot: the router and the prefill
    stages handshake again, with the restarted stage's new manifest) and serves tokens equal to colocated again."""
    backend, cluster, decodes, prefill, routers = world
    router, front, stage1 = routers["d2"], decodes["d2"][0], decodes["d2"][1]
    boot = fetch_health(front.addr).boot
    rids = [f"{backend}-kill-{i}" for i in range(2)]
    for rid, p in zip(rids, PROMPTS[:2], strict=True):
        router.submit(rid, list(p), LONG)
    # both decoding before the kill (ci26: with one running, the other was still in transfer and failed there, with
    # the transfer's error, not the pipeline's)
    wait_for(lambda: (fetch_health(front.addr).running or 0) >= 2, 30, "d2 decoding both", cluster.procs)
    stage1.signal(signal.SIGKILL)
    stage1.kill()
    outcomes = []
    for rid, want in zip(rids, reference["long"], strict=True):
        toks: list[int] = []
        end = None
        for ev in router.events(rid, 60):
            toks += ev.new_token_ids
            if ev.finished:
                end = (ev.finish_reason, ev.error)
        assert end is not None
        outcomes.append(end[0])
        if end[0] == "error":
            assert "StageLinkError" in (end[1] or "") or "pipeline broke" in (end[1] or ""), end
            assert toks == want[: len(toks)], (toks, want)  # what was streamed before the kill was right
        else:
            assert toks == want
    assert "error" in outcomes, outcomes
    assert_clean([front.addr, *(p.addr for p in prefill)], procs=cluster.procs)

    stage1.start()
    wait_for(lambda: fetch_health(front.addr).ok, 120, "d2 re-formed", cluster.procs)
    assert fetch_health(front.addr).boot != boot  # a re-formed pipeline is a new decode to its peers
    wait_for(lambda: router.peers.usable_pairs(), 60, "d2 paired again", cluster.procs)
    got = run_requests(router, EXTRA, GREEDY, f"{backend}-rejoined")
    assert [t for t, _, _ in got] == reference["extra"], got
    assert_clean([p.addr for procs in decodes.values() for p in procs], procs=cluster.procs)
    assert_clean([p.addr for p in prefill], procs=cluster.procs)
