"""The engine's hooks for disaggregated serving, in one process: a prefill engine keeps a finished request's
pages (keep_pages), its KV is copied page by page and key by key into pages a decode engine reserved
(prealloc), and the decode engine continues (start_decode). Prefill elides index-K, decode does not:
the shared layers' INDEX_K exists on one side only and is skipped; tokens equal transformers'."""

from __future__ import annotations

import numpy as np
import pytest

from dsakv.engine.engine import Engine, NoFreePages
from dsakv.engine.request import FinishReason, SamplingParams
from dsakv.errors import CapacityError, ConfigError
from dsakv.spec.layout import Kind
from dsakv.testing.engines import engine, greedy_params, hf_greedy, prompts_for
from dsakv.util import ceil_div


def copy_pages(src: Engine, src_pages: np.ndarray, dst: Engine, dst_pages: np.ndarray) -> list[str]:
    """Copy every buffer both pools hold; return the keys skipped (INDEX_K of shared layers only)."""
    skipped = []
    for key in dst.pool.keys:
        if not src.pool.has(key):
            assert key.kind is Kind.INDEX_K and key.layer in src.spec.shared_layers
            skipped.append(str(key))
            continue
        n = len(src_pages)
        dst.pool.tensor(key)[dst_pages[:n]] = src.pool.tensor(key)[src_pages]
    return skipped


def test_prefill_keep_pages_then_decode_elsewhere() -> None:
    prompts = prompts_for([23, 9], seed=21)
    prefill = engine("glm_moe_dsa", elide=True, page_size=4, max_tokens=128)
    decode = engine("glm_moe_dsa", elide=False, page_size=4, max_tokens=256)
    # fill a few of the decode pool's pages first, so page ids differ on the two sides
    decode.add_request(prompts_for([10], seed=1)[0], greedy_params(4))
    decode.step()
    for i, p in enumerate(prompts):
        rid = f"r{i}"
        prefill.add_request(p, greedy_params(1), request_id=rid, keep_pages=True)
        while prefill.has_unfinished():
            outs = prefill.step()
        (first,) = outs[-1].output_ids
        src = prefill.pages_of(rid)
        assert len(src) == ceil_div(len(p), 4)
        prefill.check_integrity()
        dst = decode.prealloc(rid, p, greedy_params(24))
        assert len(dst) == ceil_div(len(p) + 1, 4)
        decode.check_integrity()
        skipped = copy_pages(prefill, src, decode, dst)
        assert skipped == [
            "L3/index_k",
            "L4/index_k",
            "L5/index_k",
            "L7/index_k",
            "L8/index_k",
            "L9/index_k",
            "L11/index_k",
        ]
        assert prefill.release(rid) and not prefill.release(rid)
        prefill.check_integrity()
        out = decode.start_decode(rid, first)
        assert out.new_token_ids == (first,) and not out.finished
    final = {}
    while decode.has_unfinished():
        for o in decode.step():
            if o.finished:
                final[o.request_id] = o
        decode.check_integrity()
    for i, p in enumerate(prompts):
        assert list(final[f"r{i}"].output_ids) == hf_greedy("glm_moe_dsa", tuple(p), 24)
    assert decode.stats().pages_used == 0 and prefill.stats().pages_used == 0


def test_prealloc_failures_and_abort() -> None:
    decode = engine("glm_moe_dsa", page_size=4, num_pages=4)
    pages = decode.prealloc("x", [5] * 10, greedy_params(4))
    assert pages.tolist() == [0, 1, 2]
    with pytest.raises(NoFreePages, match="request y: its 6 prompt tokens need 2 pages but only 1 of 4 are free"):
        decode.prealloc("y", [5] * 6, greedy_params(2))
    with pytest.raises(CapacityError, match="can never fit"):
        decode.prealloc("z", [5] * 15, greedy_params(4))
    assert decode.step() == []  # x waits for its KV: nothing to run, no stall error
    out = decode.abort("x")  # e.g. the transfer missed its deadline
    assert out.finish_reason is FinishReason.ABORT and decode.stats().pages_free == 4
    assert [o.request_id for o in decode.step()] == ["x"]
    decode.check_integrity()
    with pytest.raises(ConfigError, match="'x' is not waiting for its KV"):
        decode.start_decode("x", 3)


def test_sampled_decode_after_prefill_matches_colocated() -> None:
    """A seeded sampled request continues on the decode engine exactly as it would have colocated."""
    (p,) = prompts_for([19], seed=8)
    sp = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, seed=77, ignore_eos=True)
    colocated = engine("glm_moe_dsa", page_size=4, max_tokens=128).generate([p], sp)[0]
    assert len(colocated) == 12
    prefill = engine("glm_moe_dsa", page_size=4, max_tokens=128)
    prefill.add_request(p, SamplingParams(max_new_tokens=1, temperature=0.9, top_k=40, seed=77), "s", keep_pages=True)
    while prefill.has_unfinished():
        outs = prefill.step()
    first = outs[-1].output_ids[0]
    decode = engine("glm_moe_dsa", page_size=4, max_tokens=128)
    dst = decode.prealloc("s", p, sp)
    copy_pages(prefill, prefill.pages_of("s"), decode, dst)
    prefill.release("s")
    decode.start_decode("s", first)
    out = None
    while decode.has_unfinished():
        for o in decode.step():
            out = o
    assert out is not None and list(out.output_ids) == colocated  # token i is drawn from (seed, i) on any worker
