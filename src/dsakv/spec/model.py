"""ModelSpec: what dsakv needs to know about a DSA model, read from a HF config.json.

Derives layer ownership (which layers run the lightning indexer and so own an
index-K cache, and which reuse a producer's top-k). Must not import torch or any
higher dsakv layer.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsakv.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("glm_moe_dsa", "deepseek_v32", "deepseek_v3")
FULL = "full"
SHARED = "shared"

# transformers' GlmMoeDsaConfig uses 2 when index_topk_freq is given without an offset.
DEFAULT_SKIP_TOPK_OFFSET = 2


def _require_int(cfg: dict[str, Any], name: str, *, minimum: int = 1) -> int:
    if name not in cfg or cfg[name] is None:
        raise ConfigError(
            f"config.json is missing required field '{name}': add it (an integer >= {minimum}); "
            "every MLA/DSA config (DeepSeek-V3/V3.2, GLM-5.x) carries it"
        )
    value = cfg[name]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"config field '{name}' = {value!r} must be an integer >= {minimum}")
    if value < minimum:
        raise ConfigError(f"config field '{name}' = {value} must be >= {minimum}")
    return value


def _opt_int(cfg: dict[str, Any], name: str, default: int, *, minimum: int = 0) -> int:
    value = cfg.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"config field '{name}' = {value!r} must be an integer >= {minimum}")
    return value


def derive_indexer_types(cfg: dict[str, Any], num_layers: int) -> tuple[tuple[str, ...], str]:
    """Per-layer 'full'/'shared' for the main layers, and which rule decided it.

    Order of precedence: `indexer_types`, then `index_topk_pattern` (F/S string or
    list), then `index_topk_freq` / `index_skip_topk_offset`, else all full.
    """
    if cfg.get("indexer_types") is not None:
        raw = cfg["indexer_types"]
        if not isinstance(raw, (list, tuple)):
            raise ConfigError(f"config field 'indexer_types' must be a list of 'full'/'shared', got {raw!r}")
        if len(raw) != num_layers:
            raise ConfigError(
                f"config field 'indexer_types' has {len(raw)} entries but num_hidden_layers is "
                f"{num_layers}: give exactly one 'full' or 'shared' per layer"
            )
        for i, v in enumerate(raw):
            if v not in (FULL, SHARED):
                raise ConfigError(
                    f"config field 'indexer_types'[{i}] = {v!r} is not a known indexer type: "
                    "use 'full' (runs the indexer) or 'shared' (reuses the previous full layer's top-k)"
                )
        types, source = tuple(raw), "indexer_types"
    elif cfg.get("index_topk_pattern") is not None:
        raw = cfg["index_topk_pattern"]
        items = list(raw) if isinstance(raw, (str, list, tuple)) else None
        if items is None or len(items) != num_layers:
            raise ConfigError(
                f"config field 'index_topk_pattern' = {raw!r} must have one 'F'/'S' per layer ({num_layers} layers)"
            )
        mapping = {"F": FULL, "S": SHARED, FULL: FULL, SHARED: SHARED}
        out = []
        for i, c in enumerate(items):
            if c not in mapping:
                raise ConfigError(f"config field 'index_topk_pattern'[{i}] = {c!r}: use 'F' (full) or 'S' (shared)")
            out.append(mapping[c])
        types, source = tuple(out), "index_topk_pattern"
    elif cfg.get("index_topk_freq") is not None:
        freq = cfg["index_topk_freq"]
        if isinstance(freq, bool) or not isinstance(freq, int) or freq < 1:
            raise ConfigError(
                f"config field 'index_topk_freq' = {freq!r} must be an integer >= 1 "
                "(1 = every layer runs the indexer; 4 = one producer every 4 layers)"
            )
        offset = _opt_int(cfg, "index_skip_topk_offset", DEFAULT_SKIP_TOPK_OFFSET)
        types = tuple(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers))
        source = f"index_topk_freq={freq}, index_skip_topk_offset={offset}"
    else:
        types, source = tuple(FULL for _ in range(num_layers)), "no indexer-sharing fields: all full"
    if types and types[0] == SHARED:
        raise ConfigError(
            f"layer 0 is 'shared' (from {source}) but a shared layer reuses the top-k of an earlier "
            "'full' layer and layer 0 has none: make layer 0 'full'"
        )
    return types, source


@dataclass(frozen=True)
class ModelSpec:
    """A DSA (or plain MLA) model as dsakv sees it.

    Layers 0..num_layers-1 are the main layers; num_layers..num_layers+num_draft_layers-1
    are MTP / next-n draft layers, which always own an index-K.
    """

    name: str
    model_type: str
    num_layers: int
    num_draft_layers: int
    hidden_size: int
    vocab_size: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    has_indexer: bool
    indexer_types: tuple[str, ...]
    ownership_source: str
    intermediate_size: int
    moe_intermediate_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    tie_word_embeddings: bool
    quantization: str
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], name: str | None = None) -> ModelSpec:
        if not isinstance(cfg, dict):
            raise ConfigError(f"a model config must be a JSON object, got {type(cfg).__name__}")
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"config field 'model_type' = {model_type!r} is not supported: dsakv reads "
                f"{', '.join(SUPPORTED_MODEL_TYPES)} configs"
            )
        num_layers = _require_int(cfg, "num_hidden_layers")
        kv_lora_rank = _require_int(cfg, "kv_lora_rank")
        qk_rope = _require_int(cfg, "qk_rope_head_dim")
        has_indexer = model_type != "deepseek_v3" and cfg.get("index_topk") is not None
        if model_type != "deepseek_v3" and not has_indexer:
            raise ConfigError(
                f"config field 'index_topk' is missing for model_type {model_type!r}: DSA models need it "
                "(DeepSeek-V3.2 and GLM-5.x use 2048)"
            )
        if has_indexer:
            index_topk = _require_int(cfg, "index_topk")
            index_n_heads = _require_int(cfg, "index_n_heads")
            index_head_dim = _require_int(cfg, "index_head_dim")
            types, source = derive_indexer_types(cfg, num_layers)
        else:
            index_topk = index_n_heads = index_head_dim = 0
            types, source = tuple(FULL for _ in range(num_layers)), "no indexer (DeepSeek-V3 style): all full"
        q_lora = cfg.get("q_lora_rank")
        quant = cfg.get("quantization_config") or {}
        qmethod = str(quant.get("quant_method", "")) if isinstance(quant, dict) else ""
        return cls(
            name=name or str(cfg.get("_name_or_path") or model_type),
            model_type=model_type,
            num_layers=num_layers,
            num_draft_layers=_opt_int(cfg, "num_nextn_predict_layers", 0),
            hidden_size=_require_int(cfg, "hidden_size"),
            vocab_size=_require_int(cfg, "vocab_size"),
            num_attention_heads=_require_int(cfg, "num_attention_heads"),
            q_lora_rank=int(q_lora) if q_lora else None,
            kv_lora_rank=kv_lora_rank,
            qk_nope_head_dim=_require_int(cfg, "qk_nope_head_dim"),
            qk_rope_head_dim=qk_rope,
            v_head_dim=_require_int(cfg, "v_head_dim"),
            index_n_heads=index_n_heads,
            index_head_dim=index_head_dim,
            index_topk=index_topk,
            has_indexer=has_indexer,
            indexer_types=types,
            ownership_source=source,
            intermediate_size=_opt_int(cfg, "intermediate_size", 0),
            moe_intermediate_size=_opt_int(cfg, "moe_intermediate_size", 0),
            n_routed_experts=_opt_int(cfg, "n_routed_experts", 0),
            n_shared_experts=_opt_int(cfg, "n_shared_experts", 0),
            num_experts_per_tok=_opt_int(cfg, "num_experts_per_tok", 0),
            first_k_dense_replace=_opt_int(cfg, "first_k_dense_replace", 0),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            quantization=qmethod or str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            raw=dict(cfg),
        )

    @classmethod
    def from_path(cls, path: str | Path) -> ModelSpec:
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        if not p.is_file():
            raise ConfigError(f"no config.json at {str(p)!r}: pass a preset name, a config.json or a model directory")
        try:
            cfg = json.loads(p.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{str(p)!r} is not valid JSON: {e}") from None
        except (RecursionError, ValueError) as e:  # nested too deeply; an integer of over 4300 digits
            raise ConfigError(f"{str(p)!r} is not a usable config ({type(e).__name__}): fix it") from None
        return cls.from_dict(cfg, name=p.parent.name if p.name == "config.json" else p.stem)

    # ---- ownership -------------------------------------------------------------

    @property
    def total_layers(self) -> int:
        """Main layers plus draft (MTP) layers."""
        return self.num_layers + self.num_draft_layers

    def is_draft(self, layer: int) -> bool:
        return self.num_layers <= layer < self.total_layers

    def owns_index_k(self, layer: int) -> bool:
        """True if `layer` runs the indexer (a producer). Draft layers always do."""
        self._check_layer(layer)
        if not self.has_indexer:
            return False
        if self.is_draft(layer):
            return True
        return self.indexer_types[layer] == FULL

    def producer_of(self, layer: int) -> int:
        """The layer whose index-K / top-k `layer` uses (itself for a producer)."""
        self._check_layer(layer)
        if not self.has_indexer or self.is_draft(layer):
            return layer
        for i in range(layer, -1, -1):
            if self.indexer_types[i] == FULL:
                return i
        raise AssertionError("layer 0 is validated to be full")  # pragma: no cover

    @property
    def producers(self) -> tuple[int, ...]:
        """Main layers that own an index-K."""
        return tuple(i for i in range(self.num_layers) if self.has_indexer and self.indexer_types[i] == FULL)

    @property
    def shared_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.has_indexer and self.indexer_types[i] == SHARED)

    def _check_layer(self, layer: int) -> None:
        if not 0 <= layer < self.total_layers:
            raise ConfigError(
                f"layer {layer} is out of range for {self.name}: it has layers 0..{self.total_layers - 1} "
                f"({self.num_layers} main + {self.num_draft_layers} draft)"
            )

    # ---- identity ----------------------------------------------------------------

    def identity_hash(self) -> str:
        """A stable hash of everything that shapes the cache; peers must agree on it."""
        ident = {
            "model_type": self.model_type,
            "num_layers": self.num_layers,
            "num_draft_layers": self.num_draft_layers,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "index_head_dim": self.index_head_dim,
            "index_n_heads": self.index_n_heads,
            "index_topk": self.index_topk,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "indexer_types": list(self.indexer_types),
        }
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
