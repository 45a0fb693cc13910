"""MTP draft layer: checkpoint layout (make-tiny --mtp), loading, and its numerics against transformers' MtpModel."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dsakv.cache.device_pool import DevicePool
from dsakv.errors import ConfigError
from dsakv.model.batch import ForwardBatch
from dsakv.model.loader import load_config, load_draft, load_model
from dsakv.model.tiny import make_tiny
from dsakv.spec.layout import BufferKey, Kind


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("tiny_mtp"), seed=0, layers=3, mtp=1)


def test_make_tiny_mtp_layout_and_load(ckpt, tmp_path):
    cfg = load_config(ckpt)
    assert cfg["num_nextn_predict_layers"] == 1 and cfg["num_hidden_layers"] == 3
    raw = load_file(str(ckpt / "model.safetensors"))
    mtp = sorted(k.removeprefix("model.layers.3.") for k in raw if k.startswith("model.layers.3."))
    for name in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "self_attn.kv_a_proj_with_mqa.weight",
        "self_attn.indexer.wk.weight",
        "mlp.experts.7.down_proj.weight",
        "mlp.gate.e_score_correction_bias",
        "input_layernorm.weight",
    ):
        assert name in mtp
    assert not any(k.startswith("model.layers.4.") for k in raw)
    assert tuple(raw["model.layers.3.eh_proj.weight"].shape) == (64, 128)
    # the main model is unchanged by the MTP layer (same seed, same tensors)
    plain = make_tiny(tmp_path / "plain", seed=0, layers=3)
    raw_plain = load_file(str(plain / "model.safetensors"))
    assert set(raw_plain) == {k for k in raw if not k.startswith("model.layers.3.")}
    assert all(torch.equal(raw_plain[k], raw[k]) for k in raw_plain)
    spec, _ = load_model(ckpt)
    assert spec.num_layers == 3 and spec.num_draft_layers == 1
    draft = load_draft(ckpt)
    assert draft.layer_ids == (3,)
    lay = draft.layers[0]
    assert torch.equal(lay.eh_proj.weight, raw["model.layers.3.eh_proj.weight"])
    assert torch.equal(lay.block.mlp.experts[7].down_proj.weight, raw["model.layers.3.mlp.experts.7.down_proj.weight"])
    assert lay.block.self_attn.layer == 3 and lay.block.self_attn.indexer is not None  # draft layers always own
    assert lay.block.mlp.__class__.__name__ == "MoE"
    with pytest.raises(ConfigError, match=r"num_nextn_predict_layers = 0.*--mtp 1"):
        load_draft(plain)
    # transformers still loads the checkpoint (the MTP tensors are left out) and computes the same logits
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 9, 33, 4, 100, 7]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()(ids).logits
        b = AutoModelForCausalLM.from_pretrained(str(plain)).eval()(ids).logits
    assert torch.equal(a, b)


def _hf_mtp(ckpt):
    """transformers' own MtpModel over the HF model, with the checkpoint's layer-3 tensors renamed as its
    conversion mapping does (layers.N. -> layers.0.mtp_block.; enorm/hnorm/eh_proj up; shared_head.norm ->
    post_norm)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt)).eval()
    hf.config.num_mtp_layers = 1
    hf.config.mtp_mlp_layer_types = ["sparse"]
    hf.config.mtp_layer_types = ["full_attention"]  # its "indexed_attention" has no MTP mask mapping in 5.24
    mtp = MtpModel(hf, 1).eval()
    raw = load_file(str(ckpt / "model.safetensors"))
    sd = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for k, v in raw.items():
        if not k.startswith("model.layers.3."):
            continue
        rest = k.removeprefix("model.layers.3.")
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            sd[f"layers.0.{rest}"] = v
        elif rest.startswith("shared_head.norm."):
            sd["layers.0.post_norm." + rest.removeprefix("shared_head.norm.")] = v
        elif rest.startswith("mlp.experts."):
            e, proj = rest.removeprefix("mlp.experts.").split(".")[:2]
            experts.setdefault("x", {}).setdefault(int(e), {})[proj] = v
        else:
            sd[f"layers.0.mtp_block.{rest}"] = v
    per = experts["x"]
    sd["layers.0.mtp_block.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([per[e]["gate_proj"], per[e]["up_proj"]]) for e in sorted(per)]
    )
    sd["layers.0.mtp_block.mlp.experts.down_proj"] = torch.stack([per[e]["down_proj"] for e in sorted(per)])
    missing, unexpected = mtp.load_state_dict(sd, strict=False)
    assert not unexpected and all(m.startswith(("embed_tokens", "shared_head")) for m in missing), (missing, unexpected)
    return hf, mtp


def test_draft_layer_matches_transformers_mtp(ckpt):
    hf, hf_mtp = _hf_mtp(ckpt)
    spec, model = load_model(ckpt)
    draft = load_draft(ckpt)
    tokens = [5, 9, 33, 4, 100, 7, 250, 3, 41, 18, 77, 2, 300, 12, 64, 90, 5, 31, 200, 8]  # > index_topk 16
    n = len(tokens)
    with torch.no_grad():
        out = hf(torch.tensor([tokens]), output_hidden_states=True)
        h = out.hidden_states[-1]
        # MtpLayer.forward step by step: in 5.24 it hands the GLM decoder layer's (hidden, top-k) tuple to its
        # post_norm, and forward_layer lets create_causal_mask skip the mask the DSA indexer needs
        lay = hf_mtp.layers[0]
        emb = hf_mtp.embed_tokens(torch.tensor([tokens[1:]]))
        pos = torch.arange(1, n)[None]
        mask = torch.ones(n - 1, n - 1, dtype=torch.bool).tril()[None, None]
        x = lay.eh_proj(torch.cat([lay.enorm(emb), lay.hnorm(h[:, : n - 1])], dim=-1))
        x, _ = lay.mtp_block(
            x,
            attention_mask=mask,
            position_embeddings=hf_mtp.rotary_emb(emb, position_ids=pos),
            position_ids=pos,
            cache=None,
        )
        ref = hf_mtp._project_to_logits(lay.post_norm(x))[0]
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=4)
    from dataclasses import replace

    layout = replace(layout, draft_layers=1)
    pool = DevicePool(layout, 8)
    slots = torch.arange(8, 8 + n)
    batch = ForwardBatch(
        torch.tensor(tokens), torch.arange(n), torch.tensor([0]), torch.tensor([n]), slots[None], slots
    )
    carry = model.stage_forward(batch, pool)
    hidden = model.model.norm(carry.hidden)
    assert torch.allclose(hidden, h[0], atol=1e-5)
    # draft batch: entries 0..n-2 = (hidden i, token i+1) at rope position i+1, in the target's slots
    m = n - 1
    dbatch = ForwardBatch(
        torch.tensor(tokens[1:]), torch.arange(1, n), torch.tensor([0]), torch.tensor([m]), slots[None, :m], slots[:m]
    )
    dh = draft.step(model, dbatch, hidden[:m], pool)
    logits = draft.logits(model, dh)
    assert torch.allclose(logits, ref, atol=1e-4), (logits - ref).abs().max()
    assert torch.equal(logits.argmax(-1), ref.argmax(-1))
    # the draft's KV and INDEX_K rows were written under its own keys, at the target's slots
    kv = pool.tensor(BufferKey(3, Kind.KV))
    assert kv.view(-1, kv.shape[1] // 4, 4).shape[0] == 8 and pool.layout.owns_index_k(3)
    assert BufferKey(3, Kind.INDEX_K) in pool.layout.keys
