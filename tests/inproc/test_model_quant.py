"""Weight quantisation: exact int8 / fp8 block values, fp8 block-scaled checkpoints load to the same weights, and
the quantised model's greedy tokens equal transformers' on the same quantised weights."""

from __future__ import annotations

import pytest
import torch

from dsakv.cli import options
from dsakv.cli.main import build_parser
from dsakv.config import WEIGHT_DTYPES as ENGINE_WEIGHT_DTYPES
from dsakv.config import EngineConfig
from dsakv.errors import ConfigError
from dsakv.model.loader import load_model
from dsakv.model.quant import (
    FP8_MAX,
    KEEP_FULL,
    WEIGHT_DTYPES,
    Int8Linear,
    dequantize,
    dequantize_fp8_block,
    dequantize_int8,
    pack_int8,
    qlinear,
    quantize_fp8_block,
    quantize_int8,
    quantize_weights,
    round_trip,
    use_int8_gemv,
)
from dsakv.model.tiny import make_tiny
from dsakv.testing.models import greedy, prompts_for


def test_int8_per_channel_exact():
    w = torch.tensor([[254.0, -127.0, 3.0], [0.0, 0.0, 0.0], [127.0, -63.5, 0.4]])
    q, scale = quantize_int8(w)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32
    assert scale.tolist() == [2.0, 1.0, 1.0]  # max |row| / 127; 1 for the all-zero row
    # row 0: 127, round(-63.5) = -64 (half to even), round(1.5) = 2; the zero row stays 0; row 2: 127, -64, 0
    assert q.tolist() == [[127, -64, 2], [0, 0, 0], [127, -64, 0]]
    back = dequantize_int8(q, scale)
    assert back.tolist() == [[254.0, -128.0, 4.0], [0.0, 0.0, 0.0], [127.0, -64.0, 0.0]]
    assert torch.equal(round_trip(w, "int8"), back)


def test_fp8_block_exact():
    # values on the e4m3 grid times a power of two come back exactly; two row blocks of 128, one column block
    grid = torch.tensor([448.0, -1.0, 0.5, 0.0, 3.5, -448.0])
    w = torch.cat([grid.repeat(22)[:128, None].repeat(1, 3) * 0.25, grid.repeat(1)[[0, 1]][:, None].repeat(1, 3)])
    q, scale_inv = quantize_fp8_block(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (130, 3)
    assert scale_inv.tolist() == [[0.25], [1.0]]  # max |block| / 448: 112 / 448 and 448 / 448
    assert torch.equal(dequantize_fp8_block(q, scale_inv), w)
    # off-grid values: dequantised = the e4m3 rounding of w / scale, times scale, exactly
    x = torch.linspace(-3.0, 3.0, 200 * 130).view(200, 130)
    q, s = quantize_fp8_block(x)
    assert s.shape == (2, 2)
    blk = s.repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :130]
    assert torch.equal(dequantize_fp8_block(q, s), (x / blk).to(torch.float8_e4m3fn).float() * blk)
    assert float(s.max()) == pytest.approx(3.0 / FP8_MAX)


def test_weight_dtypes_agree_and_refuse_unknown():
    assert ENGINE_WEIGHT_DTYPES == WEIGHT_DTYPES
    with pytest.raises(ConfigError, match="weight_dtype 'int4' is unknown: use one of model, int8, fp8"):
        EngineConfig(weight_dtype="int4")
    with pytest.raises(ConfigError, match="weight dtype 'q4' is unknown"):
        round_trip(torch.ones(2, 2), "q4")
    with pytest.raises(ConfigError, match="int8_gemv needs int8 weights, but weight_dtype is 'fp8'"):
        EngineConfig(weight_dtype="fp8", int8_gemv=True)
    cfg = EngineConfig(weight_dtype="int8", int8_gemv=True)
    argv = options.engine_argv(cfg)
    i = argv.index("--weight-dtype")
    assert argv[i : i + 3] == ["--weight-dtype", "int8", "--int8-gemv"]
    assert options.config_from_args(build_parser().parse_args(["serve", *argv])).engine == cfg


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("quant") / "tiny", arch="deepseek_v32", seed=0, layers=3)


