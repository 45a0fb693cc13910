"""The disk tier's size cap: LRU eviction of page files (exact files and bytes), a restart rebuilding the LRU order
from mtimes, an evicted page reading as a miss, a cap too small for one page, the CLI size option.

Page contents are a deterministic function of the tokens up to and including the page, so every hit's bytes are
compared with what a request would have written."""

from __future__ import annotations

import argparse
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.disk_tier import DiskTier
from dsakv.cache.hicache import HiCache, HiCacheConfig, PrefixMatch
from dsakv.cache.page_copy import gather_rows, scatter_rows
from dsakv.cli.options import add_cache_arguments, cache_config
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec
from dsakv.util import ceil_div

PS = 4
LAYOUT = KVLayout(load_spec("tiny"), page_size=PS)
FILE = 104 + LAYOUT.bytes_per_page  # header + one page row


def _rows(tokens: np.ndarray) -> torch.Tensor:
    n = len(tokens) // PS
    rows = torch.empty((n, LAYOUT.bytes_per_page), dtype=torch.uint8)
    for i in range(n):
        g = torch.Generator().manual_seed(zlib.crc32(np.asarray(tokens[: (i + 1) * PS], dtype=np.int64).tobytes()))
        rows[i] = torch.randint(0, 256, (LAYOUT.bytes_per_page,), dtype=torch.uint8, generator=g)
    return rows


def _cache(tmp: Path, cap: int | None, device_pages: int = 8) -> HiCache:
    return HiCache(
        DevicePool(LAYOUT, device_pages),
        PageAllocator(device_pages, "device"),
        HiCacheConfig(disk_dir=str(tmp), disk_size=cap),
    )


def _run(c: HiCache, tokens: list[int]) -> PrefixMatch:
    """One admitted request over `tokens` (playing the scheduler); hit bytes checked; returns its match."""
    toks = np.asarray(tokens, dtype=np.int64)
    m = c.match_prefix(toks[:-1])
    c.admit(m)
    if m.num_tokens:
        assert torch.equal(gather_rows(c.device, m.page_ids), _rows(toks[: m.num_tokens]))
    c.allocator.incref(m.page_ids)
    c.allocator.hold("r", m.page_ids)
    need = ceil_div(len(toks), PS) - m.page_ids.size
    if c.allocator.num_free < need:
        c.evict(need - c.allocator.num_free)
    own = c.allocator.alloc(need, owner="r")
    pages = np.concatenate([m.page_ids, own])
    new = np.arange(m.page_ids.size, len(toks) // PS)
    scatter_rows(c.device, pages[new], _rows(toks)[new])
    c.insert(toks, pages)
    c.release(m)
    c.allocator.release("r")
    c.check_integrity()
    return m


def _files(d: DiskTier) -> set[str]:
    return {p.stem for p in d.dir.glob("*/*.page")}


def _toks(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(2, 500, n).tolist()


def test_cap_evicts_lru_pages_exactly_and_restart_keeps_the_order(tmp_path: Path) -> None:
    cap = 3 * FILE + 10  # room for 3 page files
    a, b = _toks(1, 13), _toks(2, 9)  # 3 and 2 whole pages
    c = _cache(tmp_path, cap)
    d = c.disk
    assert d is not None and d.file_bytes == FILE
    ha, hb = d.page_hashes(a), d.page_hashes(b)
    _run(c, a)
    assert _files(d) == set(ha) and d.disk_bytes() == 3 * FILE and c.stats.disk_evicted_pages == 0
    _run(c, b)  # 2 new pages: a's deepest two go (a chain loses its tail first, its first page stays readable)
    s = c.stats
    assert (s.disk_write_pages, s.disk_evicted_pages, s.disk_evicted_bytes) == (5, 2, 2 * FILE)
    assert _files(d) == {ha[0], hb[0], hb[1]} and d.disk_bytes() == d.used_bytes == 3 * FILE

    c2 = _cache(tmp_path, cap)  # a restarted server: LRU order from mtimes (a0 oldest, then b1, b0)
    m = _run(c2, a)  # a0 from disk; a1, a2 recomputed and written: b's two pages are the LRU ones
    assert (m.disk_pages, m.num_tokens, c2.stats.disk_hit_tokens) == (1, 4, 4)
    s2 = c2.stats
    assert (s2.disk_write_pages, s2.disk_evicted_pages, s2.disk_evicted_bytes) == (2, 2, 2 * FILE)
    assert c2.disk is not None and _files(c2.disk) == set(ha) and c2.disk.disk_bytes() == 3 * FILE

    c3 = _cache(tmp_path, cap)  # an evicted page reads as a miss, a kept one hits with exact bytes
    m = _run(c3, b)
    assert (m.num_tokens, m.disk_pages, c3.stats.disk_hit_tokens, c3.stats.disk_read_pages) == (0, 0, 0, 0)
    assert c3.stats.disk_evicted_pages == 2  # writing b back evicts a's tail again
    m = _run(c3, a + [9])
    assert (m.num_tokens, m.disk_pages) == (4, 1)


def test_restart_with_a_smaller_cap_evicts_at_start(tmp_path: Path) -> None:
    a = _toks(1, 13)
    c = _cache(tmp_path, None)  # unbounded
    _run(c, a)
    assert c.disk is not None and c.disk.max_bytes is None and c.disk.num_pages() == 3
    c2 = _cache(tmp_path, FILE)  # room for one page: the LRU two (a's tail) go at start-up
    assert c2.disk is not None and (c2.stats.disk_evicted_pages, c2.stats.disk_evicted_bytes) == (2, 2 * FILE)
    assert _files(c2.disk) == {c2.disk.page_hashes(a)[0]}
    m = _run(c2, a)
    assert (m.disk_pages, c2.stats.disk_write_pages) == (1, 0)  # a1, a2 cannot fit without evicting a0: skipped
    assert c2.disk.disk_bytes() == FILE


def test_cap_smaller_than_one_page_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"cannot hold one page file of {FILE} B"):
        _cache(tmp_path, FILE - 1)
    with pytest.raises(ConfigError, match="without disk_dir"):
        HiCacheConfig(disk_size=2**20)
    with pytest.raises(ConfigError, match="must be > 0"):
        HiCacheConfig(disk_dir=str(tmp_path), disk_size=0)


def test_cli_disk_size_option() -> None:
    p = argparse.ArgumentParser()
    add_cache_arguments(p)
    kw = cache_config(p.parse_args(["--hicache-disk-dir", "/tmp/x", "--hicache-disk-size", "1GiB"]))
    assert (kw.disk_dir, kw.disk_size) == ("/tmp/x", 2**30)
    assert cache_config(p.parse_args([])).disk_size is None
    with pytest.raises(ConfigError, match="--hicache-disk-size"):
        cache_config(p.parse_args(["--hicache-disk-size", "lots"]))
