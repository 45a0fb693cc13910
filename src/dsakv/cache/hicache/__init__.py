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
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.allocator import IntArray, IntegrityError, PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.fingerprint import weights_fingerprint
from dsakv.cache.host_pool import HOST_LAYOUTS, HostPool, host_pages_for, make_host_pool
from dsakv.cache.page_copy import gather_rows, row_offsets, scatter_rows
from dsakv.cache.radix import RadixCache, RadixNode, as_tokens
from dsakv.cache.storage import ReadResult, Segments, StorageBackend, StorageConfig, StorageError, make_storage
from dsakv.cache.write_policy import WRITE_POLICIES, make_write_policy
from dsakv.errors import ConfigError

log = logging.getLogger(__name__)

_EMPTY = np.zeros(0, dtype=np.int64)


def model_fingerprint(model: torch.nn.Module, model_dir: str | Path | None = None) -> str:
    """The weights fingerprint that names stored pages (fingerprint.weights_fingerprint: every byte of every
    tensor, cached by checkpoint file identity)."""
    return weights_fingerprint(model, model_dir)


# when the write policy sends pages to the storage tier
_STORAGE_WHEN = {"write_through": "insert", "write_back": "evict", "write_through_selective": "backup"}


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


@dataclass(frozen=True)
class HiCacheConfig:
    """Prefix cache options. The default is a device-only prefix cache (no host tier, no disk)."""

    hicache_ratio: float | None = None  # host pool = ratio x device pool bytes
    hicache_size: int | None = None  # or host pool bytes
    layout: str = "layer_first"  # host layout: layer_first | page_first
    write_policy: str = "write_through"  # write_through | write_back | write_through_selective
    selective_threshold: int = 2  # hits before write_through_selective backs a run up
    disk_dir: str | None = None  # third tier on local disk; None = off
    disk_size: int | None = None  # disk tier cap in bytes (page files, headers included); None = unbounded
    model_hash: str | None = None  # weights fingerprint for storage keys (weights change -> new keys)
    storage: StorageConfig | None = None  # the L3 tier (file or mooncake); disk_dir is the `file` shorthand
    pin_memory: bool = True  # pin the host pool when the device is CUDA

    def __post_init__(self) -> None:
        if self.hicache_ratio is not None and self.hicache_size is not None:
            raise ConfigError("give hicache_ratio or hicache_size, not both")
        if self.hicache_ratio is not None and not self.hicache_ratio > 0:
            raise ConfigError(f"hicache_ratio = {self.hicache_ratio} must be > 0 (host pool = ratio x device pool)")
        if self.hicache_size is not None and self.hicache_size <= 0:
            raise ConfigError(f"hicache_size = {self.hicache_size} bytes must be > 0")
        HOST_LAYOUTS.check(self.layout)
        WRITE_POLICIES.check(self.write_policy)
        if self.disk_size is not None and self.disk_dir is None:
            raise ConfigError(f"disk_size = {self.disk_size} B given without disk_dir: give a disk tier directory")
        if self.disk_size is not None and self.disk_size <= 0:
            raise ConfigError(f"disk_size = {self.disk_size} bytes must be > 0 (or None for no cap)")
        if self.storage is not None and self.disk_dir is not None:
            raise ConfigError("give disk_dir (the file tier) or a storage backend, not both")
        if self.selective_threshold < 1:
            raise ConfigError(f"selective_threshold = {self.selective_threshold} must be >= 1")

    @property
    def host_enabled(self) -> bool:
        return self.hicache_ratio is not None or self.hicache_size is not None

    @property
    def storage_config(self) -> StorageConfig | None:
        if self.storage is not None:
            return self.storage
        if self.disk_dir is not None:
            return StorageConfig(backend="file", dir=self.disk_dir, max_bytes=self.disk_size)
        return None