def test_fp8_checkpoint_loads_the_block_weights(ckpt, tmp_path):
    """A checkpoint shipping fp8 weights with weight_scale_inv (as V3.2 / GLM-5.x do) loads to exactly the
    dequantised blocks, the same weights as --weight-dtype fp8 on the fp32 checkpoint, and the same tokens."""
    import shutil

    from safetensors.torch import load_file, save_file

    raw = load_file(str(ckpt / "model.safetensors"))
    out = {}
    for name, t in raw.items():
        if t.dim() == 2 and name.endswith(".weight") and not name.endswith(KEEP_FULL) and "norm" not in name:
            q, s = quantize_fp8_block(t)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    fp8_dir = tmp_path / "fp8"
    shutil.copytree(ckpt, fp8_dir)
    save_file(out, str(fp8_dir / "model.safetensors"))
    _, shipped = load_model(fp8_dir)
    _, rounded = load_model(ckpt, weight_dtype="fp8")
    _, plain = load_model(ckpt)
    sd_s, sd_r, sd_p = shipped.state_dict(), rounded.state_dict(), plain.state_dict()
    name = "model.layers.1.self_attn.q_b_proj.weight"
    assert torch.equal(sd_s[name], dequantize_fp8_block(*quantize_fp8_block(raw[name])))
    assert not torch.equal(sd_s[name], sd_p[name])
    differ = [k for k in sd_s if not torch.equal(sd_s[k], sd_r[k])]
    assert differ == []
    layout = shipped.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    prompts = prompts_for([9, 20])
    a, _ = greedy(shipped, layout, prompts, 8)
    b, _ = greedy(rounded, layout, prompts, 8)
    assert [r.generated for r in a] == [r.generated for r in b]


def _hf_on_int8_grid(transformers, ckpt):  # type: ignore[no-untyped-def]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if p.dim() >= 2 and not pname.endswith(KEEP_FULL):
                p.copy_(round_trip(p.reshape(-1, p.shape[-1]), "int8").view_as(p))
    return hf


def test_int8_tokens_match_transformers_on_the_same_weights(ckpt):
    """--weight-dtype int8: every projection stored int8 with its per-channel scale (pack_int8); transformers
    with its weights put on the same grid (row-wise, so fused expert tensors round alike) decodes the same greedy
    tokens, and so does the model whose weights are the dequantised grid in fp32 (quantize_weights)."""
    transformers = pytest.importorskip("transformers")
    _, model = load_model(ckpt, weight_dtype="int8")
    name = "model.layers.2.mlp.experts.3.down_proj"
    _, plain = load_model(ckpt)
    q, scale = quantize_int8(plain.state_dict()[name + ".weight"])
    sd = model.state_dict()
    assert sd[name + ".weight"].dtype == torch.int8 and torch.equal(sd[name + ".weight"], q)
    assert torch.equal(sd[name + ".weight_scale"], scale[:, None])
    assert torch.equal(sd["model.embed_tokens.weight"], plain.state_dict()["model.embed_tokens.weight"])
    hf = _hf_on_int8_grid(transformers, ckpt)
    rounded = quantize_weights(plain, "int8") and plain
    prompts = prompts_for([7, 19])
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    runs, _ = greedy(model, layout, prompts, 12)
    ref_runs, _ = greedy(rounded, layout, prompts, 12)
    assert [r.generated for r in runs] == [r.generated for r in ref_runs]
    for run, pr in zip(runs, prompts, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([pr]), max_new_tokens=12, do_sample=False)[0, len(pr) :].tolist()
        assert run.generated == ref


def test_int8_packed_bytes(ckpt):
    """pack_int8 stores each packed projection as 1 byte a weight plus a float32 scale per output row; kv_b_proj
    (per-head views in attention), the indexer's weights_proj, the router, embeddings and norms stay float32."""
    _, plain = load_model(ckpt)
    _, model = load_model(ckpt, weight_dtype="int8")
    plain_bytes = sum(t.nbytes for t in plain.state_dict().values())
    packed_bytes = sum(t.nbytes for t in model.state_dict().values())
    packed = [m.weight.shape for m in model.modules() if isinstance(m, Int8Linear)]
    # 3 layers x (q_a, q_b, kv_a, o_proj, indexer wq_b, wk) + (1 dense MLP + 2 MoE x (8 experts + shared)) x 3 + lm_head
    assert len(packed) == 3 * 6 + 19 * 3 + 1
    assert plain_bytes == 1_535_680
    # each packed [N, K]: N * K bytes + 4 N for the scales instead of 4 N K
    assert packed_bytes == plain_bytes - sum(3 * n * k - 4 * n for n, k in packed) == 609_152
    assert all(m.weight.dtype == torch.int8 for m in model.modules() if isinstance(m, Int8Linear))
    assert model.dtype == torch.float32
    assert model.model.layers[0].self_attn.kv_b_proj.weight.dtype == torch.float32
    assert pack_int8(plain) == len(packed)


