"""`--compile` (EngineConfig.compile_decode, model/gemv.py): decode's 1-2 row float matmuls on one compiled GEMV.
Greedy tokens equal the eager engine's on both tiny architectures; logits differ by float32 summation order only;
calls the kernel does not take stay on the BLAS."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from dsakv.cli.main import build_parser
from dsakv.cli.options import engine_config
from dsakv.config import EngineConfig
from dsakv.engine.argv import engine_argv
from dsakv.engine.engine import Engine
from dsakv.engine.sampling import SamplingParams
from dsakv.model import attention, dsa_model, native
from dsakv.model import gemv as gemv_mod
from dsakv.model.gemv import ROWS, gemv, use_compiled_gemv
from dsakv.model.layers import MoE
from dsakv.model.loader import load_model
from dsakv.model.native import MAX_ROWS
from dsakv.model.tiny import make_tiny
from dsakv.testing.config import engine_config as flat_config
from dsakv.testing.models import greedy, prompts_for


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("compile")
    out = {arch: make_tiny(base / arch, arch=arch, seed=0) for arch in ("glm_moe_dsa", "deepseek_v32")}
    # experts large enough that one token skips the dense MoE path (as on real models): moe_after_attention runs
    big = {"hidden_size": 256, "moe_intermediate_size": 512, "n_routed_experts": 8, "num_experts_per_tok": 2}
    out["big_experts"] = make_tiny(base / "big", arch="glm_moe_dsa", seed=0, overrides=big)
    return out


def count_calls(monkeypatch, module, name: str) -> list[bool]:
    """Patch module.name (a kernel entry that returns None where it does not apply) to record, per call, whether
    it applied."""
    fn, ran = getattr(module, name), []

    def counted(*a, **kw):
        out = fn(*a, **kw)
        ran.append(out is not None)
        return out

    monkeypatch.setattr(module, name, counted)
    return ran


@pytest.fixture
def compiled():
    use_compiled_gemv(True)
    try:
        yield
    finally:
        use_compiled_gemv(False)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_compiled_decode_tokens_equal_eager(ckpts, arch, compiled, monkeypatch):
    """Two sequences (decode steps of 2 rows: attention, lm_head and the per-expert matmuls on the kernel, the
    absorbed attention on model/native's mla_decode reading the fp32 pool in place): the same greedy tokens as
    eager, logits within 1e-4 absolute (|logits| ~ 1-10 here), and not bitwise equal (the kernel ran)."""
    ran = count_calls(monkeypatch, attention, "mla_decode")
    _, model = load_model(ckpts[arch])
    prompts = prompts_for([7, 19])
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    use_compiled_gemv(False)
    ref, _ = greedy(model, layout, prompts, 10)
    use_compiled_gemv(True)
    assert ran == []  # eager: the BLAS path only
    runs, _ = greedy(model, layout, prompts, 10)
    assert [r.generated for r in runs] == [r.generated for r in ref]
    assert len(ran) >= 9 * model.spec.num_layers and all(ran)  # every decode step's every layer
    pairs = [(a, b) for r, s in zip(runs, ref, strict=True) for a, b in zip(r.logits, s.logits, strict=True)]
    diff = max(float((a - b).abs().max()) for a, b in pairs)
    assert 0.0 < diff < 1e-4


def test_engine_flag_batch1_tokens(ckpts, compiled, monkeypatch):
    """Engine(compile_decode=True) turns the kernel on; a batch-1 decode gives eager's tokens: while top-k covers
    every key (S <= index_topk 16) each MoE layer runs as decode_one.layer_one's plan; after that (S 17..19, the
    indexer scores) each MoE layer's tail is one moe_after_attention call."""
    tail = count_calls(monkeypatch, dsa_model, "moe_after_attention")
    one = count_calls(monkeypatch, dsa_model, "layer_one")
    path = ckpts["big_experts"]
    sp = SamplingParams(max_new_tokens=8, ignore_eos=True)
    prompt = prompts_for([11])[0]
    out = {}
    for on in (False, True):
        use_compiled_gemv(False)
        cfg = flat_config(kv_format="fp32", index_format="fp32", page_size=8, max_tokens=64, compile_decode=on)
        eng = Engine(path, cfg)
        assert gemv_mod.compiled_gemv_on() is on
        out[on] = eng.generate([prompt], sp)
        if not on:  # eager: nothing fused (layer_one is asked and declines)
            assert tail == [] and len(one) > 0 and not any(one)
            one.clear()
    kinds = [isinstance(layer.mlp, MoE) for layer in eng.model.model.layers]
    n, moe_layers = len(kinds), sum(kinds)
    assert eng.spec.index_topk == 16 and 1 <= moe_layers < n  # dense and MoE layers both
    # the prefill (11 rows) and decode steps at S = 12..18 (the last token is sampled, not run): every layer of the
    # steps at S <= 16 on the plan, none at 17 and 18
    assert one == [False] * n + [True] * (5 * n) + [False] * (2 * n), one
    assert tail == [True] * (2 * moe_layers), tail
    assert out[True] == out[False]
    # the layers' plans hold no pool: the engine's pool goes with the engine, the model stays loaded
    pool, model = weakref.ref(eng.pool), eng.model
    assert all(getattr(layer, "_one_plan", None) is not None for layer in model.model.layers)
    # each plan's tail (W_UV, o_proj, norm, MoE or dense MLP) is one native call (decode_tail)
    assert all(layer._one_plan.tail is not None for layer in model.model.layers)
    del eng
    gc.collect()
    assert pool() is None


