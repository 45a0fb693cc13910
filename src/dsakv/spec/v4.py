"""V4Spec: the cache-shaping facts of a DeepSeek-V4 model, read from a HF config.json (or a preset).

Every V4 layer keeps a sliding window of K=V entries; a compressed-sparse (CSA, ratio 4) layer adds one
compressed entry per 4 tokens and a lightning indexer over its own compressed keys; a heavily-compressed (HCA,
ratio 128) layer adds one compressed entry per 128 tokens and has no indexer. A layer's ratio comes from
`compress_ratios` (0 / 4 / 128 per layer, the checkpoints' field; one more entry per MTP layer allowed) or
`layer_types` + `compress_rates` (transformers' names). MTP layers (`num_nextn_predict_layers`) are
window-only. Must not import torch or any higher dsakv layer.
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsakv.errors import ConfigError

V4_MODEL_TYPE = "deepseek_v4"
WINDOW = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (WINDOW, CSA, HCA)
DEFAULT_RATES = {CSA: 4, HCA: 128}


def _int(cfg: dict[str, Any], name: str, default: int | None = None, *, minimum: int = 1) -> int:
    value = cfg.get(name, default)
    if value is None:
        raise ConfigError(
            f"DeepSeek-V4 config.json is missing required field '{name}': add it (an integer >= {minimum})"
        )
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config field '{name}' = {value!r} must be an integer >= {minimum}")
    return value


def _rates(cfg: dict[str, Any]) -> dict[str, int]:
    rates = dict(DEFAULT_RATES)
    given = cfg.get("compress_rates")
    if given is not None:
        if not isinstance(given, dict) or set(given) - {CSA, HCA}:
            raise ConfigError(f"config field 'compress_rates' = {given!r} must map {CSA!r} / {HCA!r} to an integer")
        rates.update(given)
    for legacy, name in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if cfg.get(legacy) is not None:
            rates[name] = cfg[legacy]
    for name, r in rates.items():
        if isinstance(r, bool) or not isinstance(r, int) or r < 2:
            raise ConfigError(f"compress rate of {name} = {r!r} must be an integer >= 2")
    if rates[HCA] % rates[CSA]:
        raise ConfigError(
            f"compress rates {rates[CSA]} (CSA) and {rates[HCA]} (HCA): the HCA rate must be a multiple of the CSA "
            "rate, so one page size holds whole entries of both"
        )
    return rates


def derive_layer_types(cfg: dict[str, Any], num_layers: int, num_draft: int) -> tuple[tuple[str, ...], str]:
    """Per main layer 'sliding_attention' / 'compressed_sparse_attention' / 'heavily_compressed_attention'."""
    rates = _rates(cfg)
    by_ratio = {0: WINDOW, rates[CSA]: CSA, rates[HCA]: HCA}
    if cfg.get("layer_types") is not None:
        raw = cfg["layer_types"]
        if not isinstance(raw, (list, tuple)) or len(raw) not in (num_layers, num_layers + num_draft):
            raise ConfigError(
                f"config field 'layer_types' must list one of {', '.join(LAYER_TYPES)} per layer "
                f"({num_layers} layers), got {raw!r}"
            )
        for i, t in enumerate(raw):
            if t not in LAYER_TYPES:
                raise ConfigError(f"config field 'layer_types'[{i}] = {t!r}: use one of {', '.join(LAYER_TYPES)}")
        return tuple(raw[:num_layers]), "layer_types"
    if cfg.get("compress_ratios") is not None:
        raw = cfg["compress_ratios"]
        if not isinstance(raw, (list, tuple)) or len(raw) not in (num_layers, num_layers + num_draft):
            n = len(raw) if isinstance(raw, (list, tuple)) else raw
            raise ConfigError(
                f"config field 'compress_ratios' has {n} entries: give one ratio (0, {rates[CSA]} or {rates[HCA]}) "
                f"per layer ({num_layers} main layers, optionally + {num_draft} MTP)"
            )
        out = []
        for i, r in enumerate(raw):
            if r not in by_ratio or isinstance(r, bool):
                raise ConfigError(
                    f"config field 'compress_ratios'[{i}] = {r!r}: use 0 (window only), {rates[CSA]} (compressed "
                    f"sparse) or {rates[HCA]} (heavily compressed)"
                )
            out.append(by_ratio[r])
        for j, r in enumerate(raw[num_layers:]):
            if r != 0:
                raise ConfigError(
                    f"config field 'compress_ratios'[{num_layers + j}] = {r} is an MTP layer's ratio: MTP layers "
                    "are window-only (0)"
                )
        return tuple(out[:num_layers]), "compress_ratios"
    # transformers' default: 2 HCA then CSA/HCA interleaved
    types = [HCA] * min(num_layers, 2) + [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    return tuple(types), "no layer_types / compress_ratios: transformers' default schedule"


@dataclass(frozen=True)
class V4Spec:
    """What dsakv needs of a DeepSeek-V4 model. Layers num_layers.. are MTP (window-only) layers."""

    name: str
    num_layers: int
    num_draft_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    csa_ratio: int
    hca_ratio: int
    layer_types: tuple[str, ...]
    layer_types_source: str
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    model_type: str = V4_MODEL_TYPE

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str | None = None) -> V4Spec:
        if not isinstance(cfg, dict):
            raise ConfigError(f"config must be a JSON object, got {type(cfg).__name__}")
        if cfg.get("model_type") != V4_MODEL_TYPE:
            raise ConfigError(f"model_type {cfg.get('model_type')!r} is not {V4_MODEL_TYPE!r}")
        n = _int(cfg, "num_hidden_layers")
        nd = _int(cfg, "num_nextn_predict_layers", 1, minimum=0)
        head_dim = _int(cfg, "head_dim", 512)
        rope = cfg.get("qk_rope_head_dim")
        if rope is None:
            prf = cfg.get("partial_rotary_factor")
            rope = int(head_dim * prf) if isinstance(prf, (int, float)) and prf else 64
        if isinstance(rope, bool) or not isinstance(rope, int) or not 0 < rope <= head_dim or rope % 2:
            raise ConfigError(f"qk_rope_head_dim = {rope!r} must be an even integer in 2..head_dim ({head_dim})")
        types, source = derive_layer_types(cfg, n, nd)
        rates = _rates(cfg)
        return cls(
            name=name or str(cfg.get("_name_or_path") or V4_MODEL_TYPE),
            num_layers=n,
            num_draft_layers=nd,
            hidden_size=_int(cfg, "hidden_size"),
            vocab_size=_int(cfg, "vocab_size"),
            num_attention_heads=_int(cfg, "num_attention_heads"),
            head_dim=head_dim,
            qk_rope_head_dim=rope,
            q_lora_rank=_int(cfg, "q_lora_rank", 1024),
            index_n_heads=_int(cfg, "index_n_heads", 64),
            index_head_dim=_int(cfg, "index_head_dim", 128),
            index_topk=_int(cfg, "index_topk", 512),
            sliding_window=_int(cfg, "sliding_window", 128),
            csa_ratio=rates[CSA],
            hca_ratio=rates[HCA],
            layer_types=types,
            layer_types_source=source,
            raw=dict(cfg),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> V4Spec:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            cfg = json.loads(p.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"cannot read a config.json at {str(p)!r}: {e}") from None
        return cls.from_dict(cfg, name=p.parent.name if p.name == "config.json" else p.stem)

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_draft_layers

    def layer_type(self, layer: int) -> str:
        """A main layer's type; MTP layers are window-only."""
        if not 0 <= layer < self.total_layers:
            raise ConfigError(
                f"layer {layer} is out of range for {self.name}: it has layers 0..{self.total_layers - 1} "
                f"({self.num_layers} main + {self.num_draft_layers} MTP)"
            )
        return self.layer_types[layer] if layer < self.num_layers else WINDOW

    def ratio(self, layer: int) -> int:
        """Compression ratio of `layer` (0 = window only)."""
        t = self.layer_type(layer)
        return {WINDOW: 0, CSA: self.csa_ratio, HCA: self.hca_ratio}[t]

    def layers_of(self, layer_type: str, start: int = 0, end: int | None = None) -> tuple[int, ...]:
        stop = self.num_layers if end is None else end
        return tuple(i for i in range(start, stop) if self.layer_types[i] == layer_type)

    @property
    def page_multiple(self) -> int:
        """Page sizes must be a multiple of this: a page then holds whole compressed entries of every ratio."""
        return self.hca_ratio if HCA in self.layer_types else self.csa_ratio

    def identity_hash(self) -> str:
        ident = {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_draft_layers": self.num_draft_layers,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_topk": self.index_topk,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "sliding_window": self.sliding_window,
            "ratios": [self.csa_ratio, self.hca_ratio],
            "layer_types": list(self.layer_types),
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def _flash_ratios() -> list[int]:
    return [0, 0] + [4, 128] * 20 + [4] + [0]  # 2 window + 21 CSA + 20 HCA, then the MTP layer


def _pro_ratios() -> list[int]:
    return [128, 128] + [4, 128] * 29 + [4] + [0]  # 30 CSA + 31 HCA, then the MTP layer


_V4_BASE: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": V4_MODEL_TYPE,
    "vocab_size": 129280,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "sliding_window": 128,
    "compress_rope_theta": 160000,
    "rope_theta": 10000,
    "hc_mult": 4,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "n_shared_experts": 1,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}

