"""Built-in model configs (HF config.json contents) for the planner and tests.

The large presets mirror the public configs' cache-shaping fields; `tiny` is a
GLM-5.2-shaped model small enough to run on a CPU in tests. No torch here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from dsakv.errors import ConfigError
from dsakv.spec.model import ModelSpec

_GLM5_BASE: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "vocab_size": 154880,
    "hidden_size": 6144,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 2048,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "first_k_dense_replace": 3,
    "index_topk": 2048,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "num_nextn_predict_layers": 1,
    "max_position_embeddings": 202752,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

PRESETS: dict[str, dict[str, Any]] = {
    "glm-5.2": {**_GLM5_BASE, "_name_or_path": "glm-5.2", "index_topk_freq": 4, "index_skip_topk_offset": 3},
    "glm-5.1": {**_GLM5_BASE, "_name_or_path": "glm-5.1"},
    "deepseek-v3.2": {
        "architectures": ["DeepseekV32ForCausalLM"],
        "_name_or_path": "deepseek-v3.2",
        "model_type": "deepseek_v32",
        "vocab_size": 129280,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "moe_intermediate_size": 2048,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "num_key_value_heads": 128,
        "n_shared_experts": 1,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_group": 8,
        "topk_group": 4,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 512,
        "q_lora_rank": 1536,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "first_k_dense_replace": 3,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 64,
        "num_nextn_predict_layers": 1,
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    },
    # 12 layers, index_topk_freq=4 / offset=3 like GLM-5.2: producers 0, 1, 2, 6, 10.
    "tiny": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "_name_or_path": "tiny",
        "model_type": "glm_moe_dsa",
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 12,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "n_shared_experts": 1,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": 64,
        "q_lora_rank": 32,
        "qk_rope_head_dim": 16,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "first_k_dense_replace": 1,
        "index_topk": 16,
        "index_head_dim": 32,
        "index_n_heads": 32,
        "index_topk_freq": 4,
        "index_skip_topk_offset": 3,
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "float32",
    },
}


def preset_config(name: str) -> dict[str, Any]:
    """A deep copy of a preset's config dict."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}: choose one of {', '.join(PRESETS)} or pass a config.json path")
    return copy.deepcopy(PRESETS[name])


def load_spec(model: str) -> ModelSpec:
    """A preset name, a config.json path or a model directory -> ModelSpec."""
    if model in PRESETS:
        return ModelSpec.from_dict(preset_config(model), name=model)
    if not Path(model).exists():
        raise ConfigError(
            f"no config.json at {model!r} and no preset of that name (unknown preset): pass one of "
            f"{', '.join(PRESETS)}, a config.json path or a model directory"
        )
    return ModelSpec.from_path(model)