def test_gemv_applies_to_few_float_rows_only(compiled):
    w = torch.randn(5, 7)
    x = torch.randn(ROWS, 7)
    y = gemv(x, w)
    assert y is not None and y.shape == (ROWS, 5)
    assert torch.allclose(y, x @ w.t(), atol=1e-5)
    assert gemv(torch.randn(MAX_ROWS + 1, 7), w) is None  # more rows: the BLAS (ROWS + 1..MAX_ROWS: model/native)
    assert gemv(x.double(), w.double()) is None  # float32 only
    assert gemv(torch.randn(0, 7), w) is None
    use_compiled_gemv(False)
    assert gemv(x, w) is None  # off: every call on the BLAS


def test_compile_flag_cli_and_argv():
    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "hi", "--compile"])
    assert engine_config(args).compile_decode is True
    assert "--compile" in engine_argv(EngineConfig(compile_decode=True))
    assert "--compile" not in engine_argv(EngineConfig())


def test_head_bmm_kernels_match_torch_bmm(compiled):
    """gemv.bmm, the absorbed attention's per-head W_UK and W_UV^T products at decode: on the kernel (both weight
    layouts, views into one kv_b_proj weight as attention.py takes them) within float32 rounding of torch.bmm, and
    torch.bmm itself (bitwise) where it does not apply."""
    from dsakv.model.gemv import bmm

    g = torch.Generator().manual_seed(0)
    w = torch.randn(4 * 24, 40, generator=g).view(4, 24, 40)  # H 4, nope 8 | v 16, r 40
    w_uk, w_uv_t = w[:, :8], w[:, 8:].transpose(1, 2)  # [H, nope, r] rows contiguous; [H, r, v] a transposed view
    for rows in (1, ROWS):
        q, o = torch.randn(rows, 4, 8, generator=g), torch.randn(rows, 4, 40, generator=g)
        for x, wt in ((q.transpose(0, 1), w_uk), (o.transpose(0, 1), w_uv_t)):
            ref = torch.bmm(x, wt)
            got = bmm(x, wt)
            assert got.shape == ref.shape == (4, rows, wt.shape[2])
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
            assert not torch.equal(got, torch.zeros_like(got))
    x = torch.randn(4, ROWS + 1, 8, generator=g)
    assert torch.equal(bmm(x, w_uk), torch.bmm(x, w_uk))  # more rows: torch.bmm
    with pytest.raises(RuntimeError):  # mismatched batches: torch.bmm's error, not a broadcast
        bmm(x[:1, :1], w_uk)
    assert torch.equal(bmm(x[:, :1].double(), w_uk.double()), torch.bmm(x[:, :1].double(), w_uk.double()))
    use_compiled_gemv(False)
    x = torch.randn(4, 1, 40, generator=g)
    assert torch.equal(bmm(x, w_uv_t), torch.bmm(x, w_uv_t))  # off: torch.bmm


def test_compiled_rms_norm_matches_eager(compiled):
    """gemv.rms_norm: F.rms_norm within float32 rounding on the kernel (a strided slice as attention passes it),
    None where it does not apply (more than ROWS rows, float64, off)."""
    from dsakv.model.gemv import rms_norm

    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, 48, generator=g)[:, :40] * 3  # row stride 48: a slice of a fused projection's output
    w = torch.randn(40, generator=g)
    got = rms_norm(x, w, 1e-6)
    assert got is not None
    torch.testing.assert_close(got, torch.nn.functional.rms_norm(x, (40,), w, 1e-6), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(got, torch.nn.functional.rms_norm(x, (40,), w, 1e-1))  # eps is the kernel's own
    assert rms_norm(torch.randn(ROWS + 1, 40), w, 1e-6) is None
    assert rms_norm(x.double(), w.double(), 1e-6) is None
    use_compiled_gemv(False)
    assert rms_norm(x, w, 1e-6) is None


def test_native_layer_matches_the_compiled_plan(ckpts, compiled, monkeypatch):
    """A batch-1 decode step's layers as decode_one's two native calls (decode_head: the input norm, q_a | kv_a |
    index key, their norms and ropes, the KV row and a producer's index key written to the pool, the query through
    W_UK, the absorbed attention; decode_tail: W_UV, o_proj, norm, MoE or dense MLP) against the same plan on its
    compiled kernels and bgemv_kn / mla_decode: the same greedy tokens, logits within 1e-4, every pool byte the
    compiled plan wrote within float32 rounding (pages picked at random: the native call writes the token's slot)."""
    _, model = load_model(ckpts["big_experts"])
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    prompt = prompts_for([11])
    used = []
    for layer in model.model.layers:
        layer.__dict__.pop("_one_plan", None)
    runs, pool = greedy(model, layout, prompt, 5)  # decode at S = 12..16 <= index_topk: every layer on the plan
    plans = [layer._one_plan for layer in model.model.layers]
    assert all(p.head is not None and p.tail is not None for p in plans)
    monkeypatch.setattr(native, "decode_head", lambda *a: used.append("head") and None)
    monkeypatch.setattr(native, "decode_tail", lambda *a: used.append("tail") and None)
    for layer in model.model.layers:
        del layer._one_plan
    ref, ref_pool = greedy(model, layout, prompt, 5)
    assert used == ["tail", "head"] * len(plans)  # each layer's plan rebuilt without them
    assert runs[0].generated == ref[0].generated
    diff = max(float((a - b).abs().max()) for a, b in zip(runs[0].logits, ref[0].logits, strict=True))
    assert diff < 1e-4
    for key in layout.keys:
        got, want = pool.tensor(key).view(torch.float32), ref_pool.tensor(key).view(torch.float32)
        assert bool(want.ne(0).any())
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
