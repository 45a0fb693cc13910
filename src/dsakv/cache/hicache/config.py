"""HiCache's options (HiCacheConfig) and the model fingerprint that keys its stored pages."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from dsakv.cache.fingerprint import weights_fingerprint
from dsakv.cache.host_pool import HOST_LAYOUTS
from dsakv.cache.write_policy import WRITE_POLICIES
from dsakv.config import CacheConfig, StorageConfig
from dsakv.errors import ConfigError

log = logging.getLogger("dsakv.cache.hicache")


def model_fingerprint(model: torch.nn.Module, model_dir: str | Path | None = None) -> str:
    """The weights fingerprint that names stored pages (fingerprint.weights_fingerprint: every byte of every
    tensor, cached by checkpoint file identity)."""
    return weights_fingerprint(model, model_dir)


_STORAGE_WHEN = {"write_through": "insert", "write_back": "evict", "write_through_selective": "backup"}


@dataclass(frozen=True)
class HiCacheConfig:
    """Prefix cache options. The default is a device-only prefix cache (no host tier, no disk)."""

    hicache_ratio: float | None = None  # host pool = ratio x device pool bytes
    hicache_size: int | None = None  # or host pool bytes
    layout: str = "layer_first"  # host layout: layer_first | page_first
    write_policy: str = "write_through"  # write_through | write_back | write_through_selective
    selective_threshold: int = 2  # hits before write_through_selective backs a run up
    disk_dir: str | None = None  # third tier on local disk; None = off
    disk_size: int | None = None  # disk tier cap in bytes (page files, headers included); None = unbounded
    model_hash: str | None = None  # weights fingerprint for storage keys (weights change -> new keys)
    storage: StorageConfig | None = None  # the L3 tier (file or mooncake); disk_dir is the `file` shorthand
    pin_memory: bool = True  # pin the host pool when the device is CUDA

    @classmethod
    def of(cls, cache: CacheConfig, model_hash: str | None = None) -> HiCacheConfig:
        """The cache layer's own options from the tree's cache branch (validated here: layout, write policy,
        sizes)."""
        return cls(
            hicache_ratio=cache.hicache_ratio,
            hicache_size=cache.hicache_size,
            layout=cache.layout,
            write_policy=cache.write_policy,
            selective_threshold=cache.selective_threshold,
            disk_dir=str(cache.disk_dir) if cache.disk_dir else None,
            disk_size=cache.disk_size,
            model_hash=model_hash,
            storage=cache.storage,
        )

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

    @property
    def host_enabled(self) -> bool:
        return self.hicache_ratio is not None or self.hicache_size is not None

    @property
    def storage_config(self) -> StorageConfig | None:
        if self.storage is not None:
            return self.storage
        if self.disk_dir is not None:
            return StorageConfig(backend="file", dir=self.disk_dir, max_bytes=self.disk_size)
        return None
