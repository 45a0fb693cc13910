"""Sampling values the API accepts give finite distributions and logprobs (issue 26, finding 2): exact greedy
fallbacks for a temperature below fp32's range, a top_p below its smallest value, a repetition_penalty that is 0
in fp32, an all-masked row; a NaN or all -inf row fails alone and the other rows are exactly their solo draws."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from dsakv.engine.request import Request, SamplingParams
from dsakv.engine.sampling import LOGPROB_FLOOR, filter_logits, process_logits, sample_batch, validate_sampling
from dsakv.errors import ConfigError

NEW = 6


def _poisons(logprobs: bool) -> dict[str, SamplingParams]:
    lp: dict[str, Any] = {"logprobs": 3} if logprobs else {}
    base: dict[str, Any] = {"max_new_tokens": NEW, "ignore_eos": True, "seed": 1, **lp}
    return {
        "temperature_1e-40": SamplingParams(**base, temperature=1e-40),  # fp32 underflow: 1e-40 is denormal
        "temperature_1e-300": SamplingParams(**base, temperature=1e-300),  # 0 in fp32
        "top_p_1e-300": SamplingParams(**base, temperature=1.0, top_p=1e-300),
        "repetition_penalty_1e-300": SamplingParams(**base, temperature=0.8, repetition_penalty=1e-300),
    }


GREEDY_EQUIVALENT = {"temperature_1e-40", "temperature_1e-300", "top_p_1e-300"}  # a point mass on the argmax


# ---- sampling units -----------------------------------------------------------------------------------------


def _req(params: SamplingParams, prompt: Sequence[int] = (2, 3, 5), seed: int = 0) -> Request:
    return Request("r", tuple(prompt), params, eos_token_ids=(1,), sampling_seed=seed)


def _finite(lps: Any) -> bool:
    return all(math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top) for lp in lps if lp is not None)


def test_poison_values_sample_exact_greedy_tokens_with_finite_logprobs() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 32, generator=g) * 3
    greedy = logits.argmax(-1).tolist()
    for name, p in _poisons(logprobs=True).items():
        got = sample_batch(logits, [_req(p, seed=b) for b in range(4)])
        assert got.errors == [None] * 4, name
        assert _finite(got.logprobs), (name, got.logprobs)
        if name in GREEDY_EQUIVALENT:
            assert got.tokens == greedy, name
            assert all(lp is not None and lp.logprob == pytest.approx(0.0, abs=1e-6) for lp in got.logprobs[:1]) or (
                name == "top_p_1e-300"  # top_p truncates after the logprobs: they are the full distribution's
            )
    # temperature 1e-40: every other token has probability 0 -> LOGPROB_FLOOR, never -inf (JSON has none)
    got = sample_batch(logits[:1], [_req(_poisons(True)["temperature_1e-40"])])
    lp = got.logprobs[0]
    assert lp is not None and lp.token_id == greedy[0] and lp.logprob == 0.0
    assert [v for _, v in lp.top[1:]] == [LOGPROB_FLOOR, LOGPROB_FLOOR]
    # repetition_penalty 1e-300 (0 in fp32): seen positive logits divided by the smallest normal float, not by 0
    row = torch.tensor([[0.5, 2.0, 1.5, -1.0, 3.0]])  # seen: 0, 2, 3 (prompt); the largest seen positive is 2
    p = SamplingParams(max_new_tokens=2, temperature=1.0, repetition_penalty=1e-300, logprobs=1)
    got = sample_batch(row, [_req(p, prompt=(0, 2, 3))])
    assert got.tokens == [2] and got.errors == [None] and got.logprobs[0] is not None
    assert got.logprobs[0].logprob == 0.0
    assert bool(torch.isfinite(process_logits(row, [_req(p, prompt=(0, 2, 3))])).any())
    # filter_logits: top_p below fp32's smallest value keeps exactly the top token
    x = torch.tensor([1.0, 3.0, 2.0, 0.0])
    ninf = float("-inf")
    assert filter_logits(x, SamplingParams(temperature=1.0, top_p=1e-300)).tolist() == [ninf, 3.0, ninf, ninf]
    assert torch.softmax(filter_logits(x, SamplingParams(temperature=1e-300)), -1).tolist() == [0.0, 1.0, 0.0, 0.0]
    assert torch.softmax(filter_logits(x * 1e5, SamplingParams(temperature=1e-40)), -1).tolist() == [0, 1.0, 0, 0]


def test_every_token_masked_falls_back_to_greedy_and_the_edge_refuses_it() -> None:
    p = SamplingParams(max_new_tokens=4, temperature=1.0, min_tokens=2, stop_token_ids=tuple(range(8)), logprobs=2)
    logits = torch.tensor([[0.0, 1.0, 4.0, 2.0, -1.0, 0.5, 3.0, 1.0]])
    got = sample_batch(logits, [_req(p)])
    assert got.tokens == [2] and got.errors == [None] and _finite(got.logprobs)  # the raw argmax
    with pytest.raises(ConfigError, match=r"cover all 8 tokens .* min_tokens = 2"):
        validate_sampling(p, 8, (1,))
    validate_sampling(p, 9, (1,))  # token 8 is left
    with pytest.raises(ConfigError, match=r"\+ eos"):  # eos closes the gap
        validate_sampling(SamplingParams(max_new_tokens=4, min_tokens=1, stop_token_ids=tuple(range(8))), 9, (8,))
    validate_sampling(SamplingParams(max_new_tokens=4, stop_token_ids=tuple(range(8))), 8, ())  # no min_tokens


def test_a_nan_row_fails_alone_and_the_others_are_exact() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 16, generator=g)
    reqs = [_req(SamplingParams(max_new_tokens=2, temperature=0.7, logprobs=2), seed=b) for b in range(4)]
    alone = [sample_batch(logits[b : b + 1], [reqs[b]]) for b in range(4)]
    bad = logits.clone()
    bad[1, 5] = float("nan")
    bad[2] = float("-inf")
    bad[3, 7] = float("inf")
    got = sample_batch(bad, reqs)
    assert got.tokens[0] == alone[0].tokens[0] and got.logprobs[0] == alone[0].logprobs[0]
    assert got.errors[0] is None and got.errors[3] is None
    assert got.errors[1] is not None and "NaN at 1 of 16" in got.errors[1] and got.tokens[1] == 0
    assert got.errors[2] is not None and "-inf at every token" in got.errors[2]
    assert got.tokens[3] == 7 and got.logprobs[3] is not None and got.logprobs[3].logprob == 0.0  # +inf: certain
    assert got.logprobs[1] is None and got.logprobs[2] is None
