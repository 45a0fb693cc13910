"""Rope as transformers computes it: interleaved (MLA, GLM indexer), half split (V3.2 indexer), yarn end to end."""

from __future__ import annotations

import pytest
import torch

from dsakv.model.loader import load_model
from dsakv.model.rope import Rope, apply_half_split, apply_interleaved, rope_inv_freq
from dsakv.model.tiny import make_tiny
from dsakv.testing.models import greedy, prompts_for

transformers = pytest.importorskip("transformers")
glm = pytest.importorskip("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa")
dsv = pytest.importorskip("transformers.models.deepseek_v32.modeling_deepseek_v32")

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 1024,
    "rope_theta": 10000.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}


def test_rotations_match_transformers():
    torch.manual_seed(0)
    pos = torch.tensor([0, 3, 17, 1000])
    inv, scale = rope_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, 16, {})
    cos, sin = Rope(inv, scale).cos_sin(pos, torch.float32)
    emb = torch.cat([pos[:, None].float() * inv] * 2, dim=-1)
    hc, hs = emb.cos()[None], emb.sin()[None]  # transformers' [B, S, dim]
    q = torch.randn(4, 3, 16)  # [T, heads, dim]
    k = torch.randn(4, 16)
    ref_q, ref_k = glm.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k[None, None], hc, hs)
    assert torch.equal(apply_interleaved(q, cos, sin), ref_q[0].transpose(0, 1))
    assert torch.equal(apply_interleaved(k, cos, sin), ref_k[0, 0])
    ref_q, _ = dsv.apply_rotary_pos_emb(q[None], k[None, :, None], hc, hs, unsqueeze_dim=2)
    assert torch.allclose(apply_half_split(q, cos, sin), ref_q[0], atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", ["glm_moe_dsa", "deepseek_v32"])
def test_yarn_checkpoint_matches_transformers(tmp_path, arch):
    path = make_tiny(tmp_path / arch, arch=arch, layers=4, overrides={"rope_parameters": YARN})
    _, model = load_model(path)
    assert model.cfg.softmax_scale == pytest.approx(32**-0.5 * (0.1 * torch.log(torch.tensor(4.0)).item() + 1) ** 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompt = prompts_for([30], seed=2)[0]
    runs, _ = greedy(model, model.layout_for(kv_format="fp32", index_format="fp32", page_size=8), [prompt], 4)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt + runs[0].generated[:-1]])).logits[0, len(prompt) - 1 :]
    assert runs[0].generated == ref.argmax(-1).tolist()
    assert (torch.stack(runs[0].logits) - ref).abs().max().item() < 1e-4
