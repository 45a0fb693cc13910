"""Tiny DeepSeek-V4 checkpoints, written by transformers' own DeepseekV4ForCausalLM (real HF format).

Two layer patterns: "flash" (2 window-only layers, then CSA / HCA interleaved, as V4-Flash) and "pro" (2 HCA
layers, then CSA / HCA interleaved, as V4-Pro). The tiny model keeps the CSA ratio 4 and uses an HCA ratio of 16
and a window of 8, so short prompts cover several windows and compression groups; the first two MLP layers are
hash-MoE. Weights are seeded as model/tiny.py draws them; position biases, sinks and HC bases get noise too, and
tid2eid distinct experts per token. Imports torch and transformers (lazily).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsakv.errors import ConfigError

if TYPE_CHECKING:
    from transformers import PreTrainedModel

V4_PATTERNS = ("flash", "pro")
CSA_T, HCA_T, WIN_T = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"


def tiny_v4_config(pattern: str = "flash", layers: int = 6, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    if pattern not in V4_PATTERNS:
        raise ConfigError(f"unknown V4 layer pattern {pattern!r}: use one of {', '.join(V4_PATTERNS)}")
    if layers < 3:
        raise ConfigError(f"--layers {layers}: a tiny V4 model needs at least 3 layers (2 bootstrap + CSA)")
    head = [WIN_T, WIN_T] if pattern == "flash" else [HCA_T, HCA_T]
    types = head + [CSA_T if i % 2 == 0 else HCA_T for i in range(layers - 2)]
    cfg: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "_name_or_path": f"tiny-deepseek_v4-{pattern}",
        "vocab_size": 512,
        "hidden_size": 64,
        "moe_intermediate_size": 32,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "partial_rotary_factor": 0.25,
        "q_lora_rank": 32,
        "num_experts_per_tok": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "scoring_func": "sqrtsoftplus",
        "routed_scaling_factor": 1.5,
        "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        "compress_rates": {CSA_T: 4, HCA_T: 16},
        "layer_types": types,
        "mlp_layer_types": ["hash_moe", "hash_moe"] + ["moe"] * (layers - 2),
        "hc_mult": 2,
        "hc_sinkhorn_iters": 20,
        "sliding_window": 8,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 4,
        "index_head_dim": 16,
        "index_topk": 4,
        "num_nextn_predict_layers": 0,
        "swiglu_limit": 10.0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
    }
    cfg.update(overrides or {})
    return cfg


def _init_v4_(model: torch.nn.Module, seed: int, n_exp: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted(list(model.named_parameters()) + list(model.named_buffers())):
            if name.endswith("tid2eid"):
                rows = [torch.randperm(n_exp, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])]
                t.copy_(torch.stack(rows))
                continue
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32)
            if name.endswith(("e_score_correction_bias", "position_bias", "sinks", ".base", "hc_base")):
                t.copy_(0.5 * noise)
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(1.0 + 0.1 * noise)
            elif "norm" in name:
                t.copy_(1.0 + 0.1 * noise)
            elif name.endswith("embed_tokens.weight"):
                t.copy_(noise)
            else:
                gain = 4.0 if name == "lm_head.weight" else 1.0
                t.copy_(noise * (gain / t.shape[-1] ** 0.5))


def build_tiny_v4_hf(
    pattern: str = "flash", seed: int = 0, layers: int = 6, overrides: dict[str, Any] | None = None
) -> PreTrainedModel:
    """transformers' DeepseekV4ForCausalLM of a tiny checkpoint, initialised (float32, eval)."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    cfg = tiny_v4_config(pattern, layers, overrides)
    kwargs = {k: v for k, v in cfg.items() if k not in ("architectures", "_name_or_path", "model_type", "torch_dtype")}
    config = DeepseekV4Config(**kwargs)
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM(config)
    _init_v4_(model, seed, int(config.n_routed_experts))
    return model.float().eval()


def make_tiny_v4(
    path: str | Path, pattern: str = "flash", seed: int = 0, layers: int = 6, overrides: dict[str, Any] | None = None
) -> Path:
    """Write config.json + model.safetensors + the byte-level tokenizer to `path`; returns it."""
    from dsakv.model.tiny import write_tiny_tokenizer

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_v4_hf(pattern, seed, layers, overrides)
    model.save_pretrained(str(out))
    write_tiny_tokenizer(out, int(model.config.vocab_size), int(model.config.max_position_embeddings))
    return out
