"""Index-K elision on vs off through the engine: identical tokens, in exact and fp8 storage formats.

With elision the pool has no INDEX_K buffer for shared layers (3, 4, 5, 7, 8, 9, 11 of the tiny GLM
checkpoint) and is smaller by exactly their bytes; the tokens do not change.
"""

from __future__ import annotations

import pytest

from dsakv.spec.layout import BufferKey, Kind
from dsakv.testing.engines import drive, engine, greedy_params, prompts_for

SHARED = (3, 4, 5, 7, 8, 9, 11)
PRODUCERS = (0, 1, 2, 6, 10)


def run(elide: bool, kv_format: str, index_format: str, prompts: list[list[int]]) -> tuple[list[list[int]], object]:
    eng = engine(
        "glm_moe_dsa",
        elide=elide,
        kv_format=kv_format,
        index_format=index_format,
        page_size=8,
        max_tokens=512,
        max_batch_tokens=24,
    )
    ids = [eng.add_request(p, greedy_params(n)) for p, n in zip(prompts, (24, 32, 16), strict=True)]
    final = drive(eng)
    return [list(final[r].output_ids) for r in ids], eng


@pytest.mark.parametrize("kv_format,index_format", [("fp32", "fp32"), ("fp8-656", "fp8-132"), ("fp8-576", "fp4-68")])
def test_elision_on_off_identical_tokens(kv_format: str, index_format: str) -> None:
    prompts = prompts_for([40, 9, 21], seed=3)
    on, eng_on = run(True, kv_format, index_format, prompts)
    off, eng_off = run(False, kv_format, index_format, prompts)
    assert on == off
    assert [len(t) for t in on] == [24, 32, 16]
    pool_on, pool_off = eng_on.pool, eng_off.pool
    assert [k.layer for k in pool_on.keys if k.kind is Kind.INDEX_K] == list(PRODUCERS)
    assert [k.layer for k in pool_off.keys if k.kind is Kind.INDEX_K] == list(range(12))
    for layer in SHARED:
        assert not pool_on.has(BufferKey(layer, Kind.INDEX_K))
    idx_page = eng_on.layout.index_bytes * 8
    assert pool_off.nbytes - pool_on.nbytes == len(SHARED) * idx_page * pool_on.num_pages
    # the off pool's shared-layer index-K pages were never written
    for layer in SHARED:
        assert int(pool_off.tensor(BufferKey(layer, Kind.INDEX_K)).count_nonzero()) == 0
