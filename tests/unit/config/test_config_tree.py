"""The configuration layer (dsakv.config) on its own: the cache branch's fields are declared once (the cache
layer's HiCacheConfig is that branch plus what the built cache knows) and checked once, when the cache is built."""

from __future__ import annotations

from dataclasses import fields

import pytest

from dsakv.cache.hicache import HiCacheConfig
from dsakv.config import CacheConfig, StorageConfig
from dsakv.errors import ConfigError


def test_hicache_config_is_the_cache_branch_plus_the_built_cache():
    shared = [f.name for f in fields(CacheConfig)]
    own = [f.name for f in fields(HiCacheConfig)]
    assert own[: len(shared)] == shared and own[len(shared) :] == ["model_hash", "pin_memory"]
    assert issubclass(HiCacheConfig, CacheConfig)
    c = CacheConfig(hicache_ratio=2.0, layout="page_first", write_policy="write_back", selective_threshold=3)
    h = HiCacheConfig.of(c, model_hash="abc")
    assert {n: getattr(h, n) for n in shared} == {n: getattr(c, n) for n in shared}
    assert (h.model_hash, h.pin_memory, h.host_tier) == ("abc", True, True)
    assert HiCacheConfig.of(CacheConfig(disk_dir="")).disk_dir is None  # no directory: no disk tier


def test_the_cache_branch_is_checked_when_the_cache_is_built():
    """CacheConfig takes what the command line gave (a prefill refuses a disk tier with its own words);
    HiCacheConfig.of refuses what no cache can run, with the cache layer's messages."""
    for bad, why in (
        (CacheConfig(hicache_ratio=1.0, hicache_size=1 << 20), "not both"),
        (CacheConfig(hicache_ratio=0.0), r"hicache_ratio = 0.0 must be > 0"),
        (CacheConfig(write_policy="lazy"), "write policy 'lazy'"),
        (CacheConfig(disk_size=5), "given without disk_dir"),
        (CacheConfig(selective_threshold=0), "selective_threshold = 0 must be >= 1"),
    ):
        with pytest.raises(ConfigError, match=why):
            HiCacheConfig.of(bad)


def test_storage_config_is_the_l3_tier_of_the_branch():
    assert CacheConfig().storage_config is None
    assert CacheConfig(disk_dir="/tmp/d", disk_size=7).storage_config == StorageConfig(
        backend="file", dir="/tmp/d", max_bytes=7
    )
    mc = StorageConfig(backend="mooncake", master="127.0.0.1:50051")
    assert CacheConfig(storage=mc).storage_config is mc
    assert HiCacheConfig.of(CacheConfig(storage=mc)).storage_config is mc
