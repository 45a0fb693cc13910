"""MTP verification honours the whole sampling pipeline (engine/speculative.py): logit_bias, repetition /
presence / frequency penalties, min_tokens with stop ids, and logprobs give, with --speculative-num-steps 2, the
tokens (and logprobs within 1e-5) of the same requests without MTP.

Greedy: exact. Seeded: exact under top_k = 1 (the filtered target distribution is a point mass, so rejection
sampling accepts a draft iff it is that token and otherwise draws it from the residual); a seeded request with a
wider distribution follows the same distribution under MTP but from other draws (accept / residual draws are
salted apart from the target's own), so its tokens are not comparable one for one: there the processed target
distribution is checked by counting (test_rejection_sampling_follows_the_processed_distribution)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsakv.engine.mtp_fit import fit_mtp, fit_prompts
from dsakv.engine.request import Request, SamplingParams, TokenLogprobs
from dsakv.engine.sampling import process_logits
from dsakv.engine.speculative import accept_with_logprobs
from dsakv.model.loader import load_draft, load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.engines import flat_engine

NEW = 14
TOL = 5e-5


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """The 12-layer tiny model with an MTP layer fitted briefly (it accepts most drafts on the fit prompts)."""
    ckpt = make_tiny(tmp_path_factory.mktemp("specsamp"), seed=0, mtp=1)
    fit_mtp(ckpt, num_prompts=16, steps=60)
    spec, model = load_model(ckpt)
    return spec, model, load_draft(ckpt)


def _prompts() -> list[list[int]]:
    return fit_prompts(512, 16)[:4] + fit_prompts(512, 48, seed=11)[40:42]


def _run(fitted, k: int, prompts, params: list[SamplingParams]):
    """Each request's tokens and the logprobs the engine reported with them (RequestOutput.new_logprobs)."""
    spec, model, draft = fitted
    kw = {"speculative_num_steps": k, "draft": draft, "spec_poison_rejected": True} if k else {}
    e = flat_engine((spec, model), page_size=4, check_every_step=True, eos_token_ids=(1,), **kw)
    rids = [e.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    toks: dict[str, list[int]] = {r: [] for r in rids}
    lps: dict[str, list[TokenLogprobs]] = {r: [] for r in rids}
    while e.has_unfinished():
        for o in e.step():
            assert o.error is None, o.error
            toks[o.request_id].extend(o.new_token_ids)
            lps[o.request_id].extend(o.new_logprobs)
    st = e.spec_stats()
    if k:
        assert st is not None and st["spec_accepted_tokens"] > 0  # drafts were accepted: multi-token steps
    return [toks[r] for r in rids], [lps[r] for r in rids]


def _same(a, b) -> None:
    """Tokens equal; logprobs: the same ids, values within TOL (the processing is the same per row; the verify
    forward over k + 1 positions and a 1-token decode forward round float32 differently: up to 1.4e-5 seen,
    after temperature 0.7)."""
    (ta, la), (tb, lb) = a, b
    assert ta == tb
    assert len(la) == len(ta)
    for u, v in zip(la, lb, strict=True):
        assert u.token_id == v.token_id
        assert u.logprob == pytest.approx(v.logprob, abs=TOL)
        assert [t for t, _ in u.top] == [t for t, _ in v.top]
        assert [x for _, x in u.top] == pytest.approx([x for _, x in v.top], abs=TOL)


def _variants(base: SamplingParams) -> list[SamplingParams]:
    """The greedy request and a seeded top_k = 1 one (temperature 0.7: its logprobs are of logits / 0.7)."""
    return [base, replace(base, temperature=0.7, top_k=1, seed=5)]


PLAIN = SamplingParams(max_new_tokens=NEW, ignore_eos=True, logprobs=3)
CASES = {
    "logit_bias": {"logit_bias": {7: 6.0, 100: 5.0, 300: 4.5}},
    "repetition_penalty": {"repetition_penalty": 3.0},
    "presence_penalty": {"presence_penalty": 2.0},
    "frequency_penalty": {"frequency_penalty": 2.0},
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("variant", [0, 1], ids=["greedy", "seeded_top_k_1"])
def test_processors_with_mtp_equal_without(fitted, name, variant):
    prompts = _prompts()
    sp = _variants(replace(PLAIN, **CASES[name]))[variant]
    off = _run(fitted, 0, prompts, [sp] * len(prompts))
    plain = _run(fitted, 0, prompts, [_variants(PLAIN)[variant]] * len(prompts))
    assert off[0] != plain[0]  # control: the processor changes these outputs
    on = _run(fitted, 2, prompts, [sp] * len(prompts))
    for i in range(len(prompts)):
        assert len(on[1][i]) == len(on[0][i]) == NEW  # one logprob per token, each with 3 alternatives
        assert all(len(lp.top) == 3 for lp in on[1][i])
        _same((on[0][i], on[1][i]), (off[0][i], off[1][i]))


def test_logprobs_with_mtp_equal_without(fitted):
    prompts = _prompts()
    for sp in _variants(replace(PLAIN, logprobs=5)):
        off = _run(fitted, 0, prompts, [sp] * len(prompts))
        on = _run(fitted, 2, prompts, [sp] * len(prompts))
        for i in range(len(prompts)):
            assert len(on[1][i]) == NEW and all(len(lp.top) == 5 for lp in on[1][i])
            assert on[1][i][0].token_id == on[0][i][0]
            _same((on[0][i], on[1][i]), (off[0][i], off[1][i]))


@pytest.mark.parametrize("variant", [0, 1], ids=["greedy", "seeded_top_k_1"])
def test_min_tokens_masks_stop_ids_with_mtp_as_without(fitted, variant):
    """Stop ids = tokens the unconstrained request emits at output 1 and 3 (masked until min_tokens = 6, so the
    request runs past them) and one it then emits at output 8 only (it stops there, STOP, the stop id kept and
    the tokens after it dropped): exactly as without MTP."""
    prompts = _prompts()
    base = _variants(PLAIN)[variant]
    free = _run(fitted, 0, prompts, [base] * len(prompts))[0]
    params = [replace(base, min_tokens=6, stop_token_ids=(f[1], f[3]), logprobs=2) for f in free]
    masked = _run(fitted, 0, prompts, params)[0]
    for i, m in enumerate(masked):
        assert free[i][1] not in m[:6] and free[i][3] not in m[:6] and len(m) > 6
        if m[8] not in m[:8]:
            params[i] = replace(params[i], stop_token_ids=(*params[i].stop_token_ids, m[8]))
    off = _run(fitted, 0, prompts, params)
    on = _run(fitted, 2, prompts, params)
    assert sum(len(t) == 9 for t in off[0]) >= 2  # requests that stopped at their third stop id
    for i in range(len(prompts)):
        _same((on[0][i], on[1][i]), (off[0][i], off[1][i]))


def test_rejection_sampling_follows_the_processed_distribution():
    """Accept d ~ q with prob min(1, p/q), else from norm(max(p - q, 0)), with p the *processed* target
    distribution (logit_bias, a presence penalty on a token accepted earlier in the same step, temperature):
    the second token follows p as of that position. Logprobs are those of the processed rows."""
    raw = torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5])
    params = SamplingParams(max_new_tokens=4, temperature=0.9, logit_bias={3: 2.5}, presence_penalty=1.5)
    q = torch.softmax(torch.tensor([0.0, 2.0, 1.0, 0.0, -2.0]), dim=-1)
    ref = Request("ref", (1,), params)
    ref.output_ids.append(0)  # the state at position 1: d1 = 0 accepted (its presence is penalised)
    p1 = torch.softmax(process_logits(raw[None], [ref])[0], dim=-1)
    logits = torch.stack([torch.tensor([9.0, -9.0, -9.0, -9.0, -9.0]), raw])  # d1 = 0 always accepted
    point = torch.zeros(5)
    point[0] = 1.0
    counts = torch.zeros(5)
    n = 4000
    g = torch.Generator().manual_seed(0)
    for i in range(n):
        req = Request(f"r{i}", (1,), params, sampling_seed=i)
        d2 = int(torch.multinomial(q, 1, generator=g))
        toks, _ = accept_with_logprobs(req, [0, d2], [point, q], torch.cat([logits, raw[None]]))
        assert toks[0] == 0
        counts[toks[1]] += 1
    assert (counts / n - p1).abs().max() < 0.025, (counts / n, p1)
    req = Request("lp", (1,), replace(params, logprobs=2))
    toks, lps = accept_with_logprobs(req, [0, 1], [point, point], torch.cat([logits, raw[None]]))
    assert lps is not None and len(lps) == len(toks)
    assert lps[1].logprob == pytest.approx(float(torch.log(p1[toks[1]])), abs=1e-5)
