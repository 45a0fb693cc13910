"""HF checkpoint loader: names, fused experts, fp8 block weights, MTP layers, clear errors; make-tiny."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dsakv.cli.main import main as cli_main
from dsakv.errors import ConfigError
from dsakv.model.loader import _dequant_fp8, load_config, load_model
from dsakv.model.tiny import make_tiny


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0, layers=3)


def _copy(ckpt, dst, tensors, cfg_update=None):
    dst.mkdir()
    cfg = load_config(ckpt)
    cfg.update(cfg_update or {})
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_load_tiny(ckpt):
    spec, model = load_model(ckpt)
    assert spec.num_layers == 3 and spec.producers == (0, 1, 2)
    assert model.model.layers[0].mlp.__class__.__name__ == "MLP"  # first_k_dense_replace = 1
    assert model.model.layers[1].mlp.__class__.__name__ == "MoE"
    raw = load_file(str(ckpt / "model.safetensors"))
    w = raw["model.layers.1.mlp.experts.3.up_proj.weight"]
    assert torch.equal(model.model.layers[1].mlp.experts[3].up_proj.weight, w)
    bias = raw["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.abs().sum() > 0  # make-tiny writes a non-trivial bias, so the equality below means it was loaded
    assert torch.equal(model.model.layers[1].mlp.gate.e_score_correction_bias, bias.float())
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_bf16_keeps_router_and_indexer_weights_fp32(ckpt):
    _, model = load_model(ckpt, dtype=torch.bfloat16)
    layer = model.model.layers[1]
    assert layer.self_attn.q_a_proj.weight.dtype == torch.bfloat16
    assert layer.mlp.gate.weight.dtype == torch.float32
    assert layer.self_attn.indexer.weights_proj.weight.dtype == torch.float32


def test_fused_experts_and_mtp_layers(ckpt, tmp_path):
    raw = load_file(str(ckpt / "model.safetensors"))
    fused = {k: v for k, v in raw.items() if ".mlp.experts." not in k}
    for layer in (1, 2):
        pre = f"model.layers.{layer}.mlp.experts"
        fused[f"{pre}.gate_up_proj"] = torch.stack(
            [torch.cat([raw[f"{pre}.{e}.gate_proj.weight"], raw[f"{pre}.{e}.up_proj.weight"]]) for e in range(8)]
        )
        fused[f"{pre}.down_proj"] = torch.stack([raw[f"{pre}.{e}.down_proj.weight"] for e in range(8)])
    fused["model.layers.3.self_attn.q_a_proj.weight"] = torch.ones(2, 2)  # an MTP layer: skipped
    _, a = load_model(ckpt)
    _, b = load_model(_copy(ckpt, tmp_path / "fused", fused, {"num_nextn_predict_layers": 1}))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_tied_embeddings(ckpt, tmp_path):
    raw = load_file(str(ckpt / "model.safetensors"))
    del raw["lm_head.weight"]
    _, m = load_model(_copy(ckpt, tmp_path / "tied", raw, {"tie_word_embeddings": True}))
    assert torch.equal(m.lm_head.weight, raw["model.embed_tokens.weight"])


def test_missing_and_misshapen_tensors_are_named(ckpt, tmp_path):
    raw = load_file(str(ckpt / "model.safetensors"))
    missing = {k: v for k, v in raw.items() if k != "model.layers.2.self_attn.indexer.wk.weight"}
    with pytest.raises(ConfigError, match=r"1 missing tensors \['model.layers.2.self_attn.indexer.wk.weight'\]"):
        load_model(_copy(ckpt, tmp_path / "missing", missing))
    bad = dict(raw)
    bad["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ConfigError, match=r"model.norm.weight has shape \(3,\) but the config implies \(64,\)"):
        load_model(_copy(ckpt, tmp_path / "bad", bad))
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(tmp_path / "nowhere")


def test_fp8_block_dequant():
    w = torch.tensor([[1.0, 2.0, 0.5], [-1.0, 1.5, 0.0]]).to(torch.float8_e4m3fn)
    w = torch.cat([w, w]).repeat_interleave(80, 0)[:130]  # 130 rows -> two row blocks
    scale = torch.tensor([[2.0], [0.25]])
    out = _dequant_fp8(w, scale)
    assert out.shape == (130, 3)
    assert torch.equal(out[:128], w[:128].float() * 2.0) and torch.equal(out[128:], w[128:].float() * 0.25)


def test_make_tiny_is_deterministic(tmp_path, capsys):
    assert cli_main(["make-tiny", str(tmp_path / "a"), "--seed", "7", "--layers", "2"]) == 0
    assert "2 layers, producers [0, 1]" in capsys.readouterr().out
    make_tiny(tmp_path / "b", seed=7, layers=2)
    make_tiny(tmp_path / "c", seed=8, layers=2)
    a, b, c = (load_file(str(tmp_path / n / "model.safetensors")) for n in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    cfg = load_config(tmp_path / "a")
    assert cfg["model_type"] == "glm_moe_dsa" and cfg["indexer_types"] == ["full", "full"]
