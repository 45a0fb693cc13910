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


def test_every_role_builds_its_timeouts_one_way():
    """Timeouts.of: rpc bounds every control call and its connect (at most 2 s); the rest are the role's flags."""
    from dsakv.config import Config, DecodeConfig, PipelineConfig, PrefillConfig, RouterConfig, Timeouts, TransferConfig

    assert Timeouts.of(5.0) == Timeouts() and Timeouts.of(0.5).connect == 0.5
    tree = Config(transfer=TransferConfig(rpc_timeout=1.5), pipeline=PipelineConfig(stage_timeout=3.0))
    p = PrefillConfig("m", config=tree).timeouts
    assert (p.rpc, p.connect, p.stage) == (1.5, 1.5, 3.0)
    d = DecodeConfig("m", config=tree, kv_grace=0.7, liveness_interval=0.2, max_kv_timeout=90.0).timeouts
    assert (d.rpc, d.connect, d.kv_grace, d.liveness_interval, d.max_kv) == (1.5, 1.5, 0.7, 0.2, 90.0)
    r = RouterConfig(("p:1",), ("d:2",), kv_timeout=9.0, rpc_timeout=3.0, queue_timeout=7.0, connect_retry=4.0)
    r_t = r.timeouts
    assert (r_t.rpc, r_t.connect, r_t.kv, r_t.queue, r_t.connect_retry) == (3.0, 2.0, 9.0, 7.0, 4.0)
    with pytest.raises(ConfigError, match="must be > 0 seconds: rpc=0"):
        Timeouts.of(0.0)


def test_each_backend_gets_its_typed_options():
    """TransferConfig.backend_options(host): what the CLI's role processes hand make_backend (the keywords the
    old per-name table gave); a role config refuses another backend's options."""
    from dsakv.config import (
        BACKEND_OPTIONS,
        LOOPBACK_UCX_ENV,
        TRANSFER_BACKENDS,
        BackendOptions,
        Config,
        DecodeConfig,
        LocalOptions,
        MooncakeOptions,
        NixlOptions,
        PrefillConfig,
        TransferConfig,
    )

    assert set(BACKEND_OPTIONS) == set(TRANSFER_BACKENDS)
    mc = TransferConfig(backend="mooncake").backend_options("10.0.0.2")
    assert mc == MooncakeOptions(hostname="10.0.0.2") and mc.kwargs() == {"hostname": "10.0.0.2"}
    mc = TransferConfig(backend="mooncake", mooncake_timeout=9).backend_options("127.0.0.1")
    assert mc.kwargs() == {"hostname": "127.0.0.1", "engine_timeout_s": 9}
    nx = TransferConfig(backend="nixl")
    assert isinstance(nx.backend_options("127.0.0.1"), NixlOptions)
    assert nx.backend_options("localhost").kwargs() == {"env": LOOPBACK_UCX_ENV}
    assert nx.backend_options("10.0.0.2").kwargs() == {}
    assert TransferConfig(backend="local").backend_options("h") == LocalOptions()
    assert LocalOptions().kwargs() == BackendOptions().kwargs() == {}
    assert PrefillConfig("m").backend_options == BackendOptions()  # none: the backend's defaults
    tree = Config(transfer=nx)
    PrefillConfig("m", config=tree, backend_options=nx.backend_options("127.0.0.1"))
    for role in (PrefillConfig, DecodeConfig):
        with pytest.raises(ConfigError, match="backend options MooncakeOptions are not transfer backend 'nixl'"):
            role("m", config=tree, backend_options=MooncakeOptions())


def test_a_decode_has_one_pipeline_config_the_trees():
    from dsakv.config import Config, DecodeConfig, PipelineConfig

    assert DecodeConfig("m").pipeline is None  # one stage: not pipelined
    pipe = PipelineConfig(pp_size=2, pp_rank=1)
    assert DecodeConfig("m", config=Config(pipeline=pipe)).pipeline is pipe
