"""Logprobs, prompt logprobs, penalties and n > 1 in the engine: logprobs equal log_softmax of transformers'
logits for the same tokens (fp32 pool, within 1e-4) also with chunked prefill; penalties, logit_bias and
min_tokens exact against a hand computation; n = 4 prefills the prompt once and shares its pages."""

from __future__ import annotations

import pytest
import torch

from dsakv.engine.engine import Engine
from dsakv.engine.request import Request, SamplingParams
from dsakv.engine.sampling import process_logits, sample_with_logprobs
from dsakv.errors import ConfigError
from dsakv.testing.engines import _hf, flat_engine, tiny_model

PROMPT = list(range(5, 45))  # 40 tokens: 2 whole pages of 16 and a partial one


def _engine(**kw: object) -> Engine:
    kw.setdefault("page_size", 16)
    kw.setdefault("num_pages", 64)
    kw.setdefault("check_every_step", True)
    return flat_engine(tiny_model("glm_moe_dsa"), **kw)  # type: ignore[arg-type]


def _run(eng: Engine) -> dict[str, list]:
    outs: dict[str, list] = {}
    while eng.has_unfinished():
        for o in eng.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def _hf_logprobs(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_hf("glm_moe_dsa")(torch.tensor([ids])).logits[0].float(), -1)


@pytest.mark.parametrize("max_batch_tokens", [512, 7])  # one prefill pass, and chunks of 7 tokens
def test_logprobs_equal_transformers(max_batch_tokens):
    eng = _engine(max_batch_tokens=max_batch_tokens)
    sp = SamplingParams(max_new_tokens=6, logprobs=5, prompt_logprobs=3, ignore_eos=True)
    rid = eng.add_request(PROMPT, sp)
    outs = _run(eng)[rid]
    ids = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.new_logprobs]
    prompt_lps = outs[0].prompt_logprobs
    assert prompt_lps is not None and len(prompt_lps) == len(PROMPT) - 1
    assert all(o.prompt_logprobs is None for o in outs[1:])
    ref = _hf_logprobs(PROMPT + ids)
    for t, e in enumerate(prompt_lps):  # entry t: prompt token t + 1, from position t
        assert e.token_id == PROMPT[t + 1]
        assert abs(e.logprob - ref[t, e.token_id].item()) < 1e-4
        vals, idx = ref[t].topk(3)
        assert [i for i, _ in e.top] == idx.tolist()
        assert max(abs(v - w) for (_, v), w in zip(e.top, vals.tolist(), strict=True)) < 1e-4
    assert [e.token_id for e in lps] == ids and len(ids) == 6
    for i, e in enumerate(lps):
        row = ref[len(PROMPT) - 1 + i]
        assert abs(e.logprob - row[e.token_id].item()) < 1e-4
        assert e.top[0][0] == e.token_id == int(row.argmax())  # greedy: the best token
        assert [i for i, _ in e.top] == row.topk(5).indices.tolist()


def test_prompt_logprobs_skip_the_prefix_cache():
    eng = _engine(enable_prefix_cache=True)
    a = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1))
    _run(eng)
    b = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1, prompt_logprobs=0))
    c = eng.add_request(PROMPT, SamplingParams(max_new_tokens=1))
    outs = _run(eng)
    assert a and outs[b][0].num_cached_tokens == 0 and len(outs[b][0].prompt_logprobs) == 39
    assert outs[c][0].num_cached_tokens == 32  # the others still hit


def _req(params: SamplingParams, prompt=(2, 3), out=()) -> Request:
    r = Request("r", tuple(prompt), params, eos_token_ids=(1,))
    r.output_ids = list(out)
    return r


