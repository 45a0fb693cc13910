"""KVLayout: the buffers one role (or one PP stage) holds, named by BufferKey.

Every buffer is a (layer, kind) key. A layer that does not own an index-K has no
INDEX_K key at all: there are no zero-sized entries. The planner, the device and
host pools and the transfer manifest all take the same KVLayout object.
Must not import torch or any higher dsakv layer.

Page of an fp8-132 index-K buffer (P tokens):

    | k fp8 tok0 (128 B) | k fp8 tok1 | ... | k fp8 tok P-1 | scale tok0 (4 B) | ... | scale tok P-1 |

Page of an fp8-656 MLA KV buffer, one row per token:

    | latent fp8 (kv_lora_rank B) | fp32 scale per 128 latent values | rope bf16 (2 x rope_dim B) |
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import cached_property

from dsakv.errors import ConfigError
from dsakv.spec.model import ModelSpec
from dsakv.util import Registry, ceil_div

DEFAULT_PAGE_SIZE = 64
QUANT_GROUP = 128


class Kind(enum.StrEnum):
    KV = "kv"
    INDEX_K = "index_k"
    # DeepSeek-V4 (spec/v4_layout.py): token-indexed kinds (paged) ...
    CSA_KV = "csa_kv"  # one compressed K=V entry per csa_ratio (4) tokens, CSA layers
    CSA_INDEX_K = "csa_index_k"  # the indexer's compressed key per csa_ratio tokens, CSA layers
    HCA_KV = "hca_kv"  # one compressed K=V entry per hca_ratio (128) tokens, HCA layers
    # ... and per-request state (one slot per running request)
    WINDOW = "window"  # the sliding-window ring of K=V entries, every layer
    CSA_STATE = "csa_state"  # the CSA compressor's last 2 x ratio projected tokens (kv + gate, fp32)
    CSA_INDEX_STATE = "csa_index_state"  # the same for the indexer's compressor
    HCA_STATE = "hca_state"  # the HCA compressor's running window (online softmax, or a ratio-slot ring)


# the kinds of the MLA models (DeepSeek-V3.2, GLM-5.x); the others are DeepSeek-V4's
MLA_KINDS = (Kind.KV, Kind.INDEX_K)


@dataclass(frozen=True, order=True)
class BufferKey:
    """Names one per-layer cache buffer. Hashable, ordered by (layer, kind)."""

    layer: int
    kind: Kind

    def __str__(self) -> str:
        return f"L{self.layer}/{self.kind.value}"

    @classmethod
    def parse(cls, text: str) -> BufferKey:
        try:
            layer, kind = text.split("/")
            return cls(int(layer.lstrip("L")), Kind(kind))
        except (ValueError, KeyError):
            raise ConfigError(f"buffer key {text!r} is malformed: expected e.g. 'L6/index_k' or 'L0/kv'") from None


def _groups(dim: int) -> int:
    return ceil_div(dim, QUANT_GROUP)


# Row formats by name -> bytes per token. KV: f(kv_lora_rank, rope_dim); index-K: f(index_head_dim).
KV_FORMAT_BYTES: Registry[Callable[[int, int], int]] = Registry(
    "KV format", flag="--kv-format", unknown="unknown KV format {name!r}: use one of {choices}"
)
INDEX_FORMAT_BYTES: Registry[Callable[[int], int]] = Registry(
    "index-K format", flag="--index-format", unknown="unknown index-K format {name!r}: use one of {choices}"
)
# 512 fp8 + 4 fp32 scales + 64 bf16 rope = 656 for DeepSeek/GLM
KV_FORMAT_BYTES.add("fp8-656", lambda rank, rope: rank + 4 * _groups(rank) + 2 * rope)
KV_FORMAT_BYTES.add("fp8-576", lambda rank, rope: rank + rope)  # plain fp8 latent + fp8 rope
KV_FORMAT_BYTES.add("bf16", lambda rank, rope: 2 * (rank + rope))
KV_FORMAT_BYTES.add("fp32", lambda rank, rope: 4 * (rank + rope))


def _fp4_index_bytes(d: int) -> int:
    if d % 2:
        raise ConfigError(f"index format 'fp4-68' needs an even index_head_dim, got {d}")
    return d // 2 + 4 * _groups(d)  # 128 fp4 (64 B) + one fp32 scale per 128 values


INDEX_FORMAT_BYTES.add("fp8-132", lambda d: d + 4 * _groups(d))  # 128 fp8 + one fp32 scale per 128 values
INDEX_FORMAT_BYTES.add("fp4-68", _fp4_index_bytes)
INDEX_FORMAT_BYTES.add("bf16", lambda d: 2 * d)
INDEX_FORMAT_BYTES.add("fp32", lambda d: 4 * d)

KV_FORMATS = KV_FORMAT_BYTES.names()  # ("fp8-656", "fp8-576", "bf16", "fp32")
INDEX_FORMATS = INDEX_FORMAT_BYTES.names()  # ("fp8-132", "fp4-68", "bf16", "fp32")


def kv_bytes_per_token(fmt: str, kv_lora_rank: int, rope_dim: int) -> int:
    """Bytes per token of one layer's MLA latent cache in format `fmt`."""
    return KV_FORMAT_BYTES.get(fmt)(kv_lora_rank, rope_dim)


def index_bytes_per_token(fmt: str, index_head_dim: int) -> int:
    """Bytes per token of one layer's index-K cache in format `fmt`."""
    return INDEX_FORMAT_BYTES.get(fmt)(index_head_dim)