@dataclass
class HiCacheStats:
    """Counters since the cache was built. Tokens are whole pages x page_size."""

    lookups: int = 0  # admitted matches (admit()): one per request admission that used the cache
    lookup_tokens: int = 0  # tokens those matches looked up
    unadmitted_lookups: int = 0  # match_prefix calls released without admit() (admission retries, aborts)
    device_hit_tokens: int = 0  # matched tokens that were already on the device
    host_hit_tokens: int = 0  # matched tokens loaded back from the host tier
    disk_hit_tokens: int = 0  # matched tokens loaded from the storage (L3) tier: file or mooncake
    inserted_tokens: int = 0  # tokens newly cached by insert
    offload_pages: int = 0  # device -> host
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    offload_skipped_pages: int = 0  # backups that found the host tier full of locked pages
    load_pages: int = 0  # host -> device
    load_bytes: int = 0
    load_seconds: float = 0.0
    disk_write_pages: int = 0  # pages written to the storage tier (disk_* = the storage tier, any backend)
    disk_write_bytes: int = 0
    disk_read_pages: int = 0  # storage -> device
    disk_read_bytes: int = 0
    disk_evicted_pages: int = 0  # page files deleted to stay under disk_size (LRU)
    disk_evicted_bytes: int = 0  # their bytes on disk (headers included)
    storage_queries: int = 0  # longest-prefix existence queries sent to the store
    storage_query_seconds: float = 0.0
    storage_read_seconds: float = 0.0  # store -> host (or staging) pages, verification included
    storage_write_seconds: float = 0.0
    storage_failures: int = 0  # store calls that failed (a dead master, an I/O error): computed instead
    storage_timeouts: int = 0  # store calls abandoned at the deadline: computed instead
    storage_skipped: int = 0  # store calls not made while the store was failing or a call was still stuck
    storage_corrupt_pages: int = 0  # pages whose checksum or MAC failed on read (dropped)
    storage_refused_pages: int = 0  # objects of another identity or size (never loaded)
    storage_missing_pages: int = 0  # pages gone between the existence query and the read
    storage_unstaged_pages: int = 0  # pages not written: no host copy to put from (zero-copy backends)
    device_evicted_pages: int = 0  # device copies dropped (offloaded first under write_back)
    host_evicted_pages: int = 0  # host copies dropped

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def offload_gbps(self) -> float:
        return self.offload_bytes / self.offload_seconds / 1e9 if self.offload_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    @property
    def storage_read_gbps(self) -> float:
        return self.disk_read_bytes / self.storage_read_seconds / 1e9 if self.storage_read_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_tokens=self.hit_tokens, hit_rate=round(self.hit_rate, 6))
        d.update(storage_hit_tokens=self.disk_hit_tokens)
        return d


@dataclass
class _Load:
    """One pending load of a match: a host-only node, or a run of storage pages under `node`."""

    kind: str  # "host" | "disk" (the storage tier)
    node: RadixNode
    dev_ids: IntArray
    tokens: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    hashes: list[str] = field(default_factory=list)
    above: list[str] = field(default_factory=list)  # disk hashes of the pages before `hashes` (in the tree)
    host_ids: IntArray = field(default_factory=lambda: _EMPTY)  # storage loads through the host tier land here


@dataclass(eq=False)
class PrefixMatch:
    """A locked prefix hit. `page_ids` / `num_tokens` are final once `ready` (match_prefix with load=True)."""

    id: int
    page_size: int
    lookup_tokens: int
    node: RadixNode | None  # deepest locked node (None: nothing matched)
    device_pages: int  # pages that were on the device at match time
    pending: list[_Load] = field(default_factory=list)
    page_ids: IntArray = field(default_factory=lambda: _EMPTY)
    host_pages: int = 0  # loaded from the host tier
    disk_pages: int = 0  # loaded from the storage tier
    released: bool = False
    admitted: bool = False  # admit() counted it

    @property
    def ready(self) -> bool:
        return not self.pending

    @property
    def owner(self) -> tuple[str, int]:
        return ("hicache-load", self.id)

    @property
    def num_tokens(self) -> int:
        return int(self.page_ids.size) * self.page_size


class HostCopyObserver(Protocol):
    """Told every copy between the device pool and the host tier (page ids in copy order)."""

    def on_offload(self, dev_ids: IntArray, host_ids: IntArray) -> None: ...

    def on_load(self, host_ids: IntArray, dev_ids: IntArray) -> None: ...


class HiCache:
    """Prefix cache controller over a DevicePool + its PageAllocator, with an optional host tier and disk tier."""

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
        if self.config.host_enabled:
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

    # ---- storage calls -----------------------------------------------------------------

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

    # ---- sizes ----------------------------------------------------------------------

    def add_observer(self, observer: HostCopyObserver) -> None:
        """Tell `observer` of every device <-> host copy from now on."""
        self._observers.append(observer)

    @property
    def host_tokens(self) -> int:
        return self.host.num_pages * self.page_size if self.host else 0

    def _sync(self) -> None:
        if self.device.device.type == "cuda":
            torch.cuda.synchronize(self.device.device)

    # ---- lookup ---------------------------------------------------------------------

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

    # ---- insert ---------------------------------------------------------------------

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

    # ---- tier moves -------------------------------------------------------------------

    def _alloc_device(self, n: int) -> IntArray | None:
        if n <= 0:
            return _EMPTY.copy()
        if self.allocator.num_free < n:
            self.evict(n - self.allocator.num_free)
        if self.allocator.num_free < n:
            return None
        return self.allocator.alloc(n)

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

    def clear(self) -> None:
        """Drop every unlocked cached run from both tiers (the disk tier is kept)."""
        self.evict(self.allocator.num_pages)
        self.evict_host(self.host_alloc.num_pages if self.host_alloc else 0)

    # ---- checks -----------------------------------------------------------------------

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
