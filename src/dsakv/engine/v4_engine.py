"""V4Engine: continuous batching of DeepSeek-V4 requests on a V4Pool, chunked prefill included; greedy, or
temperature / top-k / top-p draws seeded per token (`draw`).

Each step: every running request that finished its prompt decodes one token; then prompts are prefilled in
chunks of at most `chunk_size` tokens while the step has `max_batch_tokens` left; all rows run in one model
step. A request holds pages (token kinds) and one state slot (window ring + compressor state) from admission
to finish; both come back when it finishes, and `check_integrity()` holds after every step.

Prefix cache (`prefix_cache=True`): a prompt's full pages are reusable only together with the per-request state
at their boundary, since every kind a page's layers need must be present: the paged kinds (CSA / HCA entries,
index-K) live on the shared pages, and the window ring and compressor state at the boundary are *stored* (one
snapshot of the slot, `layout.state_bytes_per_request` bytes, taken when the prefill reaches the prompt's last
full-page boundary; chunks are cut there). A hit shares the pages (refcounts) and copies the snapshot into the
new slot; nothing is recomputed. The alternative, recomputing the boundary state, would re-run
min(boundary, num_layers x window) tokens (each layer's window depends on the previous layer's window), see
`recompute_tokens`. Least-recently-used snapshots (and their pages) are evicted when admission needs pages;
with `host_pages`, an evicted prefix is first copied to a host V4Pool of the same layout (every paged kind of
its pages, each only where read, plus the snapshot), and a later hit there loads it into fresh device pages.
With `storage` (L3: a Mooncake Store or the disk tier, cache/v4_storage), every snapshot is also written through:
its pages (each paged kind only where read) and the boundary state, MAC-checked on read; a fresh engine (another
process) whose device and host tiers miss loads the longest stored prefix into fresh pages and its slot.
Imports torch, numpy, dsakv.cache and dsakv.model; must not import disagg, serve or cli.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.v4_pool import SlotAllocator, V4Pool
from dsakv.cache.v4_storage import V4Storage
from dsakv.config import StorageConfig
from dsakv.engine.request import SamplingParams
from dsakv.engine.v4_handoff import V4Handoff
from dsakv.engine.v4_request import V4Request, draw
from dsakv.errors import CapacityError, ConfigError
from dsakv.model.deepseek_v4 import DeepseekV4, V4Row
from dsakv.spec.layout import BufferKey
from dsakv.util import ceil_div
from dsakv.util.stats import Stats


@dataclass
class V4CacheStats(Stats):
    """The V4 engine's prefix-cache counters (its cache stats show them by these names)."""

    hits: int = 0  # prompts that reused a device-cached prefix
    hit_tokens: int = 0  # ... its tokens
    snapshots: int = 0  # prefix states snapshotted
    snapshot_bytes: int = 0
    evicted: int = 0  # cached prefixes evicted from the device
    host_writes: int = 0  # evicted prefixes kept on the host tier
    host_hits: int = 0  # prompts that reused a host-tier prefix
    host_hit_tokens: int = 0