@dataclass(frozen=True)
class BufferSpec:
    """One buffer of a layout: `page_bytes` = bytes_per_token x page_size."""

    key: BufferKey
    bytes_per_token: int
    page_bytes: int

    def __post_init__(self) -> None:
        if self.bytes_per_token <= 0 or self.page_bytes <= 0:
            raise ConfigError(f"buffer {self.key} has size 0: a layout never holds zero-sized buffers")


@dataclass(frozen=True)
class KVLayout:
    """The buffers a role holds for main layers [layer_start, layer_end) plus draft layers.

    `elide=True` gives INDEX_K keys only to producer layers (and draft layers);
    `elide=False` gives every layer an INDEX_K, as engines without elision do.
    """

    spec: ModelSpec = field(repr=False)
    layer_start: int = 0
    layer_end: int | None = None
    draft_layers: int = 0
    elide: bool = True
    kv_format: str = "fp8-656"
    index_format: str = "fp8-132"
    page_size: int = DEFAULT_PAGE_SIZE

    def __post_init__(self) -> None:
        n = self.spec.num_layers
        if self.layer_end is None:
            object.__setattr__(self, "layer_end", n)
        end = self.end
        if not (0 <= self.layer_start < end <= n):
            raise ConfigError(
                f"layer range {self.layer_start}..{end - 1} is not a non-empty range inside the model's "
                f"layers 0..{n - 1}: fix the PP partition"
            )
        if self.draft_layers < 0:
            raise ConfigError(f"draft layers = {self.draft_layers} must be >= 0")
        if isinstance(self.page_size, bool) or not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError(f"page size = {self.page_size!r} must be a positive integer (tokens per page)")
        kv_bytes_per_token(self.kv_format, self.spec.kv_lora_rank, self.spec.qk_rope_head_dim)
        if self.spec.has_indexer:
            index_bytes_per_token(self.index_format, self.spec.index_head_dim)

    @property
    def end(self) -> int:
        assert self.layer_end is not None
        return self.layer_end

    @property
    def main_layers(self) -> tuple[int, ...]:
        return tuple(range(self.layer_start, self.end))

    @property
    def draft_layer_ids(self) -> tuple[int, ...]:
        n = self.spec.num_layers
        return tuple(range(n, n + self.draft_layers))

    @property
    def layers(self) -> tuple[int, ...]:
        return self.main_layers + self.draft_layer_ids

    def owns_index_k(self, layer: int) -> bool:
        """Does this layout hold an INDEX_K buffer for `layer`?"""
        if not self.spec.has_indexer:
            return False
        if layer >= self.spec.num_layers:
            return True
        return (not self.elide) or self.spec.indexer_types[layer] == "full"

    @property
    def producers(self) -> tuple[int, ...]:
        """Main layers of this range that run the indexer."""
        return tuple(i for i in self.main_layers if self.spec.has_indexer and self.spec.indexer_types[i] == "full")

    @property
    def kv_bytes(self) -> int:
        return kv_bytes_per_token(self.kv_format, self.spec.kv_lora_rank, self.spec.qk_rope_head_dim)

    @property
    def index_bytes(self) -> int:
        return index_bytes_per_token(self.index_format, self.spec.index_head_dim) if self.spec.has_indexer else 0

    @cached_property
    def buffers(self) -> tuple[BufferSpec, ...]:
        out = []
        for layer in self.layers:
            out.append(BufferSpec(BufferKey(layer, Kind.KV), self.kv_bytes, self.kv_bytes * self.page_size))
            if self.owns_index_k(layer):
                out.append(
                    BufferSpec(BufferKey(layer, Kind.INDEX_K), self.index_bytes, self.index_bytes * self.page_size)
                )
        return tuple(out)

    @cached_property
    def by_key(self) -> dict[BufferKey, BufferSpec]:
        return {b.key: b for b in self.buffers}

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return tuple(b.key for b in self.buffers)

    def buffer(self, key: BufferKey) -> BufferSpec:
        try:
            return self.by_key[key]
        except KeyError:
            raise KeyError(self.missing_key_message(key)) from None

    def missing_key_message(self, key: BufferKey) -> str:
        why = ""
        if key.kind is Kind.INDEX_K and key.layer in self.main_layers and not self.owns_index_k(key.layer):
            why = (
                f": layer {key.layer} is a shared layer (it reuses the top-k of producer layer "
                f"{self.spec.producer_of(key.layer)}) and index-K is elided"
            )
        elif key.layer not in self.layers:
            why = f": layer {key.layer} is outside this layout's layers {self.describe_range()}"
        return f"no buffer {key} (layer {key.layer}, kind {key.kind.value}) in this layout{why}"

    @property
    def bytes_per_token(self) -> int:
        return sum(b.bytes_per_token for b in self.buffers)

    @property
    def bytes_per_page(self) -> int:
        return sum(b.page_bytes for b in self.buffers)

    def with_elide(self, elide: bool) -> KVLayout:
        return replace(self, elide=elide)

    def describe_range(self) -> str:
        s = f"{self.layer_start}-{self.end - 1}"
        if self.draft_layers:
            s += f" +{self.draft_layers} draft"
        return s

    def summary(self) -> dict[str, object]:
        return {
            "layers": [self.layer_start, self.end - 1],
            "draft_layers": self.draft_layers,
            "elide": self.elide,
            "kv_format": self.kv_format,
            "index_format": self.index_format,
            "page_size": self.page_size,
            "buffers": len(self.buffers),
            "bytes_per_token": self.bytes_per_token,
        }
