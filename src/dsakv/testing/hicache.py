"""A HiCache on real pools with no model, for the cache tests: a scheduler stand-in (Harness, run_request) that
writes each page's expected bytes, a deterministic function of the tokens up to and including the page (as real KV
is), so a reloaded page compares bit for bit with what a request would have written.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.disk_tier import DiskTier
from dsakv.cache.hicache import HiCache, HiCacheConfig, PrefixMatch
from dsakv.cache.page_copy import gather_rows, scatter_rows
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec
from dsakv.util import ceil_div

PS = 4
LAYOUT = KVLayout(load_spec("tiny"), page_size=PS)


def expected_rows(tokens: np.ndarray) -> torch.Tensor:
    n = len(tokens) // PS
    rows = torch.empty((n, LAYOUT.bytes_per_page), dtype=torch.uint8)
    for i in range(n):
        g = torch.Generator().manual_seed(zlib.crc32(np.asarray(tokens[: (i + 1) * PS], dtype=np.int64).tobytes()))
        rows[i] = torch.randint(0, 256, (LAYOUT.bytes_per_page,), dtype=torch.uint8, generator=g)
    return rows


class Harness:
    """Plays the scheduler: match, take pages, 'compute' (write the expected bytes), insert, release."""

    def __init__(self, device_pages: int = 8, **cfg: object) -> None:
        self.dev = DevicePool(LAYOUT, device_pages)
        self.alloc = PageAllocator(device_pages, "device")
        self.cache = HiCache(self.dev, self.alloc, HiCacheConfig(**cfg))  # type: ignore[arg-type]
        self._n = 0

    def run(self, tokens: list[int] | np.ndarray) -> PrefixMatch:
        """One request over `tokens` (its KV covers all of them); returns its match (already released)."""
        toks = np.asarray(tokens, dtype=np.int64)
        self._n += 1
        rid = f"req{self._n}"
        m = self.cache.match_prefix(toks[:-1])
        self.alloc.incref(m.page_ids)
        self.alloc.hold(rid, m.page_ids)
        if m.num_tokens:
            assert torch.equal(gather_rows(self.dev, m.page_ids), expected_rows(toks[: m.num_tokens]))
        need = ceil_div(len(toks), PS) - m.page_ids.size
        if self.alloc.num_free < need:
            self.cache.evict(need - self.alloc.num_free)
        if self.alloc.num_free < need:  # not admitted (other requests hold the pages): give everything back
            self.cache.release(m)
            self.alloc.release(rid)
            self.cache.check_integrity()
            return m
        self.cache.admit(m)
        own = self.alloc.alloc(need)
        self.alloc.hold(rid, own)
        pages = np.concatenate([m.page_ids, own])
        full = len(toks) // PS
        new = np.arange(m.page_ids.size, full)
        scatter_rows(self.dev, pages[new], expected_rows(toks)[new])
        self.cache.insert(toks, pages)
        self.cache.release(m)
        self.alloc.release(rid)
        self.cache.check_integrity()
        return m


def toks(seed: int, n: int, prefix: list[int] | None = None) -> list[int]:
    rng = np.random.default_rng(seed)
    return (prefix or []) + rng.integers(2, 500, n).tolist()


FILE = 144 + LAYOUT.bytes_per_page  # header (record, MAC included) + one page row


def disk_cache(tmp: Path, cap: int | None, device_pages: int = 8) -> HiCache:
    return HiCache(
        DevicePool(LAYOUT, device_pages),
        PageAllocator(device_pages, "device"),
        HiCacheConfig(disk_dir=str(tmp), disk_size=cap),
    )


def run_request(c: HiCache, tokens: list[int]) -> PrefixMatch:
    """One admitted request over `tokens` (playing the scheduler); hit bytes checked; returns its match."""
    toks = np.asarray(tokens, dtype=np.int64)
    m = c.match_prefix(toks[:-1])
    c.admit(m)
    if m.num_tokens:
        assert torch.equal(gather_rows(c.device, m.page_ids), expected_rows(toks[: m.num_tokens]))
    c.allocator.incref(m.page_ids)
    c.allocator.hold("r", m.page_ids)
    need = ceil_div(len(toks), PS) - m.page_ids.size
    if c.allocator.num_free < need:
        c.evict(need - c.allocator.num_free)
    own = c.allocator.alloc(need, owner="r")
    pages = np.concatenate([m.page_ids, own])
    new = np.arange(m.page_ids.size, len(toks) // PS)
    scatter_rows(c.device, pages[new], expected_rows(toks)[new])
    c.insert(toks, pages)
    c.release(m)
    c.allocator.release("r")
    c.check_integrity()
    return m


def files_of(d: DiskTier) -> set[str]:
    return {p.stem for p in d.dir.glob("*/*.page")}
