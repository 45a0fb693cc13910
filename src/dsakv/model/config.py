"""DSAConfig: the numerics of a DSA checkpoint that ModelSpec (cache shape only) does not carry.

Read from the same HF config.json dict, with transformers' defaults for
GlmMoeDsaConfig / DeepseekV32Config where a field is absent. Imports only dsakv.spec.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dsakv.errors import ConfigError
from dsakv.spec.model import ModelSpec

RUNNABLE_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32")


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class DSAConfig:
    spec: ModelSpec = field(repr=False)
    rms_norm_eps: float
    rope_parameters: dict[str, Any]
    hidden_act: str
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    mlp_layer_types: tuple[str, ...]
    attention_bias: bool
    index_rope_interleaved: bool  # GLM: interleaved pairs; DeepSeek-V3.2: half split (rotate_half)

    def __post_init__(self) -> None:
        s = self.spec
        if s.model_type not in RUNNABLE_MODEL_TYPES:
            raise ConfigError(
                f"model_type {s.model_type!r} cannot be run by the reference engine: it runs "
                f"{', '.join(RUNNABLE_MODEL_TYPES)} checkpoints"
            )
        if not s.q_lora_rank:
            raise ConfigError("config field 'q_lora_rank' is missing or 0: the DSA indexer reads the q LoRA residual")
        if len(self.mlp_layer_types) != s.num_layers or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ConfigError(
                f"config field 'mlp_layer_types' = {list(self.mlp_layer_types)!r}: give one 'dense' or 'sparse' "
                f"per layer ({s.num_layers} layers)"
            )
        if "sparse" in self.mlp_layer_types and (s.n_routed_experts < 1 or s.num_experts_per_tok < 1):
            raise ConfigError("MoE layers need n_routed_experts >= 1 and num_experts_per_tok >= 1 in config.json")
        if "sparse" in self.mlp_layer_types and s.num_experts_per_tok > s.n_routed_experts:
            raise ConfigError(
                f"config field 'num_experts_per_tok' = {s.num_experts_per_tok} is more than 'n_routed_experts' = "
                f"{s.n_routed_experts}: a token cannot be routed to more experts than exist (lower it)"
            )
        if self.n_group < 1 or not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(
                f"config fields 'n_group' = {self.n_group}, 'topk_group' = {self.topk_group}: need "
                "1 <= topk_group <= n_group"
            )
        if s.n_routed_experts and s.n_routed_experts % self.n_group:
            raise ConfigError(f"n_routed_experts={s.n_routed_experts} is not divisible by n_group={self.n_group}")
        reachable = self.topk_group * (s.n_routed_experts // self.n_group)
        if "sparse" in self.mlp_layer_types and s.num_experts_per_tok > reachable:
            raise ConfigError(
                f"config field 'num_experts_per_tok' = {s.num_experts_per_tok} is more than the {reachable} experts "
                f"in 'topk_group' = {self.topk_group} of 'n_group' = {self.n_group} groups: lower it or raise "
                "topk_group"
            )
        if s.qk_rope_head_dim % 2:
            raise ConfigError(f"qk_rope_head_dim={s.qk_rope_head_dim} must be even (rope rotates pairs)")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            raise ConfigError(f"config field 'rms_norm_eps' = {self.rms_norm_eps} must be a finite number > 0")
        if not math.isfinite(self.routed_scaling_factor):
            raise ConfigError(f"config field 'routed_scaling_factor' = {self.routed_scaling_factor} must be finite")
        if self.hidden_act != "silu":
            raise ConfigError(f"hidden_act={self.hidden_act!r} is not supported: the reference engine runs 'silu'")

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], spec: ModelSpec | None = None) -> DSAConfig:
        spec = spec or ModelSpec.from_dict(cfg)
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        rope = dict(rope)
        rope.setdefault("rope_type", rope.get("type", "default"))
        if "rope_theta" not in rope:
            rope["rope_theta"] = float(cfg.get("rope_theta", 10000.0))
        n = spec.num_layers
        mlp_types = cfg.get("mlp_layer_types")
        if mlp_types is None:
            k = min(spec.first_k_dense_replace if "first_k_dense_replace" in cfg else 3, n)
            mlp_types = ["dense"] * k + ["sparse"] * (n - k)
        return cls(
            spec=spec,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if spec.model_type == "glm_moe_dsa" else 1e-6)),
            rope_parameters=rope,
            hidden_act=str(cfg.get("hidden_act", "silu")),
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 2.5)),
            n_group=int(cfg.get("n_group") or (1 if spec.model_type == "glm_moe_dsa" else 8)),
            topk_group=int(cfg.get("topk_group") or (1 if spec.model_type == "glm_moe_dsa" else 4)),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
            mlp_layer_types=tuple(mlp_types),
            attention_bias=bool(cfg.get("attention_bias", False)),
            index_rope_interleaved=spec.model_type == "glm_moe_dsa",
        )

    @property
    def qk_head_dim(self) -> int:
        return self.spec.qk_nope_head_dim + self.spec.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times mscale^2 under yarn with mscale_all_dim."""
        scale = self.qk_head_dim**-0.5
        rp = self.rope_parameters
        if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
            m = _yarn_mscale(float(rp["factor"]), float(rp["mscale_all_dim"]))
            scale = scale * m * m
        return scale
