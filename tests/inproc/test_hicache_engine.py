"""The host tier in the engine on the tiny checkpoint: identical outputs with the tier off and on (every write
policy, both host layouts, fp32 and fp8 formats), a workload that forces device eviction then reload, restart
from the disk tier, aborts after a load. Books are checked after every engine step (check_every_step)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dsakv.cache.page_copy import gather_rows
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.spec.layout import BufferKey, Kind
from dsakv.testing.engines import flat_engine

PS = 4
DEVICE_TOKENS = 80  # 20 pages: one session's prefix (13 pages) fits, two do not
SP = SamplingParams(max_new_tokens=3)
FORMATS = {"fp32": ("fp32", "fp32"), "fp8": ("fp8-656", "fp8-132")}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("hicache") / "tiny", seed=0)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path) -> tuple[Any, Any]:
    return load_model(tiny_dir)


def _prompts() -> list[list[int]]:
    """Two sessions with 44-token system prompts (11 pages), three turns each, interleaved A B A B A B."""
    rng = np.random.default_rng(7)
    sys_a, sys_b = rng.integers(2, 500, 44).tolist(), rng.integers(2, 500, 44).tolist()
    out = []
    for turn in range(3):
        for sysp in (sys_a, sys_b):
            out.append(sysp + rng.integers(2, 500, 5 + turn).tolist())
    return out


PROMPTS = _prompts()


def _engine(tiny: tuple[Any, Any], fmt: str, **kw: Any) -> Engine:
    kv, index = FORMATS[fmt]
    return flat_engine(
        tiny, page_size=PS, max_tokens=DEVICE_TOKENS, kv_format=kv, index_format=index, check_every_step=True, **kw
    )


def _run(eng: Engine, prompts: list[list[int]]) -> list[list[int]]:
    """One request at a time, in order (each turn sees the cache the earlier ones left)."""
    outs = [eng.generate([p], SP)[0] for p in prompts]
    eng.check_integrity()
    return outs


CONFIGS: dict[str, dict[str, Any]] = {
    "device_only": {"enable_prefix_cache": True},
    "write_through": {"hicache_ratio": 2.0, "hicache_write_policy": "write_through"},
    "write_back": {"hicache_ratio": 2.0, "hicache_write_policy": "write_back"},
    "write_through_selective": {
        "hicache_ratio": 2.0,
        "hicache_write_policy": "write_through_selective",
        "hicache_selective_threshold": 1,
    },
    "write_back_page_first": {
        "hicache_ratio": 2.0,
        "hicache_write_policy": "write_back",
        "hicache_layout": "page_first",
    },
}


@pytest.fixture(scope="module")
def baseline(tiny: tuple[Any, Any]) -> dict[str, list[list[int]]]:
    return {fmt: _run(_engine(tiny, fmt), PROMPTS) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("name", list(CONFIGS))
def test_outputs_identical_with_tier_off_and_on(
    tiny: tuple[Any, Any], baseline: dict[str, list[list[int]]], fmt: str, name: str
) -> None:
    eng = _engine(tiny, fmt, **CONFIGS[name])
    assert _run(eng, PROMPTS) == baseline[fmt]
    s = eng.cache_stats()
    assert s is not None
    # every turn after the first of a session finds its 44-token system prompt: 11 whole pages = 44 tokens
    assert s["lookups"] == 6
    assert s["device_evicted_pages"] > 0  # two sessions do not fit on the device
    if name == "device_only":
        assert s["host_hit_tokens"] == 0 and s["hit_tokens"] == 0  # the other session always evicted it
    elif name == "write_through_selective":
        assert s["offload_pages"] == 0 and s["hit_tokens"] == 0  # no run was hit before it was evicted
    else:
        # each of the 4 later turns reloads its session's 44-token prefix from the host tier
        assert s["host_hit_tokens"] == 4 * 44 and s["hit_tokens"] == 4 * 44
        assert s["load_pages"] == 4 * 11 and s["offload_pages"] > 0
        assert s["load_bytes"] == s["load_pages"] * eng.layout.bytes_per_page


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_selective_backs_up_a_hit_prefix(tiny: tuple[Any, Any], baseline: dict[str, list[list[int]]], fmt: str) -> None:
    eng = _engine(tiny, fmt, **CONFIGS["write_through_selective"])
    order = [0, 2, 1, 4]  # A1, A2 (device hit: backed up), B1 (evicts A), A3 (host hit)
    assert _run(eng, [PROMPTS[i] for i in order]) == [baseline[fmt][i] for i in order]
    s = eng.cache_stats()
    assert s is not None
    assert (s["device_hit_tokens"], s["host_hit_tokens"], s["offload_pages"], s["load_pages"]) == (44, 44, 11, 11)


def test_host_pool_in_engine_has_no_shared_index_k(tiny: tuple[Any, Any]) -> None:
    eng = _engine(tiny, "fp8", hicache_ratio=1.5, hicache_layout="page_first")
    cache = eng.prefix_cache
    assert cache is not None and cache.host is not None  # type: ignore[attr-defined]
    host = cache.host  # type: ignore[attr-defined]
    assert set(host.keys) == set(eng.pool.keys)
    assert [k.layer for k in host.keys if k.kind is Kind.INDEX_K] == [0, 1, 2, 6, 10]
    assert not host.has(BufferKey(5, Kind.INDEX_K))
    assert host.num_pages == 30 and host.nbytes == 30 * eng.layout.bytes_per_page


def test_restart_hits_disk_tier(tiny: tuple[Any, Any], tmp_path: Path, baseline: dict[str, list[list[int]]]) -> None:
    first = _engine(tiny, "fp8", hicache_disk_dir=tmp_path)
    assert _run(first, PROMPTS[:1]) == baseline["fp8"][:1]
    s = first.cache_stats()
    # 49 prompt + 2 fed-back output tokens = 51 tokens in the pool: 12 whole pages persisted
    assert s is not None and s["disk_write_pages"] == 12 and s["disk_hit_tokens"] == 0
    second = _engine(tiny, "fp8", hicache_disk_dir=tmp_path)  # a restarted server
    assert _run(second, PROMPTS[:1]) == baseline["fp8"][:1]
    s = second.cache_stats()
    # the lookup is prompt[:-1] = 48 tokens: all 12 pages come from disk
    assert s is not None and s["disk_hit_tokens"] == 48 and s["disk_read_pages"] == 12
    assert s["device_hit_tokens"] == 0 and s["disk_write_pages"] == 0


def _prefix_rows(eng: Engine, tokens: list[int]) -> torch.Tensor:
    cache = eng.prefix_cache
    path = cache.radix.match(tokens)  # type: ignore[attr-defined]
    assert sum(n.num_pages for n in path) * PS == len(tokens) and all(n.on_device for n in path)
    return gather_rows(eng.pool, np.concatenate([n.device for n in path]))


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_reloaded_kv_is_bitwise_and_abort_after_load_leaks_nothing(tiny: tuple[Any, Any], layout: str) -> None:
    eng = _engine(tiny, "fp8", hicache_ratio=2.0, hicache_write_policy="write_back", hicache_layout=layout)
    _run(eng, PROMPTS[:1])
    written = _prefix_rows(eng, PROMPTS[0][:44]).clone()  # session A's prefix as its prefill wrote it
    _run(eng, PROMPTS[1:2])  # session B evicts it: offloaded to the host
    cache = eng.prefix_cache
    assert cache is not None
    assert cache.radix.match(PROMPTS[0][:44])[0].device is None  # type: ignore[attr-defined]
    host_before = cache.cached_host_pages  # type: ignore[attr-defined]
    rid = eng.add_request(PROMPTS[2], SP)
    eng.scheduler.schedule()  # admission: the prefix is loaded host -> device, the request not yet computed
    assert eng.cache_stats()["host_hit_tokens"] == 44  # type: ignore[index]
    assert torch.equal(_prefix_rows(eng, PROMPTS[0][:44]), written)
    eng.abort(rid)
    eng.check_integrity()
    a = eng.allocator
    assert a.num_free + cache.cached_device_pages == a.num_pages  # type: ignore[attr-defined]
    assert cache.host_alloc.num_used == cache.cached_host_pages >= host_before - 11  # type: ignore[attr-defined]
    cache.clear()  # type: ignore[attr-defined]
    assert a.num_free == a.num_pages and cache.host_alloc.num_free == cache.host_alloc.num_pages  # type: ignore
    eng.check_integrity()


def test_prefix_cache_options_conflict(tiny: tuple[Any, Any]) -> None:
    eng = _engine(tiny, "fp32", enable_prefix_cache=True)
    with pytest.raises(ConfigError, match="not both"):
        _engine(tiny, "fp32", prefix_cache=eng.prefix_cache, hicache_ratio=1.0)
    with pytest.raises(ConfigError, match="write policy 'lazy'"):
        _engine(tiny, "fp32", hicache_ratio=1.0, hicache_write_policy="lazy")


def test_generate_cli_host_tier_and_disk_restart(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from dsakv.cli.main import main

    prompts = [",".join(map(str, p)) for p in PROMPTS[:3]]  # A1 B1 A2
    common = ["generate", "--model", str(tiny_dir), "--page-size", "4", "--max-tokens", str(DEVICE_TOKENS)]
    common += ["--max-new-tokens", "3", "--json", "--stats", "--threads", "1"]
    for p in prompts:
        common += ["--prompt-ids", p]
    assert main(common) == 0
    plain = [r["output_ids"] for r in json.loads(capsys.readouterr().out)]
    runs = []
    for _ in range(2):  # the second run is a restarted server on the same disk dir
        argv = common + ["--sequential", "--hicache-ratio", "2", "--hicache-write-policy", "write_back"]
        assert main(argv + ["--hicache-disk-dir", str(tmp_path)]) == 0
        out, err = capsys.readouterr()
        assert [r["output_ids"] for r in json.loads(out)] == plain
        runs.append(json.loads(err.strip().splitlines()[-1])["prefix_cache"])
    assert runs[0]["host_hit_tokens"] == 44 and runs[0]["disk_hit_tokens"] == 0
    assert runs[1]["disk_hit_tokens"] > 0 and runs[1]["disk_write_pages"] == 0
