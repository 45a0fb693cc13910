"""The disk tier's size cap: LRU eviction of page files (exact files and bytes), a restart rebuilding the LRU order
from mtimes, an evicted page reading as a miss, a cap too small for one page, the CLI size option.

Page contents are a deterministic function of the tokens up to and including the page, so every hit's bytes are
compared with what a request would have written."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from dsakv.cache.hicache import HiCacheConfig
from dsakv.cli.options import add_cache_arguments, cache_config
from dsakv.errors import ConfigError
from dsakv.testing.hicache import (
    FILE,
)
from dsakv.testing.hicache import (
    disk_cache as _cache,
)
from dsakv.testing.hicache import (
    files_of as _files,
)
from dsakv.testing.hicache import (
    run_request as _run,
)
from dsakv.testing.hicache import (
    toks as _toks,
)


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
