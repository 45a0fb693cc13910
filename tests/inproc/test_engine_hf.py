"""The engine's greedy tokens equal transformers' generate(do_sample=False), both architectures, exact fp32.

Unbatched (one request at a time) and batched (continuous batching: requests of different prompt and
output lengths arriving while others run, chunked prefill, a pool small enough to preempt).
Prompts of 17, 23 and 40 tokens are longer than index_topk (16), so the sparse top-k really prunes.
check_integrity() runs after every scheduler step.
"""

from __future__ import annotations

import pytest

from dsakv.testing.engines import ARCHS, INDEX_TOPK, drive, engine, greedy_params, hf_greedy, prompts_for

pytest.importorskip("transformers")

STEPS = 32
LENGTHS = [5, 40, 17, 23]


@pytest.fixture(scope="module", params=ARCHS)
def ref(request):
    arch = request.param
    prompts = prompts_for(LENGTHS)
    assert max(LENGTHS) > INDEX_TOPK
    return arch, prompts, [hf_greedy(arch, tuple(p), STEPS) for p in prompts]


def test_unbatched_matches_transformers(ref) -> None:
    arch, prompts, refs = ref
    eng = engine(arch, page_size=8, max_tokens=256)
    for p, want in zip(prompts[:3], refs[:3], strict=True):
        (got,) = eng.generate([p], greedy_params(STEPS))
        assert got == want
        eng.check_integrity()
    assert eng.stats().pages_used == 0
    # the references are not degenerate
    assert len({t for r in refs for t in r}) > 40 and all(len(r) == STEPS for r in refs)


def test_continuous_batching_matches_transformers(ref) -> None:
    arch, prompts, refs = ref
    # 16-token steps: the 40- and 23-token prompts are prefilled in chunks next to other requests' decodes
    eng = engine(arch, page_size=4, max_tokens=512, max_batch_tokens=16)
    max_new = [STEPS, 20, STEPS, 11]
    ids = [eng.add_request(prompts[0], greedy_params(max_new[0])), eng.add_request(prompts[1], greedy_params(20))]
    seen_mixed = []

    def arrive(i, outs):
        st = eng.stats()
        seen_mixed.append((st.num_running, st.prefill_tokens, st.decode_tokens))
        if i == 2:
            ids.append(eng.add_request(prompts[2], greedy_params(max_new[2])))
        if i == 9:
            ids.append(eng.add_request(prompts[3], greedy_params(max_new[3])))

    final = drive(eng, arrive)
    for rid, want, n in zip(ids, refs, max_new, strict=True):
        assert list(final[rid].output_ids) == want[:n]
        assert final[rid].finish_reason == "length"
    assert max(r for r, _, _ in seen_mixed) >= 3
    st = eng.stats()
    assert st.prefill_tokens + st.decode_tokens == sum(LENGTHS) + sum(max_new) - len(LENGTHS)
    assert st.generated_tokens == sum(max_new)


def test_preemption_keeps_transformers_tokens(ref) -> None:
    arch, prompts, refs = ref
    # 24 pages x 4 tokens = 96 tokens for 4 requests needing up to 72 each: decodes run out and preempt
    eng = engine(arch, page_size=4, num_pages=24, max_batch_tokens=64)
    out = eng.generate(prompts, greedy_params(STEPS))
    assert out == refs
    assert eng.stats().num_preemptions > 0
    eng.check_integrity()
