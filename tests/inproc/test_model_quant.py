"""Weight quantisation: exact int8 / fp8 block values, fp8 block-scaled checkpoints load to the same weights, and
the quantised model's greedy tokens equal transformers' on the same quantised weights."""

from __future__ import annotations

import pytest
import torch

from dsakv.config import WEIGHT_DTYPES as ENGINE_WEIGHT_DTYPES
from dsakv.config import EngineConfig
from dsakv.errors import ConfigError
from dsakv.model.loader import load_model
from dsakv.model.quant import (
    FP8_MAX,
    KEEP_FULL,
    WEIGHT_DTYPES,
    dequantize_fp8_block,
    dequantize_int8,
    quantize_fp8_block,
    quantize_int8,
    quantize_weights,
    round_trip,
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


def test_int8_tokens_match_transformers_on_the_same_weights(ckpt):
    """--weight-dtype int8: every projection on its per-channel int8 grid; transformers with its weights put on
    the same grid (row-wise, so fused expert tensors round alike) decodes the same greedy tokens."""
    transformers = pytest.importorskip("transformers")
    _, model = load_model(ckpt, weight_dtype="int8")
    name = "model.layers.2.mlp.experts.3.down_proj.weight"
    _, plain = load_model(ckpt)
    w = plain.state_dict()[name]
    assert torch.equal(model.state_dict()[name], dequantize_int8(*quantize_int8(w)))
    assert torch.equal(model.state_dict()["model.embed_tokens.weight"], plain.state_dict()["model.embed_tokens.weight"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            if p.dim() >= 2 and not pname.endswith(KEEP_FULL):
                p.copy_(round_trip(p.reshape(-1, p.shape[-1]), "int8").view_as(p))
    prompts = prompts_for([7, 19])
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    runs, _ = greedy(model, layout, prompts, 12)
    for run, pr in zip(runs, prompts, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([pr]), max_new_tokens=12, do_sample=False)[0, len(pr) :].tolist()
        assert run.generated == ref


def test_quantize_weights_counts_projections(ckpt):
    _, model = load_model(ckpt)
    assert quantize_weights(model, "model") == 0
    linears = [name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept = [name for name in linears if name.endswith("indexer.weights_proj")]
    assert len(kept) == 3  # deepseek_v32: every layer a producer
    assert quantize_weights(model, "int8") == len(linears) - 3
