"""HiCache's device <-> host copies: loads of host hits, backups (offloads) to the host tier, host eviction, and
the observers told of every copy (dsakv.cache.hicache composes it)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsakv.cache.allocator import IntegrityError, PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache.match import HostCopyObserver, PrefixMatch, _Load
from dsakv.cache.hicache.stats import HiCacheStats
from dsakv.cache.host_pool import HostPool
from dsakv.cache.radix import RadixCache, RadixNode
from dsakv.cache.storage import StorageBackend

log = logging.getLogger("dsakv.cache.hicache")


class HostCopies:
    """The host-tier half of HiCache (a mixin: HiCache holds the state)."""

    device: DevicePool
    allocator: PageAllocator
    page_size: int
    host: HostPool | None
    host_alloc: PageAllocator | None
    radix: RadixCache
    stats: HiCacheStats
    storage: StorageBackend | None
    _storage_when: str
    _observers: list[HostCopyObserver]

    if TYPE_CHECKING:  # HiCache's own, used here

        def _persist(self, path: list[RadixNode], nodes: list[RadixNode]) -> None: ...

    def add_observer(self, observer: HostCopyObserver) -> None:
        """Tell `observer` of every device <-> host copy from now on."""
        self._observers.append(observer)

    @property
    def host_tokens(self) -> int:
        return self.host.num_pages * self.page_size if self.host else 0

    def _sync(self) -> None:
        if self.device.device.type == "cuda":
            torch.cuda.synchronize(self.device.device)

    def _load_host(self, m: PrefixMatch, step: _Load) -> bool:
        # The step was planned for one host-only node; other requests may since have split it (its first pages
        # are then in new host-only ancestors) or put part of it on the device. Load the host-only tail of the
        # path down to it: at most the pages reserved.
        chain: list[RadixNode] = []
        n: RadixNode | None = step.node
        while n is not None and n is not self.radix.root and not n.on_device:
            chain.append(n)
            n = n.parent
        chain.reverse()
        pages = sum(c.num_pages for c in chain)
        if pages > step.dev_ids.size:
            raise IntegrityError(f"match {m.id}: {pages} host pages to load but {step.dev_ids.size} reserved")
        if chain:
            assert self.host is not None
            host_ids = np.concatenate([c.host for c in chain if c.host is not None])
            dev_ids = step.dev_ids[:pages]
            t0 = time.perf_counter()
            nbytes = self.host.load(self.device, host_ids, dev_ids)
            for obs in self._observers:
                obs.on_load(host_ids, dev_ids)
            self._sync()
            self.stats.load_seconds += time.perf_counter() - t0
            self.stats.load_pages += pages
            self.stats.load_bytes += nbytes
            off = 0
            for c in chain:
                self.radix.set_device(c, dev_ids[off : off + c.num_pages])
                off += c.num_pages
            m.host_pages += pages
        if pages < step.dev_ids.size:
            self.allocator.free(step.dev_ids[pages:])
        return True

    def backup(self, nodes: list[RadixNode]) -> int:
        """Copy device-only `nodes` to the host tier in one vectorised copy; returns pages backed up.
        Makes room by evicting host copies (LRU); nodes that still do not fit stay device-only."""
        if self.host is None or self.host_alloc is None:
            return 0
        nodes = [n for n in nodes if n.on_device and not n.on_host]
        need = sum(n.num_pages for n in nodes)
        if need == 0:
            return 0
        if self.host_alloc.num_free < need:
            self.evict_host(need - self.host_alloc.num_free)
        fit, got = [], 0
        for n in nodes:
            if not (n.on_device and not n.on_host):
                continue
            if got + n.num_pages > self.host_alloc.num_free:
                self.stats.offload_skipped_pages += n.num_pages
                continue
            fit.append(n)
            got += n.num_pages
        if not fit:
            return 0
        host_ids = self.host_alloc.alloc(got)
        dev_ids = np.concatenate([n.device for n in fit if n.device is not None])
        t0 = time.perf_counter()
        nbytes = self.host.offload(self.device, dev_ids, host_ids)
        for obs in self._observers:
            obs.on_offload(dev_ids, host_ids)
        self.stats.offload_seconds += time.perf_counter() - t0
        self.stats.offload_pages += got
        self.stats.offload_bytes += nbytes
        off = 0
        for n in fit:
            self.radix.set_host(n, host_ids[off : off + n.num_pages])
            off += n.num_pages
        if self.storage is not None and self._storage_when == "backup":
            self._persist([], fit)
        return got

    def evict_host(self, num_pages: int) -> int:
        """Free at least `num_pages` host pages if possible (LRU); returns host pages freed."""
        if self.host_alloc is None:
            return 0
        start = self.host_alloc.num_free
        while self.host_alloc.num_free - start < num_pages:
            victims = self.radix.host_victims(num_pages - (self.host_alloc.num_free - start))
            if not victims:
                break
            for v in victims:
                if v.host is None or v.parent is None:
                    continue
                self.stats.host_evicted_pages += v.num_pages
                self.radix.drop_host(v)
        return self.host_alloc.num_free - start