# The public configs' cache-shaping fields (deepseek-ai/DeepSeek-V4-Flash and -Pro on the HF hub).
V4_PRESETS: dict[str, dict[str, Any]] = {
    "deepseek-v4-flash": {
        **_V4_BASE,
        "_name_or_path": "deepseek-v4-flash",
        "hidden_size": 4096,
        "num_hidden_layers": 43,
        "num_attention_heads": 64,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "num_experts_per_tok": 6,
        "compress_ratios": _flash_ratios(),
    },
    "deepseek-v4-pro": {
        **_V4_BASE,
        "_name_or_path": "deepseek-v4-pro",
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "q_lora_rank": 1536,
        "o_groups": 16,
        "o_lora_rank": 1024,
        "moe_intermediate_size": 3072,
        "n_routed_experts": 384,
        "num_experts_per_tok": 6,
        "compress_ratios": _pro_ratios(),
    },
}


def is_v4(model: str) -> bool:
    """Does `model` (a preset name, config.json or model directory) name a DeepSeek-V4 model?"""
    if model in V4_PRESETS:
        return True
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        return False
    try:
        cfg = json.loads(p.read_text())
    except (OSError, ValueError, RecursionError):  # not JSON / UTF-8, nested too deeply: the caller's check says so
        return False
    return isinstance(cfg, dict) and cfg.get("model_type") == V4_MODEL_TYPE


def load_v4_spec(model: str) -> V4Spec:
    if model in V4_PRESETS:
        return V4Spec.from_dict(copy.deepcopy(V4_PRESETS[model]), name=model)
    if not Path(model).exists():
        raise ConfigError(f"no DeepSeek-V4 preset or config at {model!r}: use one of {', '.join(V4_PRESETS)}")
    return V4Spec.from_path(model)
