"""A decode worker with TP 2 (`dsakv serve --role decode --tp-size 2`) fed by a TP-1 prefill, over each real
transfer backend: rank 1 is a process of its own with its own pool registered with its own transfer engine; the
handshake carries its endpoint (HelloReply.ranks) and the prefill writes both pools per the sender rule.

Checked: tokens equal the single-rank engine (greedy and seeded, concurrent); the bytes landed per (prefill
stage, decode rank) pair equal the layout figure x pages, exactly, and equal the sender rule's own figure (one
prefill rank, two receivers: cap ceil(2/1) = 2, every key to both); nothing is held afterwards on either side.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Sequence

import pytest
import torch

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.transfer.rank_assign import RankId, assign
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.testing.listen import child_pids
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(420)]

ARCH = "glm_moe_dsa"
LENGTHS = (7, 23, 41)
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=600, ignore_eos=True)  # decodes for seconds: the kill lands mid-decode
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)


def _prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts(LENGTHS, 31)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "sampled": eng.generate(PROMPTS[:2], SAMPLED)}


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, tmp_path_factory):
    backend = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"decode-tp-{backend}"))
    try:
        spec = ModelSpec.from_path(tiny_path(ARCH))
        decode = cluster.decode("dtp2", backend, True, extra=["--tp-size", "2", "--worker-name", "dtp2"])
        other = cluster.decode("d1", backend, True, extra=["--worker-name", "d1"])  # the kill test's survivor
        prefill = cluster.prefill("p1", backend, True, (spec.num_layers,))
        cluster.wait_healthy([*prefill, decode, other], timeout=240)
        router = cluster.router([prefill[0].addr], [decode.addr])
        assert router.wait_ready(90), router.health()
        yield backend, cluster, decode, prefill, router, other
    finally:
        cluster.close()


def test_decode_tp2_from_tp1_prefill_tokens_and_bytes_per_rank_pair(world, reference):
    backend, cluster, decode, prefill, router, _ = world
    spec = ModelSpec.from_path(tiny_path(ARCH))
    h = fetch_health(decode.addr)
    assert h.ok and h.down is None and h.pages_total == NUM_PAGES, h

    got = run_requests(router, PROMPTS, GREEDY, f"{backend}-tp-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert {(r, e) for _, r, e in got} == {("length", None)}
    got = run_requests(router, PROMPTS[:2], SAMPLED, f"{backend}-tp-s")
    assert [t for t, _, _ in got] == reference["sampled"], got

    # the layout figure: every key of the (elided) layout, on each decode rank's pool, pages x page bytes
    lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    pages = sum(ceil_div(n, PAGE_SIZE) for n in (*LENGTHS, *LENGTHS[:2]))
    figure = pages * lay.bytes_per_page
    # the sender rule's own figure for one request's page: one holder (prefill tp 0), two needers (decode tp 0, 1)
    keys = list(lay.by_key)
    weight = {k: b.page_bytes for k, b in lay.by_key.items()}
    a = assign({RankId(0, 0, 0): keys}, {RankId(0, 0, 0): keys, RankId(0, 0, 1): keys}, weight)
    rule = a.pair_bytes({k: b.page_bytes * pages for k, b in lay.by_key.items()})
    assert rule == {(RankId(0, 0, 0), RankId(0, 0, r)): figure for r in (0, 1)}
    assert a.transfers(RankId(0, 0, 0)) == 2 * len(keys)  # each receiver gets each key once
    h = fetch_health(decode.addr)
    assert h.kv_bytes_pairs == {"p1:0->tp0": figure, "p1:0->tp1": figure}, h.kv_bytes_pairs
    assert h.counters["kv_bytes"] == 2 * figure and h.counters["started"] == len(LENGTHS) + 2
    assert_clean([decode.addr, prefill[0].addr], procs=cluster.procs)


def children(pid: int) -> list[int]:
    return child_pids(pid)


def test_decode_rank_killed_fails_its_requests_frees_pages_others_serve(world, reference):
    """kill -9 of the TP-2 decode's rank 1 while two requests decode: both fail naming the rank and the signal,
    rank 0 frees every page and says down; the prefill holds nothing; a second decode keeps serving (a router
    over both places every new request there, tokens == one rank)."""
    backend, cluster, decode, prefill, router, other = world
    rids = [f"{backend}-kill-{i}" for i in range(2)]
    for rid, p in zip(rids, PROMPTS[:2], strict=True):
        router.submit(rid, list(p), LONG)
    wait_for(lambda: (fetch_health(decode.addr).running or 0) == 2, 60, "both requests decoding", cluster.procs)
    (rank1,) = children(decode.pid)
    os.kill(rank1, signal.SIGKILL)  # rank 0's one child: the TP rank 1 process
    for rid, want in zip(rids, reference["greedy"][:2], strict=True):
        toks: list[int] = []
        end = None
        for ev in router.events(rid, 60):
            toks += ev.new_token_ids
            if ev.finished:
                end = (ev.finish_reason, ev.error or "")
        assert end is not None and end[0] == "error", (rid, end, len(toks))
        assert f"TP rank down: tp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)" in end[1], end
        assert toks[:5] == want[: len(toks[:5])], (toks[:5], want)  # what streamed before the kill was right
    h = fetch_health(decode.addr)
    assert not h.ok and "tp rank 1" in (h.down or ""), h
    assert_clean([decode.addr, prefill[0].addr], procs=cluster.procs)

    both = cluster.router([prefill[0].addr], [decode.addr, other.addr])
    assert both.wait_ready(90), both.health()
    got = run_requests(both, PROMPTS, GREEDY, f"{backend}-survivor")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert fetch_health(other.addr).counters["started"] == len(PROMPTS)
    assert fetch_health(decode.addr).counters["prealloc"] == len(LENGTHS) + 2 + 2  # none placed there after
    assert_clean([other.addr, prefill[0].addr], procs=[other, *prefill])