def test_int8_gemv_kernel_tokens(ckpt):
    """The compiled int8 GEMV kernel (use_int8_gemv, calls of <= GEMV_ROWS rows) decodes the same greedy tokens
    as the dequantise-per-call path and as transformers on the same int8 grid; its logits differ from the
    dequantised path's by float32 summation order only (< 1e-4 absolute here)."""
    transformers = pytest.importorskip("transformers")
    _, model = load_model(ckpt, weight_dtype="int8")
    prompts = prompts_for([7, 19])
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    ref_runs, _ = greedy(model, layout, prompts, 12)
    use_int8_gemv(True)
    try:
        runs, _ = greedy(model, layout, prompts, 12)
    finally:
        use_int8_gemv(False)
    assert [r.generated for r in runs] == [r.generated for r in ref_runs]
    pairs = [(a, b) for r, s in zip(runs, ref_runs, strict=True) for a, b in zip(r.logits, s.logits, strict=True)]
    diff = max(float((a - b).abs().max()) for a, b in pairs)
    assert 0.0 < diff < 1e-4
    hf = _hf_on_int8_grid(transformers, ckpt)
    for run, pr in zip(runs, prompts, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([pr]), max_new_tokens=12, do_sample=False)[0, len(pr) :].tolist()
        assert run.generated == ref


def test_qlinear_block_scales_exact():
    """qlinear with a scale [N, nb] (nb equal column blocks, as the MoE's fused down weight) dequantises each
    block with its own scale: exact on small integers."""
    w = torch.tensor([[1, -2, 3, 4], [0, 5, -6, 7]], dtype=torch.int8)
    scale = torch.tensor([[1.0, 0.5], [2.0, 0.25]])
    x = torch.tensor([[1.0, 2.0, 4.0, 8.0]])
    assert dequantize(w, scale, torch.float32).tolist() == [[1.0, -2.0, 1.5, 2.0], [0.0, 10.0, -1.5, 1.75]]
    assert qlinear(x, w, scale).tolist() == [[1.0 - 4.0 + 6.0 + 16.0, 20.0 - 6.0 + 14.0]]
    assert qlinear(x, w.float(), None).tolist() == [[1.0 - 4.0 + 12.0 + 32.0, 10.0 - 24.0 + 56.0]]


def test_quantize_weights_counts_projections(ckpt):
    _, model = load_model(ckpt)
    assert quantize_weights(model, "model") == 0
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = [name for name in linears if name.endswith("indexer.weights_proj")]
    assert len(kept) == 3  # deepseek_v32: every layer a producer
    assert quantize_weights(model, "int8") == len(linears) - 3


@pytest.mark.parametrize("path", ["dense", "padded", "per_expert"])
def test_int8_moe_paths_match_the_dequantised_weights(ckpt, path, monkeypatch):
    """Each MoE path (dense, padded, per expert) on int8 storage gives the dequantised-weights model's output
    (the router runs alone on int8, fused into w_in on fp32: float32 rounding apart)."""
    from dsakv.model import layers

    _, model = load_model(ckpt, weight_dtype="int8")
    _, plain = load_model(ckpt)
    quantize_weights(plain, "int8")
    monkeypatch.setattr(
        layers,
        "choose_moe_path",
        lambda t, k, e, m, counts=None: ("dense" if path == "dense" else "grouped") if counts is None else path,
    )
    x = torch.randn(9, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    moe, ref = model.model.layers[2].mlp, plain.model.layers[2].mlp
    with torch.no_grad():
        got, want = moe(x, residual=x), ref(x, residual=x)
    assert moe._weights().w_in.dtype == torch.int8 and moe._weights().down_scale.shape == (x.shape[1], 9)
    assert torch.allclose(got, want, rtol=0, atol=1e-5) and not torch.equal(got, x)
