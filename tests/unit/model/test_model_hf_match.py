"""The pool-backed DSA model gives transformers' tokens and logits (both archs, exact fp32 storage)."""

from __future__ import annotations

import pytest
import torch

from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.models import greedy, prompts_for

transformers = pytest.importorskip("transformers")

STEPS = 32
LENGTHS = [5, 17, 40]  # index_topk is 16: the last two really prune during prefill, all three during decode


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def tiny(request, tmp_path_factory):
    path = make_tiny(tmp_path_factory.mktemp(request.param), arch=request.param, seed=0)
    spec, model = load_model(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # the tiny vocab's eos (1) must not stop the reference early
    hf.generation_config.pad_token_id = 0
    prompts = prompts_for(LENGTHS)
    ref_tokens, ref_logits = [], []
    with torch.no_grad():
        for pr in prompts:
            ids = torch.tensor([pr])
            out = hf.generate(ids, max_new_tokens=STEPS, do_sample=False)[0]
            ref_tokens.append(out[len(pr) :].tolist())
            full = out[:-1][None]
            ref_logits.append(hf(full).logits[0, len(pr) - 1 :])
    return request.param, spec, model, prompts, ref_tokens, ref_logits


def test_tiny_checkpoint_shape(tiny):
    arch, spec, model, *_ = tiny
    assert spec.model_type == arch
    assert spec.num_layers == 12 and spec.index_topk == 16
    expected = (0, 1, 2, 6, 10) if arch == "glm_moe_dsa" else tuple(range(12))
    assert spec.producers == expected
    assert model.spec is spec


@pytest.mark.parametrize("chunk,page_size", [(None, 8), (7, 16), (3, 1)])
def test_greedy_matches_transformers(tiny, chunk, page_size):
    arch, spec, model, prompts, ref_tokens, ref_logits = tiny
    layout = model.layout_for(elide=True, kv_format="fp32", index_format="fp32", page_size=page_size)
    runs, _ = greedy(model, layout, prompts, STEPS, chunk=chunk)
    for run, toks, logits in zip(runs, ref_tokens, ref_logits, strict=True):
        assert run.generated == toks
        ours = torch.stack(run.logits)
        assert ours.shape == logits.shape == (STEPS, spec.vocab_size)
        assert (ours - logits).abs().max().item() < 1e-4
    # greedy output is not degenerate: the tiny weights give varied tokens
    assert len({t for toks in ref_tokens for t in toks}) > 40


def test_decode_alone_matches_batched(tiny):
    """One sequence on its own gives the same tokens as inside a mixed batch."""
    arch, spec, model, prompts, ref_tokens, _ = tiny
    layout = model.layout_for(elide=True, kv_format="fp32", index_format="fp32", page_size=4)
    runs, _ = greedy(model, layout, prompts[2:], STEPS)
    assert runs[0].generated == ref_tokens[2]


@pytest.mark.parametrize("path", ["absorbed", "expanded"])
def test_each_mla_path_matches_transformers(tiny, path):
    """Both attention paths, forced for every step (prefill chunks and decode), give transformers' tokens."""
    arch, spec, model, prompts, ref_tokens, ref_logits = tiny
    layout = model.layout_for(elide=True, kv_format="fp32", index_format="fp32", page_size=16)
    model.set_mla_path(path)
    try:
        runs, _ = greedy(model, layout, prompts, STEPS, chunk=7)
    finally:
        model.set_mla_path("auto")
    for run, toks, logits in zip(runs, ref_tokens, ref_logits, strict=True):
        assert run.generated == toks
        assert (torch.stack(run.logits) - logits).abs().max().item() < 1e-4
