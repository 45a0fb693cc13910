"""HiCache's options (HiCacheConfig) and the model fingerprint that keys its stored pages."""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from dsakv.cache.fingerprint import weights_fingerprint
from dsakv.cache.host_pool import HOST_LAYOUTS
from dsakv.cache.write_policy import WRITE_POLICIES
from dsakv.config import CacheConfig
from dsakv.errors import ConfigError

log = logging.getLogger("dsakv.cache.hicache")


def model_fingerprint(model: torch.nn.Module, model_dir: str | Path | None = None) -> str:
    """The weights fingerprint that names stored pages (fingerprint.weights_fingerprint: every byte of every
    tensor, cached by checkpoint file identity)."""
    return weights_fingerprint(model, model_dir)


_STORAGE_WHEN = {"write_through": "insert", "write_back": "evict", "write_through_selective": "backup"}


@dataclass(frozen=True)
class HiCacheConfig(CacheConfig):
    """Prefix cache options: the tree's cache branch (CacheConfig: its fields are declared there, once; checked
    here, once) plus what the built cache knows. The default is a device-only prefix cache (no host tier, no
    disk). `prefix_cache` is not read here (a HiCache is the prefix cache)."""

    model_hash: str | None = None  # weights fingerprint for storage keys (weights change -> new keys)
    pin_memory: bool = True  # pin the host pool when the device is CUDA

    @classmethod
    def of(cls, cache: CacheConfig, model_hash: str | None = None) -> HiCacheConfig:
        """The cache layer's own options from the tree's cache branch (checked here: layout, write policy,
        sizes)."""
        shared = {f.name: getattr(cache, f.name) for f in fields(CacheConfig)}
        shared["disk_dir"] = str(cache.disk_dir) if cache.disk_dir else None
        return cls(**shared, model_hash=model_hash)

    def __post_init__(self) -> None:
        if self.hicache_ratio is not None and self.hicache_size is not None:
            raise ConfigError("give hicache_ratio or hicache_size, not both")
        if self.hicache_ratio is not None and not self.hicache_ratio > 0:
            raise ConfigError(f"hicache_ratio = {self.hicache_ratio} must be > 0 (host pool = ratio x device pool)")
        if self.hicache_size is not None and self.hicache_size <= 0:
            raise ConfigError(f"hicache_size = {self.hicache_size} bytes must be > 0")
        HOST_LAYOUTS.check(self.layout)
        WRITE_POLICIES.check(self.write_policy)
        if self.disk_size is not None and self.disk_dir is None:
            raise ConfigError(f"disk_size = {self.disk_size} B given without disk_dir: give a disk tier directory")
        if self.disk_size is not None and self.disk_size <= 0:
            raise ConfigError(f"disk_size = {self.disk_size} bytes must be > 0 (or None for no cap)")
        if self.storage is not None and self.disk_dir is not None:
            raise ConfigError("give disk_dir (the file tier) or a storage backend, not both")
        if self.selective_threshold < 1:
            raise ConfigError(f"selective_threshold = {self.selective_threshold} must be >= 1")
