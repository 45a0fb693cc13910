"""The configuration tree (dsakv.config) and its command-line spelling (dsakv.cli.options): argv is read
into the tree once, rendered back to the same tree, and the flat Engine keywords map onto the same tree."""

from __future__ import annotations

import pytest

from dsakv.cli import options
from dsakv.cli.disagg_roles import prefill_config
from dsakv.cli.main import build_parser
from dsakv.config import (
    CacheConfig,
    Config,
    EngineConfig,
    LayoutConfig,
    PipelineConfig,
    PoolConfig,
    SchedulerConfig,
    StorageConfig,
    TransferConfig,
)
from dsakv.engine.engine import Engine
from dsakv.errors import ConfigError
from dsakv.spec.presets import load_spec
from dsakv.testing.config import engine_config, flat_options
from dsakv.testing.engines import flat_engine, tiny_model


def _serve(*argv: str) -> Config:
    return options.config_from_args(build_parser().parse_args(["serve", *argv]))


def test_serve_argv_builds_the_tree():
    cfg = _serve(
        *("--no-elide", "--kv-format", "fp8-656", "--page-size", "32", "--kv-budget", "2MiB"),
        *("--max-batch-tokens", "128", "--max-running-requests", "7", "--seed", "3", "--dtype", "bfloat16"),
        *("--hicache-size", "1MiB", "--hicache-write-policy", "write_back", "--transfer-backend", "nixl"),
        *("--rpc-timeout", "2.5", "--pp-size", "2", "--pp-partition", "7,5", "--stage-timeout", "4"),
    )
    assert cfg == Config(
        engine=EngineConfig(
            layout=LayoutConfig(elide=False, kv_format="fp8-656", index_format="fp32", page_size=32),
            pool=PoolConfig(kv_budget=2 << 20),
            scheduler=SchedulerConfig(max_batch_tokens=128, max_running_requests=7),
            cache=CacheConfig(hicache_size=1 << 20, write_policy="write_back"),
            dtype="bfloat16",
            seed=3,
        ),
        transfer=TransferConfig(backend="nixl", rpc_timeout=2.5),
        pipeline=PipelineConfig(pp_size=2, partition=(7, 5), stage_timeout=4.0),
    )
    assert _serve() == Config()  # serve's defaults are the tree's
    assert cfg.engine.cache.enabled and cfg.engine.cache.host_tier and not Config().engine.cache.enabled


def test_engine_argv_reads_back_into_the_same_tree():
    cfg = EngineConfig(
        layout=LayoutConfig(elide=False, kv_format="bf16", index_format="fp8-132", page_size=8),
        pool=PoolConfig(num_pages=40),
        scheduler=SchedulerConfig(max_batch_tokens=64, max_running_requests=3),
        cache=CacheConfig(prefix_cache=True, hicache_ratio=2.0, layout="page_first", selective_threshold=4),
        seed=11,
    )
    argv = options.engine_argv(cfg)
    assert argv[:7] == ["--no-elide", "--kv-format", "bf16", "--index-format", "fp8-132", "--page-size", "8"]
    assert _serve(*argv).engine == cfg
    budget = EngineConfig(pool=PoolConfig(kv_budget=3 << 20), cache=CacheConfig(disk_dir="/tmp/d", disk_size=5))
    assert _serve(*options.engine_argv(budget)).engine == budget
    # the shared tier's secret file (keys its page MACs) travels as a path; --cluster-secret-file is its default
    st = StorageConfig(backend="mooncake", master="127.0.0.1:50051", secret_file="/tmp/deploy.secret")
    l3 = EngineConfig(cache=CacheConfig(hicache_ratio=2.0, storage=st))
    argv = options.engine_argv(l3)
    assert argv[argv.index("--hicache-storage-secret-file") + 1] == "/tmp/deploy.secret"
    assert _serve(*argv).engine == l3
    argv[argv.index("--hicache-storage-secret-file") : argv.index("--hicache-storage-secret-file") + 2] = []
    assert _serve(*argv).engine.cache.storage.secret_file is None  # type: ignore[union-attr]
    assert _serve(*argv, "--cluster-secret-file", "/tmp/c.secret").engine.cache.storage.secret_file == "/tmp/c.secret"  # type: ignore[union-attr]


