"""2P2D: one router over two prefill and two decode `dsakv serve` processes (mooncake). Four distinct prompts
submitted at once spread over both decodes and both prefills (by load; asserted from the workers' own health
counters); a fifth prompt that shares two pages with one of them goes to the prefill that served it (prefix
affinity: that prefill's cache hits exactly those 32 tokens). Tokens equal a colocated engine; at the end no
decode holds a page, no prefill request holds one (only the prefix cache does) and every instance's books
balance."""

from __future__ import annotations

import pytest
import torch

from disagg_support import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests, wait_for
from dsakv.disagg.messages import fetch_health
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from engine_support import tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


def _held_by_requests(addr: str) -> tuple[int, int, str]:
    h = fetch_health(addr, timeout=3.0)
    return h.pages_used - (h.cache_pages or 0), h.jobs or 0, h.integrity


def test_two_prefill_two_decode_behind_one_router(tmp_path):
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (7, 16, 41, 23)]
    follow = prompts[2][:32] + torch.randint(2, 512, (9,), generator=g).tolist()  # 2 pages shared with prompt 2
    eng = Engine(tiny_model("glm_moe_dsa"), page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    want = eng.generate([*prompts, follow], GREEDY)

    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path)
    try:
        decodes = [cluster.decode(f"d{i}", "mooncake", True) for i in range(2)]
        prefills = [cluster.prefill(f"p{i}", "mooncake", True, (12,), extra=["--prefix-cache"])[0] for i in range(2)]
        cluster.wait_healthy([*decodes, *prefills], timeout=180)
        router = cluster.router([p.addr for p in prefills], [d.addr for d in decodes])
        assert router.wait_ready(60), router.health()
        assert len(router.peers.usable_pairs()) == 4, router.health()

        got = run_requests(router, prompts, GREEDY, "xpyd")
        assert [t for t, _, _ in got] == want[:4], got
        assert [(r, e) for _, r, e in got] == [("length", None)] * 4
        dec_h = [fetch_health(d.addr) for d in decodes]
        pre_h = [fetch_health(p.addr) for p in prefills]
        # by load: 2 + 2 when all four are dispatched before the first finishes (the usual case); a request
        # that finished early frees its slot, so only "each one used, 4 in all" is certain
        n_dec, n_pre = [h.counters["prealloc"] for h in dec_h], [h.counters["submitted"] for h in pre_h]
        assert min(n_dec) >= 1 and sum(n_dec) == 4, [h.counters for h in dec_h]
        assert min(n_pre) >= 1 and sum(n_pre) == 4, [h.counters for h in pre_h]
        assert router.counters["routed_load_total"] == 4 and router.counters["routed_affinity_total"] == 0

        hits0 = [h.prefix_cache["hit_tokens"] for h in pre_h if h.prefix_cache is not None]
        assert len(hits0) == 2
        got = run_requests(router, [follow], GREEDY, "xpyd-follow")
        assert got == [(want[4], "length", None)]
        assert (router.counters["routed_affinity_total"], router.counters["routed_matched_pages_total"]) == (1, 2)
        pre_h = [fetch_health(p.addr) for p in prefills]
        raw = [h.prefix_cache["hit_tokens"] - b for h, b in zip(pre_h, hits0, strict=True)]  # type: ignore[index]
        assert sorted(raw) == [0, 32], raw

        table = router.health()
        rows = {r["addr"]: r for r in table["prefill"] + table["decode"]}
        assert [rows[p.addr]["picked"] for p in prefills] == [n + (d == 32) for n, d in zip(n_pre, raw, strict=True)]
        assert sorted(rows[p.addr]["picked_affinity"] for p in prefills) == [0, 1]
        assert sum(rows[d.addr]["picked"] for d in decodes) == 5
        # whole pages the router sent: 0 + 1 + 2 + 1 distinct, and the follow-up's 2 are prompt 2's
        assert sum(rows[p.addr]["cached_prefix_pages"] for p in prefills) == 4
        assert table["routing"]["affinity_min_gain_pages"] == 1

        assert_clean([d.addr for d in decodes], procs=cluster.procs)
        for p in prefills:  # the prefix cache keeps its pages; no request holds one
            wait_for(lambda p=p: _held_by_requests(p.addr) == (0, 0, "ok"), 20, f"{p.name} settled", cluster.procs)
    finally:
        cluster.close()
