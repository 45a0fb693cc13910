"""Sampling: exact filters, seeded draws reproducible and independent of the batch; SamplingParams checks."""

from __future__ import annotations

import pytest
import torch

from dsakv.engine.request import Request, SamplingParams
from dsakv.engine.sampling import filter_logits, sample
from dsakv.errors import ConfigError
from dsakv.testing.engines import drive, engine, greedy_params, hf_greedy, prompts_for

NEG = float("-inf")


def test_filters_are_exact() -> None:
    x = torch.tensor([1.0, 3.0, 2.0, 0.0])
    assert filter_logits(x, SamplingParams(temperature=0.5, top_k=2)).tolist() == [NEG, 6.0, 4.0, NEG]
    # probs of [3, 2, 1, 0] ~ [.64, .24, .09, .03]: top_p .7 keeps the first two, .6 keeps only the first
    assert filter_logits(x, SamplingParams(temperature=1.0, top_p=0.7)).tolist() == [NEG, 3.0, 2.0, NEG]
    assert filter_logits(x, SamplingParams(temperature=1.0, top_p=0.6)).tolist() == [NEG, 3.0, NEG, NEG]
    assert filter_logits(x, SamplingParams(temperature=1.0, top_k=9)).tolist() == [1.0, 3.0, 2.0, 0.0]


def test_sample_greedy_ties_and_seeded_rows() -> None:
    logits = torch.tensor([[0.0, 5.0, 5.0], [1.0, 1.0, 1.0]])
    greedy = Request("g", (2,), SamplingParams())
    a = Request("a", (2,), SamplingParams(temperature=1.0, seed=7), sampling_seed=7)
    assert sample(logits, [greedy, greedy]) == [1, 0]  # first index on ties, as torch.argmax / transformers
    b = Request("b", (2,), SamplingParams(temperature=1.0, seed=7), sampling_seed=7)
    for _ in range(20):
        a.output_ids.append(sample(logits[1:], [a])[0])
        b.output_ids.append(sample(logits[[0, 1]], [greedy, b])[1])
    assert a.output_ids == b.output_ids  # same seed, same draws, whatever shares the batch
    assert len(set(a.output_ids)) == 3
    assert sample(logits[1:], [a]) == sample(logits[1:], [a])  # token i's draw depends on (seed, i) only
    with pytest.raises(ValueError, match=r"logits of shape \(2, 3\) for 1 requests"):
        sample(logits, [a])


def test_seeded_generation_is_reproducible_and_batch_independent() -> None:
    p0, p1, p2 = prompts_for([12, 30, 7], seed=11)
    sp = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=1234, ignore_eos=True)
    alone = engine("glm_moe_dsa", page_size=4, max_tokens=256).generate([p0], sp)[0]
    again = engine("glm_moe_dsa", page_size=8, max_tokens=256).generate([p0], sp)[0]
    assert alone == again and len(alone) == 24
    # in a batch with other sampled and greedy requests, added later, with chunked prefill
    eng = engine("glm_moe_dsa", page_size=4, max_tokens=512, max_batch_tokens=10)
    other = SamplingParams(max_new_tokens=20, temperature=1.3, seed=99, ignore_eos=True)
    ids = [eng.add_request(p1, other), eng.add_request(p2, greedy_params(16))]

    def later(i, outs):
        if i == 3:
            ids.append(eng.add_request(p0, sp))

    final = drive(eng, later)
    assert list(final[ids[2]].output_ids) == alone
    assert list(final[ids[1]].output_ids) == hf_greedy("glm_moe_dsa", tuple(p2), 16)
    other_seed = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.95, top_k=50, seed=4321, ignore_eos=True)
    assert engine("glm_moe_dsa", page_size=4, max_tokens=256).generate([p0], other_seed)[0] != alone
    # top_k=1 sampling is greedy
    k1 = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=1, seed=5, ignore_eos=True)
    assert engine("glm_moe_dsa", page_size=4, max_tokens=256).generate([p1], k1)[0] == hf_greedy(
        "glm_moe_dsa", tuple(p1), 12
    )


def test_preempted_sampled_request_keeps_its_draws() -> None:
    prompts = prompts_for([20, 20, 20], seed=2)
    sps = [SamplingParams(max_new_tokens=20, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    roomy = engine("glm_moe_dsa", page_size=4, max_tokens=512).generate(prompts, sps)
    tight_eng = engine("glm_moe_dsa", page_size=4, num_pages=20)  # 80 tokens for 3 x 40
    tight = tight_eng.generate(prompts, sps)
    assert tight_eng.stats().num_preemptions > 0
    assert tight == roomy


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"max_new_tokens": 0}, "max_new_tokens = 0 must be an integer >= 1"),
        ({"temperature": -1}, r"temperature = -1 must be a finite number >= 0 \(0 = greedy\)"),
        ({"temperature": "hot"}, "temperature = 'hot' must be a number"),
        ({"top_p": 0.0}, r"top_p = 0.0 must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p = 1.5 must be in \(0, 1\]"),
        ({"top_k": 0}, "top_k = 0 must be an integer >= 1, or None"),
        ({"seed": -3}, r"seed = -3 must be an integer in \[0, 2\*\*63\)"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids contains -1"),
        ({"stop_token_ids": "12"}, "stop_token_ids = '12' must be a list of token ids"),
        ({"ignore_eos": 1}, "ignore_eos = 1 must be true or false"),
    ],
)
def test_sampling_params_validation(kw: dict, msg: str) -> None:
    with pytest.raises(ConfigError, match=msg):
        SamplingParams(**kw)


def test_sampling_params_normalise() -> None:
    sp = SamplingParams(temperature=1, stop_token_ids=[4, 5])
    assert sp.temperature == 1.0 and sp.stop_token_ids == (4, 5) and not sp.greedy
    assert SamplingParams().greedy


def test_request_counters() -> None:
    r = Request("r", (10, 11, 12), SamplingParams(max_new_tokens=4))
    r.output_ids += [20, 21]
    assert (r.num_prompt_tokens, r.num_output_tokens, r.num_tokens) == (3, 2, 5)
    assert r.token_ids(2, 4) == [12, 20] and r.all_token_ids == [10, 11, 12, 20, 21]
    assert r.token_ids(3) == [20, 21] and r.token_ids(0, 2) == [10, 11]
    r.num_computed_tokens = 4
    assert r.num_pending_tokens == 1 and not r.in_prefill
    with pytest.raises(ConfigError, match="prompt token 'x' is not a token id"):
        Request("q", (1, "x"), SamplingParams())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="request_id = '' must be a non-empty string"):
        Request("", (1,), SamplingParams())
