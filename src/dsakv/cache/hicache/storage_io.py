"""HiCache's storage (L3) I/O: the executor its calls run on (daemon threads), each call's deadline and the
quarantine of host pages an abandoned read may still write, the lookup of stored runs, reads into host (or
staging) pages verified onto the device, and writes of new pages (dsakv.cache.hicache composes it)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.allocator import IntArray, PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache.config import _STORAGE_WHEN, HiCacheConfig
from dsakv.cache.hicache.match import _EMPTY, HostCopyObserver, PrefixMatch, _Load
from dsakv.cache.hicache.stats import HiCacheStats
from dsakv.cache.host_pool import HostPool
from dsakv.cache.page_copy import gather_rows, row_offsets, scatter_rows
from dsakv.cache.radix import RadixCache, RadixNode
from dsakv.cache.storage import ReadResult, Segments, StorageBackend, StorageError, make_storage
from dsakv.errors import ConfigError

log = logging.getLogger("dsakv.cache.hicache")


class _DaemonExecutor:
    """Runs store calls on daemon threads (a call stuck in a dead store must not hold up interpreter exit, as
    concurrent.futures' joined workers would)."""

    def __init__(self, workers: int = 2) -> None:
        self._q: queue.SimpleQueue[tuple[Future[Any], Callable[..., Any], tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._threads = [
            threading.Thread(target=self._work, name=f"dsakv-storage-{i}", daemon=True) for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def _work(self) -> None:
        while (item := self._q.get()) is not None:
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the waiting caller
                fut.set_exception(e)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future[Any]:
        fut: Future[Any] = Future()
        self._q.put((fut, fn, args))
        return fut

    def shutdown(self) -> None:
        for _ in self._threads:
            self._q.put(None)


class StorageIO:
    """The storage-tier half of HiCache (a mixin: HiCache holds the state, set up by _open_storage)."""

    config: HiCacheConfig
    device: DevicePool
    allocator: PageAllocator
    layout: Any
    page_size: int
    host: HostPool | None
    host_alloc: PageAllocator | None
    radix: RadixCache
    policy: Any
    stats: HiCacheStats
    _observers: list[HostCopyObserver]

    if TYPE_CHECKING:  # HiCache's own, used here

        def _alloc_device(self, n: int) -> IntArray | None: ...

        def evict_host(self, num_pages: int) -> int: ...

        def _sync(self) -> None: ...

    def _open_storage(self) -> None:
        """The storage (L3) tier of the config, its executor, deadline and quarantine state (none without one)."""
        self.storage: StorageBackend | None = None
        self._storage_when = _STORAGE_WHEN.get(self.config.write_policy, "insert")
        self._io: _DaemonExecutor | None = None
        self._stuck: Future[Any] | None = None  # a store call past its deadline, still running
        self._down_until = 0.0  # after a failure the store is skipped until then (monotonic seconds)
        self._quarantine: list[tuple[Future[Any], IntArray]] = []  # host pages an abandoned read may still write
        self._host_segs: list[tuple[int, int, int]] = []  # per buffer: (address of page 0, page stride, bytes)
        sc = self.config.storage_config
        if sc is not None:
            self.storage = make_storage(self.layout, self.config.model_hash, sc)
            if self.storage.needs_registration:
                if self.host is None:
                    self.storage.close()
                    raise ConfigError(
                        f"--hicache-storage {sc.backend} reads and writes pages straight from host-pool memory: "
                        "give a host tier too (--hicache-ratio R or --hicache-size SIZE)"
                    )
                for t in self._host_tensors():
                    self.storage.register(t.data_ptr(), t.numel() * t.element_size())
            if not self.storage.synchronous:
                self._io = _DaemonExecutor(2)
            # files over the cap at start-up (a smaller disk_size than last run)
            self.stats.disk_evicted_pages = self.storage.evicted_pages
            self.stats.disk_evicted_bytes = self.storage.evicted_bytes

    @property
    def disk(self) -> StorageBackend | None:
        """The storage tier (its historical name: the disk tier was the first backend)."""
        return self.storage

    def _host_tensors(self) -> list[torch.Tensor]:
        assert self.host is not None
        buf = getattr(self.host, "buffer", None)
        if isinstance(buf, torch.Tensor):
            return [buf]
        tensors: dict[Any, torch.Tensor] = getattr(self.host, "_tensors", {})
        return list(tensors.values())

    def _host_pages(self, ids: IntArray) -> list[Segments]:
        """Segments (one per buffer, layout order) of host pages `ids`."""
        return [[(base + int(i) * stride, n) for base, stride, n in self._host_segs] for i in ids]

    def _staged_pages(self, rows: torch.Tensor) -> list[Segments]:
        """Segments of contiguous page rows [n, bytes_per_page] (staging copies, no host tier)."""
        base, bpp = rows.data_ptr(), self.layout.bytes_per_page
        offs = list(row_offsets(self.layout).values())
        return [[(base + i * bpp + off, n) for off, n in offs] for i in range(int(rows.shape[0]))]

    def close(self) -> None:
        """Wait for the store's in-flight calls (bounded) and close its connection."""
        if self._io is not None:
            self._io.shutdown()
        if self.storage is not None:
            self.storage.close()

    def _store_call(self, fn: Callable[..., Any], *args: Any) -> tuple[Any, Future[Any] | None]:
        """(result, None) of a store call, or (None, future) when it was abandoned at the deadline, or (None,
        None) when it failed or was skipped (the store is failing / a call is stuck). Counted in stats."""
        assert self.storage is not None
        if self._io is None:
            try:
                return fn(*args), None
            except (StorageError, OSError) as e:
                self.stats.storage_failures += 1
                log.warning("storage %s: %s; computing instead", self.storage.describe(), e)
                return None, None
        now = time.monotonic()
        if (self._stuck is not None and not self._stuck.done()) or now < self._down_until:
            self.stats.storage_skipped += 1
            return None, None
        self._stuck = None
        fut = self._io.submit(fn, *args)
        try:
            return fut.result(timeout=self.storage.config.timeout), None
        except FutureTimeout:
            self._stuck = fut
            self.stats.storage_timeouts += 1
            log.warning(
                "storage %s: a call took over %.1f s; computing instead and skipping the store until it returns",
                self.storage.describe(),
                self.storage.config.timeout,
            )
            return None, fut
        except (StorageError, OSError) as e:
            self.stats.storage_failures += 1
            self._down_until = time.monotonic() + min(1.0, self.storage.config.timeout)
            forget = getattr(self.storage, "forget_known", None)
            if forget is not None:
                forget()
            log.warning("storage %s: %s; computing instead", self.storage.describe(), e)
            return None, None

    def _reap(self) -> None:
        """Give back the host pages of abandoned reads that have returned since."""
        if not self._quarantine:
            return
        assert self.host_alloc is not None
        keep = []
        for fut, ids in self._quarantine:
            if fut.done():
                self.host_alloc.drop(("storage-io", id(fut)), ids)
            else:
                keep.append((fut, ids))
        self._quarantine = keep

    def _plan_storage(self, m: PrefixMatch, toks: npt.NDArray[np.int64], path: list[RadixNode]) -> None:
        """Reserve device (and host) pages for the longest run of the prompt's pages the store holds whole."""
        assert self.storage is not None
        ps = self.page_size
        start = sum(n.num_pages for n in path)
        total = toks.size // ps
        if start >= total:
            return
        chain = self.storage.page_hashes(toks, total)
        hashes = chain[start:]
        if self.storage.synchronous:
            n = self.storage.count_present(hashes)
        else:
            t0 = time.perf_counter()
            got, _ = self._store_call(self.storage.count_present, hashes)
            self.stats.storage_queries += 1
            self.stats.storage_query_seconds += time.perf_counter() - t0
            n = int(got or 0)
        while n > 0:
            ids = self._alloc_device(n)
            if ids is not None:
                break
            n = min(n - 1, self.allocator.num_free)
        if n <= 0 or ids is None:
            return
        host_ids = _EMPTY
        if self.host_alloc is not None:
            if self.host_alloc.num_free < n:
                self.evict_host(n - self.host_alloc.num_free)
            k = min(n, self.host_alloc.num_free)
            if k < n:
                self.allocator.free(ids[k:])
                ids, n = ids[:k], k
            if n == 0:
                return
            host_ids = self.host_alloc.alloc(n, owner=m.owner)
        self.allocator.hold(m.owner, ids)
        parent = path[-1] if path else self.radix.root
        m.pending.append(
            _Load("disk", parent, ids, toks[start * ps : (start + n) * ps].copy(), hashes[:n], chain[:start], host_ids)
        )

    def _load_storage(self, m: PrefixMatch, step: _Load) -> bool:
        """Read the step's pages from the store (into its host pages, or a staging copy), verified, onto the
        device; the intact prefix becomes a new node. False when fewer pages than reserved came back."""
        assert self.storage is not None
        parent = step.node
        ps = self.page_size
        host = step.host_ids

        def give_back(n: int) -> None:
            self.allocator.free(step.dev_ids[n:])
            if host.size > n:
                assert self.host_alloc is not None
                self.host_alloc.free(host[n:])

        if not parent.on_device or self.radix._page_key(step.tokens, 0) in parent.children:
            give_back(0)
            return False
        staging: torch.Tensor | None = None
        if host.size:
            pages = self._host_pages(host)
        else:
            staging = torch.empty((len(step.hashes), self.layout.bytes_per_page), dtype=torch.uint8)
            pages = self._staged_pages(staging)
        t0 = time.perf_counter()
        res, stuck = self._store_call(self.storage.get, step.hashes, pages)
        self.stats.storage_read_seconds += time.perf_counter() - t0
        self.storage.touch(step.above)  # the chain's earlier pages stay more recent than the pages just read
        if stuck is not None and host.size:  # the read may still write these host pages: keep them until it ends
            assert self.host_alloc is not None
            self.host_alloc.hold(("storage-io", id(stuck)), host)
            self._quarantine.append((stuck, host))
            self.allocator.free(step.dev_ids)
            return False
        if not isinstance(res, ReadResult):
            give_back(0)
            return False
        self.stats.storage_corrupt_pages += res.corrupt
        self.stats.storage_refused_pages += res.refused
        self.stats.storage_missing_pages += res.missing
        if res.corrupt or res.refused:
            log.warning("storage %s: page refused (%s); computing it instead", self.storage.describe(), res.reason)
        n = res.n
        give_back(n)
        if n == 0:
            return False
        ids = step.dev_ids[:n]
        if host.size:
            assert self.host is not None
            self.host.load(self.device, host[:n], ids)
            for obs in self._observers:  # a host -> device copy like a host hit's (the store filled host[:n])
                obs.on_load(host[:n], ids)
        else:
            assert staging is not None
            scatter_rows(self.device, ids, staging[:n])
        self._sync()
        child = self.radix.add_child(parent, step.tokens[: n * ps], ids)
        if host.size:
            self.radix.set_host(child, host[:n])
        self.radix.lock(child)
        if m.node is not None:
            self.radix.unlock(m.node)
        m.node = child
        m.disk_pages += n
        self.stats.disk_read_pages += n
        self.stats.disk_read_bytes += n * self.layout.bytes_per_page
        self.policy.on_insert(self, [child])
        return n == step.dev_ids.size

    def _persist(self, path: list[RadixNode], nodes: list[RadixNode]) -> None:
        """Write the pages of `nodes` (all under the chain `path` ends with, or each under its own path when
        `path` is empty) that the store does not hold yet: from their host pages, else a staging copy."""
        assert self.storage is not None
        if not path:
            for n in nodes:
                if n.parent is not None:
                    self._persist(self.radix.path_to(n), [n])
            return
        toks = np.concatenate([n.key for n in path])
        total = toks.size // self.page_size
        hashes = self.storage.page_hashes(toks, total)
        want = {id(n) for n in nodes}
        todo: list[tuple[str, RadixNode, int]] = []  # (hash, node, page within node)
        off = 0
        for n in path:
            if id(n) in want:
                todo += [(hashes[off + k], n, k) for k in range(n.num_pages)]
            off += n.num_pages
        todo = [t for t in todo if not self.storage.contains(t[0])]
        if not todo:
            self.storage.touch(hashes)
            return
        pages: list[Segments] = []
        staged: list[int] = []
        for _, n, k in todo:
            if n.host is not None:
                pages.append(self._host_pages(n.host[k : k + 1])[0])
            elif n.device is not None and not self.storage.needs_registration:
                staged.append(len(pages))
                pages.append([])
            else:
                pages.append([])
        rows = None
        if staged:
            dev = np.array([int(todo[i][1].device[todo[i][2]]) for i in staged], dtype=np.int64)  # type: ignore[index]
            rows = gather_rows(self.device, dev).to("cpu").contiguous()
            for j, seg in zip(staged, self._staged_pages(rows), strict=True):
                pages[j] = seg
        ok = [i for i, p in enumerate(pages) if p]
        self.stats.storage_unstaged_pages += len(pages) - len(ok)
        if len(ok) < len(pages):  # a run of one chain: stop at the first page that cannot be written
            first_bad = next(i for i, p in enumerate(pages) if not p)
            ok = [i for i in ok if i < first_bad]
        if not ok:
            return
        ev_pages, ev_bytes = self.storage.evicted_pages, self.storage.evicted_bytes
        t0 = time.perf_counter()
        put_hashes = [todo[i][0] for i in ok]
        if self.storage.synchronous:
            written, _ = self._store_call(self.storage.put, put_hashes, [pages[i] for i in ok], hashes)
        else:
            written, _ = self._store_call(self.storage.put, put_hashes, [pages[i] for i in ok])
        self.stats.storage_write_seconds += time.perf_counter() - t0
        del rows
        written = int(written or 0)
        self.stats.disk_write_pages += written
        self.stats.disk_write_bytes += written * self.layout.bytes_per_page
        self.stats.disk_evicted_pages += self.storage.evicted_pages - ev_pages
        self.stats.disk_evicted_bytes += self.storage.evicted_bytes - ev_bytes
