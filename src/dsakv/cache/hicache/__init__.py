"""HiCache: the prefix cache over up to three tiers (device, host, disk) that the engine's scheduler talks to.

    cache = HiCache(device_pool, allocator, HiCacheConfig(hicache_ratio=2.0, write_policy="write_back"))
    m = cache.match_prefix(prompt[:-1])      # longest cached run of whole pages, loaded onto the device
    allocator.incref(m.page_ids); allocator.hold(req_id, m.page_ids)
    ...compute from m.num_tokens...
    cache.insert(kv_tokens, req_page_ids)    # at finish: the cache takes its own reference on whole pages
    cache.release(m); allocator.release(req_id)
    cache.evict(n)                           # when the device allocator runs short

Tiers:
  device  the DevicePool pages the RadixCache holds (always on)
  host    a HostPool (HiCacheConfig.hicache_ratio / hicache_size), same keys as the device pool; a write
          policy (write_policy.py) decides when device copies are backed up; a hit on a host-only run is
          loaded back onto the device inside match_prefix, before the request computes
  storage the L3 tier, a StorageBackend from cache/storage (HiCacheConfig.storage, or disk_dir for `file`):
          `file` (local page files; disk_size caps them, LRU) or `mooncake` (a Mooncake Store shared by every
          instance on one master). After the tree runs out, match_prefix asks the store for the longest stored
          run of the prompt's pages (every object of a page present) and loads it, so another instance's or a
          restarted server's pages are hits. With a host tier, storage reads and writes go straight to and from
          host-pool pages (zero-copy, registered with the store); without one (file only) through a staging copy.
          When pages are written follows the write policy: write_through at insert, write_back when the device
          copy is evicted, write_through_selective when a run is backed up to the host. Every page carries a
          checksum; a corrupt page, or an object of another identity or size, is dropped and counted, never
          loaded. A store call that fails or takes longer than StorageConfig.timeout is abandoned (its host pages
          stay reserved until it returns, and the store is skipped meanwhile): the request computes instead.

Counting: a match's lookup and hits are counted by admit(m), when the request that asked actually starts
with it; a match released without admit() (the scheduler retries admission later, or an abort) counts only
in unadmitted_lookups, so a request that retries under memory pressure is counted once.

Observers (add_observer): told the page ids of every device <-> host copy, after it ran, in order (a
pipeline-parallel prefill's stage 0 records them and later stages replay them on their own pools): offloads
(backup), loads of host hits, and loads of storage hits read into host pages (on_load(host pages, device pages)
of the intact prefix that was read). A storage read itself (store -> host pages) and a storage hit without a host
tier (store -> staging -> device) are no device <-> host copy and are not told; a replaying stage would need the
store's bytes for its own layers, which is why a PP prefill refuses the storage tier.

match_prefix(tokens, load=False) reserves device pages and returns a match with pending loads; complete()
runs them and release() before completion gives the reserved pages back (an abort mid-load leaks nothing).
Imports torch, numpy and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from dsakv.cache.allocator import IntArray, IntegrityError, PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache.config import HiCacheConfig, model_fingerprint
from dsakv.cache.hicache.host_copies import HostCopies
from dsakv.cache.hicache.match import _EMPTY, HostCopyObserver, PrefixMatch, _Load
from dsakv.cache.hicache.stats import HiCacheStats
from dsakv.cache.hicache.storage_io import StorageIO
from dsakv.cache.host_pool import HostPool, host_pages_for, make_host_pool
from dsakv.cache.radix import RadixCache, as_tokens
from dsakv.cache.write_policy import make_write_policy
from dsakv.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["HiCache", "HiCacheConfig", "HiCacheStats", "HostCopyObserver", "PrefixMatch", "model_fingerprint"]


class HiCache(StorageIO, HostCopies):
    """Prefix cache controller over a DevicePool + its PageAllocator, with an optional host tier and disk tier
    (the tree policy here; storage I/O in storage_io.StorageIO, device <-> host copies in host_copies.HostCopies)."""

    def __init__(self, device: DevicePool, allocator: PageAllocator, config: HiCacheConfig | None = None) -> None:
        self.config = config or HiCacheConfig()
        if allocator.num_pages != device.num_pages:
            raise ConfigError(
                f"allocator has {allocator.num_pages} pages but the device pool {device.num_pages}: pass the pool's own"
            )
        self.device = device
        self.allocator = allocator
        self.layout = device.layout
        self.page_size = device.page_size
        self.host: HostPool | None = None
        self.host_alloc: PageAllocator | None = None
        self.host_budget_bytes: int | None = None
        if self.config.host_tier:
            budget, pages = host_pages_for(
                self.layout, device.num_pages, self.config.hicache_ratio, self.config.hicache_size
            )
            pin = self.config.pin_memory and device.device.type == "cuda"
            self.host = make_host_pool(self.config.layout, self.layout, pages, pin_memory=pin)
            self.host.check_compatible(device)
            self.host_alloc = PageAllocator(pages, name="host")
            self.host_budget_bytes = budget
        self.radix = RadixCache(self.page_size, allocator, self.host_alloc)
        self.policy = make_write_policy(self.config.write_policy, self.config.selective_threshold)
        self.stats = HiCacheStats()
        self._open_storage()
        if self.host is not None:
            for b in self.layout.buffers:
                v = self.host.view(b.key)
                self._host_segs.append((v.data_ptr(), v.stride(0), b.page_bytes))
        self._match_ids = itertools.count(1)
        self._open: dict[int, PrefixMatch] = {}
        self._observers: list[HostCopyObserver] = []
        log.info(
            "prefix cache: device %d pages%s%s",
            device.num_pages,
            f", host {self.host.num_pages} pages ({self.config.layout}, {self.config.write_policy})"
            if self.host
            else "",
            f", storage {self.storage.describe()}" if self.storage else "",
        )

    def match_prefix(self, tokens: Sequence[int] | npt.ArrayLike, load: bool = True) -> PrefixMatch:
        """Longest cached run of whole pages of `tokens`, locked. With load=True (the default) host and disk hits
        are on the device when this returns; pass prompt[:-1] so that at least one token is left to compute.
        Nothing is counted as a lookup or hit until admit(m)."""
        toks = as_tokens(tokens)
        self._reap()
        path = self.radix.match(toks)
        m = PrefixMatch(next(self._match_ids), self.page_size, int(toks.size), None, 0)
        if path:
            self.radix.lock(path[-1])
            m.node = path[-1]
        n_dev = 0
        while n_dev < len(path) and path[n_dev].on_device:
            n_dev += 1
        m.device_pages = sum(n.num_pages for n in path[:n_dev])
        self._open[m.id] = m
        for node in path[n_dev:]:
            ids = self._alloc_device(node.num_pages)
            if ids is None:
                reachable = False
                break
            self.allocator.hold(m.owner, ids)
            m.pending.append(_Load("host", node, ids))
        else:
            reachable = True
        if self.storage is not None and reachable:
            self._plan_storage(m, toks, path)
        if load:
            self.complete(m)
        return m

    def complete(self, m: PrefixMatch, max_loads: int | None = None) -> None:
        """Run the match's pending loads (at most `max_loads` of them), in order; when none is left, the match's
        page_ids are final and its lock sits on the deepest loaded node."""
        if m.released:
            raise IntegrityError(f"match {m.id} was released")
        done = 0
        while m.pending and (max_loads is None or done < max_loads):
            step = m.pending.pop(0)
            ok = self._run_load(m, step)
            done += 1
            if not ok:
                self._cancel(m)
        if not m.pending:
            self._finish(m)

    def _run_load(self, m: PrefixMatch, step: _Load) -> bool:
        self.allocator.unhold(m.owner, step.dev_ids)
        if step.host_ids.size:
            assert self.host_alloc is not None
            self.host_alloc.unhold(m.owner, step.host_ids)
        try:
            if step.kind == "host":
                return self._load_host(m, step)
            return self._load_storage(m, step)
        except BaseException:
            self.allocator.free(step.dev_ids)
            if step.host_ids.size:
                assert self.host_alloc is not None
                self.host_alloc.free(step.host_ids)
            raise

    def _cancel(self, m: PrefixMatch) -> None:
        for step in m.pending:
            self.allocator.unhold(m.owner, step.dev_ids)
            self.allocator.free(step.dev_ids)
            if step.host_ids.size:
                assert self.host_alloc is not None
                self.host_alloc.drop(m.owner, step.host_ids)
        m.pending.clear()

    def _finish(self, m: PrefixMatch) -> None:
        """Move the lock to the deepest node on the device and fix page_ids."""
        node = m.node
        while node is not None and node is not self.radix.root and not node.on_device:
            node = node.parent
        if node is self.radix.root:
            node = None
        if node is not m.node:
            if node is not None:
                self.radix.lock(node)
            assert m.node is not None
            self.radix.unlock(m.node)
            m.node = node
        path = self.radix.path_to(m.node) if m.node is not None else []
        m.page_ids = np.concatenate([n.device for n in path if n.device is not None]) if path else _EMPTY
        hit = int(m.page_ids.size)
        m.host_pages = min(m.host_pages, hit - min(m.device_pages, hit))
        m.device_pages = min(m.device_pages, hit)

    def admit(self, m: PrefixMatch) -> None:
        """The request that asked for `m` starts with its pages: count the lookup and its hits (once per match),
        and let the write policy see the hit. The scheduler calls it on admission, never on a retry."""
        if m.released or not m.ready:
            raise IntegrityError(f"match {m.id}: admit() needs a complete, unreleased match (complete() it first)")
        if m.admitted:
            return
        m.admitted = True
        ps = self.page_size
        self.stats.lookups += 1
        self.stats.lookup_tokens += m.lookup_tokens
        self.stats.device_hit_tokens += m.device_pages * ps
        self.stats.host_hit_tokens += m.host_pages * ps
        self.stats.disk_hit_tokens += m.disk_pages * ps
        path = self.radix.path_to(m.node) if m.node is not None else []
        for n in path:
            n.hit_count += 1
        if path:
            self.policy.on_hit(self, path)

    def release(self, m: PrefixMatch) -> None:
        """Unlock the match (the request finished, or was aborted at any point, even mid-load)."""
        if m.released:
            return
        if not m.admitted:
            self.stats.unadmitted_lookups += 1
        self._cancel(m)
        if m.node is not None:
            self.radix.unlock(m.node)
        m.released = True
        self._open.pop(m.id, None)

    def insert(self, tokens: Sequence[int] | npt.ArrayLike, page_ids: npt.ArrayLike) -> int:
        """Cache the whole pages of `tokens` (KV in device pages `page_ids`); returns the pages newly cached."""
        toks = as_tokens(tokens)
        path, new, adopted = self.radix.insert(toks, page_ids)
        n_new = sum(n.num_pages for n in new)
        self.stats.inserted_tokens += n_new * self.page_size
        if new:
            self.policy.on_insert(self, new)
            if self.storage is not None and (self._storage_when == "insert" or self.host is None):
                self._persist(path, new)
        return n_new

    def _alloc_device(self, n: int) -> IntArray | None:
        if n <= 0:
            return _EMPTY.copy()
        if self.allocator.num_free < n:
            self.evict(n - self.allocator.num_free)
        if self.allocator.num_free < n:
            return None
        return self.allocator.alloc(n)

    def evict(self, num_pages: int) -> int:
        """Free at least `num_pages` device pages if unlocked cached runs allow (LRU leaves first); returns pages
        freed. Under write_back the runs are offloaded to the host before their device copy goes."""
        start = self.allocator.num_free
        while self.allocator.num_free - start < num_pages:
            victims = self.radix.device_victims(num_pages - (self.allocator.num_free - start))
            if not victims:
                break
            if self.policy.offload_on_evict:
                self.backup([v for v in victims if not v.on_host])
            if self.storage is not None and self.host is not None and self._storage_when == "evict":
                self._persist([], [v for v in victims if v.device is not None and v.parent is not None])
            for v in victims:
                if v.device is None or v.parent is None:  # removed while making host room
                    continue
                self.stats.device_evicted_pages += v.num_pages
                self.radix.drop_device(v)
        return self.allocator.num_free - start

    def clear(self) -> None:
        """Drop every unlocked cached run from both tiers (the disk tier is kept)."""
        self.evict(self.allocator.num_pages)
        self.evict_host(self.host_alloc.num_pages if self.host_alloc else 0)

    @property
    def cached_device_pages(self) -> int:
        return self.radix.device_pages

    @property
    def cached_host_pages(self) -> int:
        return self.radix.host_pages

    def check_integrity(self) -> None:
        """Device allocator, host allocator and tree invariants; raises IntegrityError."""
        self.allocator.check_integrity()
        if self.host_alloc is not None:
            self.host_alloc.check_integrity()
            reserved = sum(int(s.host_ids.size) for m in self._open.values() for s in m.pending)
            reserved += sum(int(ids.size) for _, ids in self._quarantine)
            if self.host_alloc.num_used != self.radix.host_pages + reserved:
                raise IntegrityError(
                    f"host: {self.host_alloc.num_used} pages in use but the tree holds {self.radix.host_pages} "
                    f"and loads reserve {reserved}"
                )
        self.radix.check_integrity()

    def describe(self) -> dict[str, Any]:
        return {
            "device_pages": self.device.num_pages,
            "host_pages": self.host.num_pages if self.host else 0,
            "host_layout": self.config.layout if self.host else None,
            "write_policy": self.config.write_policy if self.host else None,
            "storage": self.storage.describe() if self.storage else None,
            "disk_dir": str(Path(d)) if (d := getattr(self.storage, "dir", None)) else None,
            "disk_size": getattr(self.storage, "max_bytes", None),
            "disk_used_bytes": getattr(self.storage, "used_bytes", 0),
        }