def test_penalties_bias_min_tokens_exact():
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5, 3.0]] * 4)
    reqs = [
        _req(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), out=(4, 4, 3)),
        _req(SamplingParams(repetition_penalty=2.0), prompt=(2,), out=(4,)),
        _req(SamplingParams(logit_bias={0: 10.0, 4: -100.0}, temperature=2.0)),
        _req(SamplingParams(min_tokens=2, max_new_tokens=4, stop_token_ids=(3,)), out=(0,)),
    ]
    x = process_logits(logits, reqs).tolist()
    assert x[0] == [1.0, 2.0, -1.0, 0.5 - 0.5 - 0.25, 3.0 - 0.5 - 0.5]
    assert x[1] == [1.0, 2.0, -2.0, 0.5, 1.5]  # seen: 2 (negative: x2), 4 (positive: /2)
    assert x[2] == [11.0 / 2, 1.0, -0.5, 0.25, -97.0 / 2]
    assert x[3] == [1.0, float("-inf"), -1.0, float("-inf"), 3.0]  # eos 1 and stop id 3 banned
    toks, lps = sample_with_logprobs(logits[:1], [_req(SamplingParams(logprobs=0, repetition_penalty=2.0), out=(4,))])
    assert toks == [1] and lps[0] is not None and lps[0].top == ()
    want = torch.log_softmax(torch.tensor([1.0, 2.0, -2.0, 0.25, 1.5]), 0)[1].item()  # seen: 2, 3, 4
    assert abs(lps[0].logprob - want) < 1e-6


def test_min_tokens_in_the_engine():
    eng = _engine()
    # the tiny model's greedy run of this prompt hits eos (1) early; with min_tokens it may not stop before 5
    sp = SamplingParams(max_new_tokens=8, logit_bias={1: 100.0})
    out = eng.generate([PROMPT], sp)[0]
    assert out == [1]  # the bias makes eos certain
    out = eng.generate([PROMPT], SamplingParams(max_new_tokens=8, logit_bias={1: 100.0}, min_tokens=5))[0]
    assert len(out) == 6 and 1 not in out[:5] and out[5] == 1


def test_n4_shares_the_prompt_pages_and_each_choice_has_its_seed():
    eng = _engine()
    sp = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7, n=4, ignore_eos=True)
    rid = eng.add_request(PROMPT, sp)
    ids = [rid, f"{rid}/1", f"{rid}/2", f"{rid}/3"]
    eng.step()  # sequence 0 prefills the 40 prompt tokens (3 pages); the 3 others now share its 2 whole pages
    assert eng.stats().pages_used == 3
    held = {r: eng.pages_of(r).tolist() for r in ids}
    assert [held[r] for r in ids[1:]] == [held[rid][:2]] * 3 and len(held[rid]) == 3
    assert eng.allocator.refcount[held[rid][:2]].tolist() == [4, 4]
    outs = eng.step()  # each of the 3 recomputes tokens 32..39 in a page of its own
    assert eng.stats().pages_used == 2 + 4  # 4 separate requests: 12
    assert sorted(o.choice_index for o in outs) == [0, 1, 2, 3]
    finals = {o.choice_index: list(o.output_ids) for v in _run(eng).values() for o in v if o.finished}
    assert sorted(finals) == [0, 1, 2, 3] and eng.stats().pages_used == 0
    for i in range(4):  # choice i draws as a lone request seeded 7 + i
        alone = SamplingParams(max_new_tokens=4, temperature=1.0, seed=7 + i, ignore_eos=True)
        assert finals[i] == _engine().generate([PROMPT], alone)[0]
    assert len({tuple(v) for v in finals.values()}) > 1


def test_n_abort_before_the_fork_and_after():
    eng = _engine(max_batch_tokens=16)  # the 40-token prompt takes 3 steps
    rid = eng.add_request(PROMPT, SamplingParams(max_new_tokens=3, n=3))
    eng.step()
    eng.abort(rid)  # sequence 0 leaves mid-prefill: 1 and 2 queue on their own
    outs = _run(eng)
    assert sorted(outs) == [rid, f"{rid}/1", f"{rid}/2"]
    assert [len(outs[f"{rid}/{i}"][-1].output_ids) for i in (1, 2)] == [3, 3]
    rid = eng.add_request(PROMPT, SamplingParams(max_new_tokens=3, n=3), request_id="x")
    eng.abort("x/2")  # a sequence still waiting to fork
    outs = _run(eng)
    assert sorted(outs) == ["x", "x/1", "x/2"] and outs["x/2"][-1].finish_reason == "abort"
    assert eng.stats().pages_used == 0


def test_n_validation():
    with pytest.raises(ConfigError, match="n = 0"):
        SamplingParams(n=0)
    with pytest.raises(ConfigError, match="add_request"):
        _engine().generate([PROMPT], SamplingParams(n=2))
    with pytest.raises(ConfigError, match="logprobs = 21"):
        SamplingParams(logprobs=21)
    with pytest.raises(ConfigError, match="min_tokens = 9"):
        SamplingParams(min_tokens=9, max_new_tokens=8)
