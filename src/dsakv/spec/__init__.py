"""Model spec, layer ownership and KV layouts. No torch, no higher layers."""

from dsakv.spec.layout import (
    DEFAULT_PAGE_SIZE,
    INDEX_FORMATS,
    KV_FORMATS,
    BufferKey,
    BufferSpec,
    Kind,
    KVLayout,
    index_bytes_per_token,
    kv_bytes_per_token,
)
from dsakv.spec.model import ModelSpec, derive_indexer_types
from dsakv.spec.presets import PRESETS, load_spec, preset_config

__all__ = [
    "DEFAULT_PAGE_SIZE",
    "INDEX_FORMATS",
    "KV_FORMATS",
    "PRESETS",
    "BufferKey",
    "BufferSpec",
    "KVLayout",
    "Kind",
    "ModelSpec",
    "derive_indexer_types",
    "index_bytes_per_token",
    "kv_bytes_per_token",
    "load_spec",
    "preset_config",
]