def test_flat_engine_options_are_the_same_tree():
    """The tests' flat shorthand (dsakv.testing.config) builds the tree the Engine takes; the Engine itself takes
    only the tree (no flat keyword table in the engine or config layers)."""
    flat = dict(elide=False, page_size=4, max_tokens=64, max_batch_tokens=32, hicache_ratio=2.0, seed=5)
    cfg = engine_config(**flat)
    assert cfg.layout == LayoutConfig(elide=False, page_size=4) and cfg.pool == PoolConfig(max_tokens=64)
    assert cfg.cache == CacheConfig(hicache_ratio=2.0) and cfg.scheduler.max_batch_tokens == 32
    assert engine_config(**flat_options(cfg)) == cfg
    a, b = Engine(tiny_model("glm_moe_dsa"), cfg), flat_engine(tiny_model("glm_moe_dsa"), **flat)
    assert a.config == b.config == cfg
    assert (a.pool.num_pages, a.layout.bytes_per_token, a.scheduler.max_batch_tokens) == (16, 5376, 32)
    assert a.prefix_cache is not None and b.prefix_cache is not None
    with pytest.raises(ConfigError, match="unknown engine option.* page_sise"):
        engine_config(page_sise=4)
    with pytest.raises(TypeError, match="unexpected keyword argument 'seed'"):
        Engine(tiny_model("glm_moe_dsa"), cfg, seed=1)  # type: ignore[call-arg]
    assert not hasattr(EngineConfig, "OPTIONS") and not hasattr(EngineConfig, "from_options")
    with pytest.raises(ConfigError, match=r"give kv_budget \(1024 B\) or num_pages"):
        PoolConfig(kv_budget=1024, num_pages=3)


def test_kv_budget_pages_are_the_planners_minimum_over_stages():
    spec = load_spec("tiny")  # 12 layers, producers 0, 1, 2, 6, 10
    lay = LayoutConfig(page_size=16)
    pool = PoolConfig(kv_budget=3 << 20)
    whole = pool.pages([lay.layout(spec)])
    stages = [lay.layout(spec, 0, 7), lay.layout(spec, 7, 12)]
    # elided tiny: 12 x 320 KV + 5 x 128 index-K = 4480 B/token; stage 0 (layers 0-6, producers 0, 1, 2, 6)
    # holds 7 x 320 + 4 x 128 = 2752 B/token, stage 1 (7-11, producer 10) 5 x 320 + 128 = 1728
    assert whole == (3 << 20) // (4480 * 16) == 43
    assert pool.pages_given(stages) == (3 << 20) // (2752 * 16) == 71
    assert PoolConfig(max_tokens=33).pages([lay.layout(spec)]) == 3
    assert PoolConfig().pages([lay.layout(spec)]) == 16384 // 16
    assert PoolConfig().pages_given(stages) is None


def test_prefill_stage_config_from_the_tree():
    args = build_parser().parse_args(
        ["serve", "--role", "prefill", "--model", "x", "--port", "9200", "--pp-size", "2", "--pp-partition", "7,5"]
        + ["--pp-rank", "1", "--kv-budget", "3MiB", "--page-size", "16", "--prefix-cache", "--hicache-ratio", "2"]
        + ["--transfer-backend", "local", "--decode", "127.0.0.1:9100"]
    )
    cfg = options.config_from_args(args)
    p = prefill_config(args, cfg, "x")
    assert p.config is cfg  # the role takes the tree itself
    pages, page_size = p.num_pages(load_spec("tiny")), p.engine.layout.page_size
    assert (p.pp_size, p.pp_rank, p.pipeline.partition, p.port, pages, page_size) == (2, 1, (7, 5), 9200, 71, 16)
    c = p.engine.cache
    assert (c.prefix_cache, c.hicache_ratio, c.hicache_size, p.config.transfer.backend, p.decode) == (
        True,
        2.0,
        None,
        "local",
        ("127.0.0.1:9100",),
    )