class V4Engine(V4Handoff):
    def __init__(
        self,
        model: DeepseekV4,
        num_pages: int,
        max_running: int,
        page_size: int | None = None,
        chunk_size: int = 16,
        max_batch_tokens: int = 64,
        keep_logits: bool = False,
        prefix_cache: bool = False,
        host_pages: int = 0,
        storage: StorageConfig | None = None,
        model_hash: str | None = None,
        layers: tuple[int, int] | None = None,
        forward: Callable[[list[V4Row]], torch.Tensor] | None = None,
    ) -> None:
        """`layers` + `forward`: stage 0 of a pipeline. The pool holds main layers [start, end) only and `forward`
        runs a step's rows through every stage (embed, this pool's layers, the later stages', head) to logits.
        Stages mirror stage 0's page and slot ids; no prefix cache or tiers then (their state is per stage)."""
        if chunk_size < 1 or max_batch_tokens < 1:
            raise ConfigError(f"chunk size {chunk_size} and max batch tokens {max_batch_tokens} must be >= 1")
        if (layers is None) != (forward is None):
            raise ConfigError("a V4 pipeline stage 0 needs both its layer range and the pipeline's forward")
        if layers is not None and (prefix_cache or host_pages or storage is not None):
            raise ConfigError(
                "a pipelined DeepSeek-V4 engine (--pp-size > 1) has no prefix cache or host / L3 tier yet: drop "
                "--prefix-cache and "
                "the hicache options, or use --pp-size 1"
            )
        self.model = model
        self.layout = model.layout(page_size) if layers is None else model.stage_layout(*layers, page_size)
        self.pool = V4Pool(self.layout, num_pages, max_running, model.device)
        if layers is None:
            model.check_pool(self.pool)
        self._forward = forward or (lambda rows: self.model.forward(rows, self.pool))
        self.pages = PageAllocator(num_pages, "V4 pool")
        self.slots = SlotAllocator(max_running)
        self.chunk_size = chunk_size
        self.max_batch_tokens = max_batch_tokens
        self.keep_logits = keep_logits
        self.waiting: deque[V4Request] = deque()
        self.running: list[V4Request] = []
        self.finished: dict[int, V4Request] = {}
        self.parked: dict[int, V4Request] = {}  # prefilled, waiting to be sent to a decode engine
        self._next = 0
        self.steps = 0
        self.prefix_cache = prefix_cache
        # prompt prefix (whole pages) -> (page ids, state snapshot per state key); insertion order = LRU order
        self._cache: OrderedDict[tuple[int, ...], tuple[np.ndarray, dict[BufferKey, torch.Tensor]]] = OrderedDict()
        self.stats = V4CacheStats()
        # host tier: the same layout (each kind only where read) on the CPU, for prefixes evicted from the device
        self.host: V4Pool | None = None
        self._host_cache: OrderedDict[tuple[int, ...], tuple[np.ndarray, dict[BufferKey, torch.Tensor]]] = OrderedDict()
        if host_pages:
            if not prefix_cache:
                raise ConfigError("a V4 host tier holds evicted prefixes: turn the prefix cache on too")
            self.host = V4Pool(self.layout, host_pages, 1, "cpu")
            self.host_pages = PageAllocator(host_pages, "V4 host pool")
        self.l3: V4Storage | None = None
        if storage is not None:
            if not prefix_cache:
                raise ConfigError("a V4 L3 tier stores cached prefixes: turn the prefix cache on too")
            self.l3 = V4Storage(self.layout, model_hash, storage, staging_pages=min(num_pages, 16))

    def close(self) -> None:
        """Release the L3 tier's store clients (a no-op without one)."""
        if self.l3 is not None:
            self.l3.close()

    @property
    def page_size(self) -> int:
        return self.layout.page

    def add_request(
        self,
        prompt: list[int],
        max_new_tokens: int,
        eos: tuple[int, ...] = (),
        park: bool = False,
        sampling: SamplingParams | None = None,
        seed: int = 0,
    ) -> int:
        """Queue a request; its id. `park`: once done it is parked with its pages and slot (a PD prefill sends
        them, then `abort_parked` frees them) instead of finishing."""
        if not prompt:
            raise ConfigError("a V4 request needs a non-empty prompt")
        total = len(prompt) + max_new_tokens
        need = ceil_div(total, self.page_size)
        if need > self.pages.num_pages:
            raise CapacityError(
                f"a request of {total} tokens needs {need} pages of {self.page_size}; the pool has "
                f"{self.pages.num_pages}: raise --num-pages"
            )
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens {max_new_tokens} must be >= 1")
        req = V4Request(
            self._next, list(prompt), max_new_tokens, eos=tuple(eos), park=park, sampling=sampling, seed=seed
        )
        self._next += 1
        self.waiting.append(req)
        return req.rid

    # ---- prefix cache --------------------------------------------------------------

    def _boundary(self, req: V4Request) -> int:
        """The prompt's last full-page boundary that leaves at least one token to compute (0: none)."""
        return (len(req.prompt) - 1) // self.page_size * self.page_size if self.prefix_cache else 0

    def _lookup(self, prompt: list[int]) -> tuple[int, tuple[int, ...] | None]:
        for k in range((len(prompt) - 1) // self.page_size, 0, -1):
            key = tuple(prompt[: k * self.page_size])
            if key in self._cache:
                return k, key
        return 0, None

    def _evict_for(self, need: int) -> bool:
        while not self.pages.can_alloc(need) and self._cache:
            key, (ids, snap) = self._cache.popitem(last=False)
            self._to_host(key, ids, snap)
            self.pages.release(("prefix", key))
            self.stats.evicted += 1
        return self.pages.can_alloc(need)

    def _insert(self, key: tuple[int, ...], ids: np.ndarray, snap: dict[BufferKey, torch.Tensor]) -> None:
        ids = ids.copy()
        self.pages.incref(ids)
        self.pages.hold(("prefix", key), ids)
        self._cache[key] = (ids, snap)

    def _snapshot(self, req: V4Request) -> None:
        b = req.num_computed
        key = tuple(req.prompt[:b])
        if key in self._cache:
            return
        snap = {s.key: self.pool.state(s.key)[req.slot].clone() for s in self.layout.states}
        self._insert(key, req.page_ids[: b // self.page_size], snap)
        self.stats.snapshots += 1
        self.stats.snapshot_bytes += self.layout.state_bytes_per_request
        if self.l3 is not None:  # write-through: pages 0..k-1 and the state at k
            self.l3.put(req.prompt, self.pool, req.page_ids[: b // self.page_size], req.slot)

    # ---- host tier: evicted prefixes (every paged kind of their pages + the boundary state) -----

    def _to_host(self, key: tuple[int, ...], ids: np.ndarray, snap: dict[BufferKey, torch.Tensor]) -> None:
        if self.host is None or key in self._host_cache:
            return
        while not self.host_pages.can_alloc(len(ids)) and self._host_cache:
            old, _ = self._host_cache.popitem(last=False)
            self.host_pages.release(("host", old))
        if not self.host_pages.can_alloc(len(ids)):
            return
        hids = self.host_pages.alloc(len(ids), owner=("host", key))
        dev = torch.from_numpy(ids).to(self.pool.device)
        for b in self.layout.paged:
            self.host.paged(b.key)[torch.from_numpy(hids)] = self.pool.paged(b.key)[dev].to(self.host.device)
        self._host_cache[key] = (hids, {k: t.to(self.host.device) for k, t in snap.items()})
        self.stats.host_writes += 1

    def _host_lookup(self, prompt: list[int]) -> tuple[int, tuple[int, ...] | None]:
        if self.host is None:
            return 0, None
        for k in range((len(prompt) - 1) // self.page_size, 0, -1):
            key = tuple(prompt[: k * self.page_size])
            if key in self._host_cache:
                return k, key
        return 0, None

    def _load_from_host(self, key: tuple[int, ...], dev_ids: np.ndarray, slot: int) -> None:
        assert self.host is not None
        hids, snap = self._host_cache[key]
        self._host_cache.move_to_end(key)
        dev = torch.from_numpy(dev_ids).to(self.pool.device)
        for b in self.layout.paged:
            self.pool.paged(b.key)[dev] = self.host.paged(b.key)[torch.from_numpy(hids)].to(self.pool.device)
        dsnap = {k: t.to(self.pool.device) for k, t in snap.items()}
        for skey, t in dsnap.items():
            self.pool.state(skey)[slot] = t
        self._insert(key, dev_ids, dsnap)

    def recompute_tokens(self, boundary: int) -> int:
        """Tokens a hit at `boundary` would re-run to rebuild the window and compressor state instead of storing it."""
        return min(boundary, self.model.spec.num_layers * self.model.spec.sliding_window)

    def cached_tokens(self) -> int:
        return sum(len(k) for k in self._cache)

    # ---- scheduling ------------------------------------------------------------------

    def _admit(self) -> None:
        while self.waiting and self.slots.num_free:
            req = self.waiting[0]
            need = ceil_div(len(req.prompt) + req.max_new_tokens, self.page_size)
            k, key = self._lookup(req.prompt) if self.prefix_cache else (0, None)
            hk, hkey = self._host_lookup(req.prompt) if self.prefix_cache else (0, None)
            if hk > k:  # the host tier holds a longer prefix: load it into fresh device pages
                k, key = 0, None
            else:
                hk, hkey = 0, None
            most = (len(req.prompt) - 1) // self.page_size
            lk = self.l3.lookup(req.prompt, most) if self.l3 is not None and max(k, hk) < most else 0
            if lk > max(k, hk):  # L3 holds a longer prefix
                k, key, hk, hkey = 0, None, 0, None
            else:
                lk = 0
            if key is not None:
                self._cache.move_to_end(key)  # evicted last
            if not self.pages.can_alloc(need - k) and not self._evict_for(need - k):
                return
            if key is not None and key not in self._cache:  # evicted just now to make room
                k, key = 0, None
                if not self._evict_for(need):
                    return
            self.waiting.popleft()
            req.slot = self.slots.alloc()
            fresh = self.pages.alloc(need - k, owner=req.rid)
            if key is not None:
                ids, snap = self._cache[key]
                self.pages.incref(ids)
                self.pages.hold(req.rid, ids)
                for skey, t in snap.items():
                    self.pool.state(skey)[req.slot] = t
                req.page_ids = np.concatenate([ids, fresh])
                req.num_computed = req.cached_tokens = k * self.page_size
                self.stats.hits += 1
                self.stats.hit_tokens += req.num_computed
            elif hkey is not None:
                self._load_from_host(hkey, fresh[:hk], req.slot)
                req.page_ids = fresh
                req.num_computed = req.cached_tokens = hk * self.page_size
                self.stats.host_hits += 1
                self.stats.host_hit_tokens += req.num_computed
            else:
                req.page_ids = fresh
                if lk and self.l3 is not None and self.l3.load(req.prompt, lk, self.pool, fresh, req.slot):
                    snap = {s.key: self.pool.state(s.key)[req.slot].clone() for s in self.layout.states}
                    self._insert(tuple(req.prompt[: lk * self.page_size]), fresh[:lk], snap)
                    req.num_computed = req.cached_tokens = lk * self.page_size
            self.running.append(req)

    def step(self) -> None:
        self._admit()
        rows: list[tuple[V4Request, V4Row, bool]] = []
        budget = self.max_batch_tokens
        for req in self.running:
            if req.num_computed >= len(req.prompt) and budget >= 1:
                start = len(req.tokens) - 1
                rows.append((req, V4Row(req.slot, req.page_ids, start, [req.tokens[-1]]), True))
                budget -= 1
        for req in self.running:
            if req.num_computed < len(req.prompt) and budget >= 1:
                n = min(self.chunk_size, len(req.prompt) - req.num_computed, budget)
                b = self._boundary(req)
                if req.num_computed < b:  # cut the chunk at the boundary whose state is stored
                    n = min(n, b - req.num_computed)
                chunk = req.prompt[req.num_computed : req.num_computed + n]
                last = req.num_computed + n == len(req.prompt)
                rows.append((req, V4Row(req.slot, req.page_ids, req.num_computed, chunk), last))
                budget -= n
        if not rows:
            return
        logits = self._forward([r for _, r, _ in rows])
        self.steps += 1
        for (req, row, sample), lg in zip(rows, logits, strict=True):
            req.num_computed = row.start + len(row.token_ids)
            if not sample and req.num_computed == self._boundary(req) > 0:
                self._snapshot(req)
            if sample:
                req.output.append(draw(lg, req))
                if self.keep_logits:
                    req.logits.append(lg.detach().cpu())
        for req in [r for r in self.running if r.done]:
            self.running.remove(req)
            if req.park:  # its pages and slot stay held until its sender frees them
                self.parked[req.rid] = req
                continue
            self.pages.release(req.rid)
            self.slots.free(req.slot)
            self.finished[req.rid] = req
        self.check_integrity()

    def check_integrity(self) -> None:
        self.pages.check_integrity()
        if self.host is not None:
            self.host_pages.check_integrity()
        held = {int(p) for r in [*self.running, *self.parked.values()] for p in r.page_ids} | {
            int(p) for ids, _ in self._cache.values() for p in ids
        }
        if len(held) + self.pages.num_free != self.pages.num_pages:
            raise AssertionError(f"pages: {len(held)} held + {self.pages.num_free} free != {self.pages.num_pages}")
        if len(self.running) + len(self.parked) + self.slots.num_free != self.slots.num_slots:
            raise AssertionError("request-state slots leaked")

    def abort(self, rid: int) -> V4Request | None:
        """Drop a waiting or running request (its pages and slot come back); None if unknown or finished."""
        for q in (self.waiting, self.running):
            req = next((r for r in q if r.rid == rid), None)
            if req is not None:
                q.remove(req)
                if q is self.running:
                    self.pages.release(rid)
                    self.slots.free(req.slot)
                return req
        return None

    def has_unfinished(self) -> bool:  # parked requests belong to whoever sends them on
        return bool(self.waiting or self.running)

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[V4Request]:
        ids = [self.add_request(p, max_new_tokens) for p in prompts]
        while self.has_unfinished():
            self.step()
        return [self.finished.pop(i) for i in ids]
