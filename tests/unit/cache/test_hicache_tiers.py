"""HiCache controller on real pools (no model): write policies, eviction + reload, aborts mid-load, disk tier.

Page contents are a deterministic function of the tokens up to and including the page, as real KV is,
so a reloaded page can be compared bit for bit with what a request would have written.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache import HiCache, HiCacheConfig, PrefixMatch
from dsakv.cache.page_copy import gather_rows
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec
from dsakv.testing.hicache import LAYOUT, PS, Harness
from dsakv.testing.hicache import expected_rows as _expected_rows
from dsakv.testing.hicache import toks as _toks


def test_device_only_prefix_cache_hits_and_evicts() -> None:
    h = Harness(device_pages=8)
    a = _toks(1, 17)  # 4 whole pages + 1 token: 5 pages while running, 4 cached
    m = h.run(a)
    assert m.num_tokens == 0 and h.cache.cached_device_pages == 4
    m = h.run(a + [7, 8, 9])
    assert m.num_tokens == 16 and m.device_pages == 4
    s = h.cache.stats
    assert (s.device_hit_tokens, s.host_hit_tokens, s.lookup_tokens) == (16, 0, 16 + 19)
    h.run(_toks(2, 21))  # needs 6 pages: the LRU run must go
    assert s.device_evicted_pages >= 1
    h.cache.check_integrity()


def test_write_back_offloads_on_eviction_and_reloads_exact_bytes() -> None:
    h = Harness(device_pages=8, hicache_ratio=2.0, write_policy="write_back")
    assert h.cache.host is not None and h.cache.host.num_pages == 16
    a, b = _toks(1, 16), _toks(2, 20)
    h.run(a)
    s = h.cache.stats
    assert s.offload_pages == 0  # write_back: nothing copied yet
    h.run(b)  # needs 5 pages, 4 free: a (4 pages, LRU) is offloaded, then its device copy dropped
    assert (s.offload_pages, s.device_evicted_pages, s.offload_bytes) == (4, 4, 4 * LAYOUT.bytes_per_page)
    assert h.cache.cached_host_pages == 4 and h.cache.cached_device_pages == 5
    m = h.run(a + [5])  # a is on host only: b (5 pages) is offloaded to make room, a loaded back
    assert (m.num_tokens, m.device_pages, m.host_pages) == (16, 0, 4)
    assert (s.offload_pages, s.load_pages, s.load_bytes) == (9, 4, 4 * LAYOUT.bytes_per_page)
    assert (s.host_hit_tokens, s.device_hit_tokens, s.device_evicted_pages) == (16, 0, 9)
    m = h.run(b + [6])  # and back again
    assert (m.num_tokens, m.host_pages) == (20, 5)


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_write_through_backs_up_on_insert(layout: str) -> None:
    h = Harness(device_pages=8, hicache_ratio=2.0, write_policy="write_through", layout=layout)
    a = _toks(1, 16)
    h.run(a)
    s = h.cache.stats
    assert (s.offload_pages, h.cache.cached_host_pages) == (4, 4)
    h.run(_toks(2, 32))  # 8 pages: a's device copy is dropped without a copy (it is on host already)
    assert (s.offload_pages, s.device_evicted_pages, s.host_evicted_pages) == (12, 4, 0)
    m = h.run(a + [1])  # the 8-page run is dropped from the device (no copy), a is loaded back
    assert (m.num_tokens, m.device_pages, m.host_pages) == (16, 0, 4)
    assert (s.offload_pages, s.load_pages, s.device_evicted_pages) == (12, 4, 12)
    h.run(_toks(3, 32))  # 8 more pages: the host tier (16) is full, the LRU host run (the first 8-page run) goes
    assert (s.offload_pages, s.host_evicted_pages, h.cache.cached_host_pages) == (20, 8, 12)


def test_write_through_selective_waits_for_hits() -> None:
    h = Harness(device_pages=16, hicache_ratio=1.0, write_policy="write_through_selective", selective_threshold=2)
    a = _toks(1, 16)
    h.run(a)
    assert h.cache.stats.offload_pages == 0
    h.run(a + [3])  # first hit
    assert h.cache.stats.offload_pages == 0
    h.run(a + [4])  # second hit: backed up
    assert h.cache.stats.offload_pages == 4 and h.cache.cached_host_pages == 4


def test_abort_mid_load_leaks_nothing() -> None:
    h = Harness(device_pages=8, hicache_ratio=2.0, write_policy="write_back")
    a = _toks(1, 16)
    h.run(a)
    h.cache.evict(8)  # a goes to host
    assert h.cache.cached_device_pages == 0 and h.cache.cached_host_pages == 4
    # split a's host run in two nodes so the load has two steps
    h.cache.radix.match(a[:8] + [999] * 8)
    m = h.cache.match_prefix(a, load=False)
    assert not m.ready and len(m.pending) == 2 and h.alloc.num_free == 4
    h.cache.check_integrity()
    h.cache.release(m)  # abort before any copy
    assert h.alloc.num_free == 8 and h.cache.cached_host_pages == 4
    h.cache.check_integrity()
    m = h.cache.match_prefix(a, load=False)
    h.cache.complete(m, max_loads=1)  # half loaded
    assert len(m.pending) == 1 and h.cache.cached_device_pages == 2 and h.alloc.num_free == 4
    h.cache.release(m)  # abort mid-load
    assert h.alloc.num_free == 6 and h.cache.cached_device_pages == 2
    h.cache.check_integrity()
    h.cache.evict(8)
    assert h.alloc.num_free == 8 and h.cache.cached_host_pages == 4
    assert h.cache.radix.root.lock_ref == 1
    h.cache.check_integrity()


def test_disk_tier_survives_restart(tmp_path: Path) -> None:
    h = Harness(device_pages=8, disk_dir=str(tmp_path))
    a = _toks(1, 13)
    h.run(a)
    assert h.cache.stats.disk_write_pages == 3 and h.cache.disk is not None and h.cache.disk.num_pages() == 3
    h2 = Harness(device_pages=8, disk_dir=str(tmp_path))  # a restarted server
    m = h2.run(a)  # bytes checked against the expected rows inside run()
    assert m.disk_pages == 3 and h2.cache.stats.disk_hit_tokens == 12
    assert h2.cache.stats.disk_write_pages == 0
    # a different layout never reads these pages
    other = DevicePool(KVLayout(load_spec("tiny"), page_size=PS, elide=False), 8)
    c = HiCache(other, PageAllocator(8), HiCacheConfig(disk_dir=str(tmp_path)))
    assert c.match_prefix(a).num_tokens == 0


def test_disk_tier_corrupt_page_reads_as_miss(tmp_path: Path) -> None:
    h = Harness(device_pages=8, disk_dir=str(tmp_path))
    a = _toks(1, 16)
    h.run(a)
    disk = h.cache.disk
    assert disk is not None
    hashes = disk.page_hashes(a)
    p = disk.path(hashes[2])
    p.write_bytes(p.read_bytes()[:100])  # torn file
    h2 = Harness(device_pages=8, disk_dir=str(tmp_path))
    m = h2.cache.match_prefix(a)
    assert m.num_tokens == 8 and m.disk_pages == 2 and not p.exists()
    assert h2.alloc.num_free == 6
    h2.cache.release(m)
    h2.cache.check_integrity()


@pytest.mark.parametrize("seed", range(int(__import__("os").environ.get("HC_SEEDS", 6))))
def test_random_workload_keeps_books_and_bytes(seed: int, tmp_path: Path) -> None:
    """Random requests over shared prefixes, deferred loads held across other requests, aborts mid-load,
    explicit evictions of both tiers: books balance and every hit's bytes are exact after every operation."""
    rng = np.random.default_rng(seed)
    policy = ["write_through", "write_back", "write_through_selective"][seed % 3]
    layout = ["layer_first", "page_first"][seed % 2]
    disk = str(tmp_path) if seed >= 3 else None
    h = Harness(
        device_pages=16, hicache_ratio=1.5, write_policy=policy, layout=layout, selective_threshold=1, disk_dir=disk
    )
    roots = [_toks(100 + i, 24) for i in range(3)]

    def prompt() -> list[int]:
        base = roots[int(rng.integers(3))][: int(rng.integers(4, 25))]
        return base + rng.integers(2, 500, int(rng.integers(1, 12))).tolist()

    held: list[tuple[PrefixMatch, np.ndarray]] = []
    for _ in range(60):
        op = rng.random()
        if op < 0.55:
            h.run(prompt())
        elif op < 0.75 and len(held) < 2:
            toks = np.asarray(prompt(), dtype=np.int64)
            m = h.cache.match_prefix(toks, load=False)
            if rng.random() < 0.5:
                h.cache.complete(m, max_loads=int(rng.integers(0, 2)))
            held.append((m, toks))
        elif op < 0.9 and held:
            m, toks = held.pop(int(rng.integers(len(held))))
            if rng.random() < 0.5:
                h.cache.complete(m)
                assert m.ready
                if m.num_tokens:
                    assert torch.equal(gather_rows(h.dev, m.page_ids), _expected_rows(toks[: m.num_tokens]))
            h.cache.release(m)  # an abort when not complete: reserved pages come back
        elif op < 0.95:
            h.cache.evict(int(rng.integers(1, 8)))
        else:
            h.cache.evict_host(int(rng.integers(1, 8)))
        h.cache.check_integrity()
    for m, _ in held:
        h.cache.release(m)
    h.cache.clear()
    h.cache.check_integrity()
    assert h.alloc.num_free == 16 and h.cache.radix.root.lock_ref == 1
    assert h.cache.host_alloc is not None and h.cache.host_alloc.num_free == h.cache.host_alloc.num_pages
