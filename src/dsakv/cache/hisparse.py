"""HiSparse residency: index-K for every token on the device, MLA KV on the host, a hot buffer of KV rows.

Storage (sizes are the planner's, dsakv.plan.hisparse):

    device index-K  one uint8 [logical_pages, page_bytes] per INDEX_K key of the layout (producers only with
                    elision, every layer dense), addressed by logical token slot (page * page_size + offset)
    device hot KV   one uint8 [num_blocks x block_rows, kv_bytes] per KV key; block b belongs to one request:
                    rows [b x block_rows, b x block_rows + buffer_size) are its LRU slots, the last page_size
                    rows hold its newest page (token p of the newest page at buffer_size + p % page_size)
    host KV         one uint8 [logical_pages, page_bytes] per KV key (pinned when CUDA is there); KV formats are
                    one segment per token, so [logical_pages x page_size, kv_bytes] rows are token slots

Per request and layer a residency map (logical position -> LRU slot) with a last-used clock. After a producer's
top-k, `swap_in(producer, topk)` computes for that producer and every shared layer reusing its top-k (layers
whose producer_of is that producer) the positions neither in the newest page nor resident, evicts the least
recently used slots not hit by this top-k, and copies the missing rows from host to device: one index_select
on the host rows and one index_copy_ into the hot rows per layer, all requests together. A shared layer is
never given another producer's top-k: its rows come only from `swap_in` of its own producer.

`store_kv` writes a token's KV to the host (the backup every later swap-in reads) and, for the newest page, to
the hot buffer; `store_index` writes index-K to the device. Stats: hot-buffer hits / lookups, rows and bytes
swapped in per layer (this step and in total).

A model step runs on the pool through `step_access(batch)` (a HiSparseStep, what the model's StepContext uses
in place of PoolAccess): writes and index-K reads go by logical slot as on a DevicePool (KV writes: host, and
the newest page's rows to the hot block), and it is the attention's row source: `on_topk` after a producer's
top-k swaps in the missing rows of every one-token (decode) row of the step, and `read_selected` reads those
tokens' selected rows from the hot buffer (other tokens, prefill chunks, read their rows from the host KV).
`prepare(entries, running)` (the engine's runner, before each step) admits, grows and releases requests.
Imports torch and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.device_pool import Region
from dsakv.cache.kv_access import codec_for
from dsakv.cache.page_copy import as_index, put, take
from dsakv.errors import CapacityError, ConfigError
from dsakv.spec.layout import BufferKey, Kind, KVLayout
from dsakv.util import ceil_div

RequestId = Hashable


@dataclass
class LayerStats:
    lookups: int = 0
    hits: int = 0
    rows_in: int = 0
    bytes_in: int = 0


@dataclass
class HiSparseStats:
    """Hot-buffer hits and swap-in traffic; `step` is since the last `begin_step()`, `total` since the start."""

    step: dict[int, LayerStats] = field(default_factory=dict)
    total: dict[int, LayerStats] = field(default_factory=dict)
    steps: int = 0

    def add(self, layer: int, lookups: int, hits: int, rows: int, nbytes: int) -> None:
        for table in (self.step, self.total):
            s = table.setdefault(layer, LayerStats())
            s.lookups += lookups
            s.hits += hits
            s.rows_in += rows
            s.bytes_in += nbytes

    @property
    def hit_rate(self) -> float:
        lookups = sum(s.lookups for s in self.total.values())
        return sum(s.hits for s in self.total.values()) / lookups if lookups else 1.0

    def step_rows(self) -> dict[int, int]:
        return {layer: s.rows_in for layer, s in sorted(self.step.items())}

    def step_bytes(self) -> dict[int, int]:
        return {layer: s.bytes_in for layer, s in sorted(self.step.items())}

    def to_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "hit_rate": round(self.hit_rate, 6),
            "rows_in_total": sum(s.rows_in for s in self.total.values()),
            "bytes_in_total": sum(s.bytes_in for s in self.total.values()),
            "rows_in_last_step": self.step_rows(),
            "bytes_in_last_step": self.step_bytes(),
        }


class _Residency:
    """One request's LRU slots for one layer."""

    def __init__(self, buffer_size: int) -> None:
        self.slot_pos = np.full(buffer_size, -1, dtype=np.int64)  # position held by each slot, -1 empty
        self.last_used = np.full(buffer_size, -1, dtype=np.int64)
        self.pos_slot = np.full(0, -1, dtype=np.int64)  # slot of each position, -1 not resident
        self.rows = np.zeros(0, dtype=np.int64)  # block-relative rows of the last top-k, in top-k order
        self.positions = np.zeros(0, dtype=np.int64)

    def grow(self, capacity: int) -> None:
        if capacity > self.pos_slot.size:
            extra = np.full(capacity - self.pos_slot.size, -1, dtype=np.int64)
            self.pos_slot = np.concatenate((self.pos_slot, extra))


@dataclass
class _Request:
    block: int
    pages: np.ndarray
    length: int
    layers: dict[int, _Residency]


class HiSparsePool:
    """Device index-K + hot KV rows and host KV for a HiSparse decode; see the module docstring."""

    def __init__(
        self,
        layout: KVLayout,
        logical_pages: int,
        buffer_size: int,
        max_requests: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> None:
        if logical_pages < 1 or max_requests < 1:
            raise CapacityError(
                f"a HiSparse pool needs >= 1 logical page and >= 1 request, got {logical_pages=}, {max_requests=}"
            )
        if buffer_size < 1:
            raise ConfigError(f"device_buffer_size {buffer_size} must be >= 1 row per layer (>= the top-k)")
        if layout.kv_format not in ("fp8-656", "fp8-576", "bf16", "fp32"):  # pragma: no cover - all KV formats
            raise ConfigError(f"KV format {layout.kv_format!r} has no one-row-per-token layout for HiSparse")
        self.layout = layout
        self.spec = layout.spec
        self.page_size = layout.page_size
        self.buffer_size = buffer_size
        self.block_rows = buffer_size + layout.page_size
        self.max_requests = max_requests
        self.logical_pages = logical_pages
        self.device = torch.device(device)
        pin = pin_memory and torch.cuda.is_available()
        self.kv_keys = tuple(b.key for b in layout.buffers if b.key.kind is Kind.KV)
        self.index_keys = tuple(b.key for b in layout.buffers if b.key.kind is Kind.INDEX_K)
        self.kv_row_bytes = layout.kv_bytes
        hot_rows = max_requests * self.block_rows
        self._index = {
            k: torch.zeros((logical_pages, layout.buffer(k).page_bytes), dtype=torch.uint8, device=self.device)
            for k in self.index_keys
        }
        self._hot = {
            k: torch.zeros((hot_rows, self.kv_row_bytes), dtype=torch.uint8, device=self.device) for k in self.kv_keys
        }
        self._host = {
            k: torch.zeros((logical_pages, layout.buffer(k).page_bytes), dtype=torch.uint8, pin_memory=pin)
            for k in self.kv_keys
        }
        self.kv_codec = codec_for(layout, Kind.KV)
        self.index_codec = codec_for(layout, Kind.INDEX_K) if self.index_keys else None
        self._free_blocks = list(range(max_requests))
        self._reqs: dict[RequestId, _Request] = {}
        self._clock = 0
        self.stats = HiSparseStats()
        # layer groups: producer -> [producer, shared layers reusing its top-k], over this layout's layers
        self.groups: dict[int, tuple[int, ...]] = {}
        for layer in layout.layers:
            self.groups.setdefault(self.spec.producer_of(layer), ())
            self.groups[self.spec.producer_of(layer)] += (layer,)

    @classmethod
    def for_figures(
        cls,
        layout: KVLayout,
        logical_tokens: int,
        max_requests: int,
        buffer_size: int,
        device: str | torch.device = "cpu",
        pin_memory: bool = False,
    ) -> HiSparsePool:
        """The pool the planner sized (dsakv.plan.hisparse.HiSparseFigures: logical_tokens, max_requests)."""
        return cls(layout, ceil_div(logical_tokens, layout.page_size), buffer_size, max_requests, device, pin_memory)

    # ---- sizes -------------------------------------------------------------------------

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() for t in self._index.values()) + sum(t.numel() for t in self._hot.values())

    @property
    def host_bytes(self) -> int:
        return sum(t.numel() for t in self._host.values())

    @property
    def hot_rows(self) -> int:
        return self.max_requests * self.block_rows

    @property
    def nbytes(self) -> int:
        """Device bytes (as DevicePool.nbytes): index-K of the logical pool + the hot KV rows."""
        return self.device_bytes

    @property
    def num_admitted(self) -> int:
        return len(self._reqs)

    def regions(self) -> dict[BufferKey, Region]:
        """The memory a PD decode registers for the prefill to write a prompt into, by logical page, in layout
        order: the host KV of each KV key and the device index-K of each INDEX_K key (the hot buffer is never a
        transfer target); the same keys and page bytes as a DevicePool of the layout, so the manifests match."""
        out = {}
        for b in self.layout.buffers:
            t = self._host[b.key] if b.key.kind is Kind.KV else self._index[b.key]
            out[b.key] = Region(int(t.data_ptr()), int(t.shape[1]), int(t.shape[0]))
        return out

    def stats_dict(self) -> dict[str, Any]:
        """Stats plus the sizes, for logs and /metrics."""
        return {
            **self.stats.to_dict(),
            "device_bytes": self.device_bytes,
            "host_bytes": self.host_bytes,
            "logical_tokens": self.logical_pages * self.page_size,
            "hot_buffers": self.max_requests,
            "hot_buffers_used": len(self._reqs),
            "device_buffer_size": self.buffer_size,
        }

    # ---- tensors by key (a key the layout does not hold raises KeyError naming layer and kind) ----------------

    def _get(self, table: dict[BufferKey, torch.Tensor], key: BufferKey, where: str) -> torch.Tensor:
        try:
            return table[key]
        except KeyError:
            raise KeyError(f"{self.layout.missing_key_message(key)} (HiSparse {where})") from None

    def index_tensor(self, layer: int) -> torch.Tensor:
        """Device index-K of `layer`, [logical_pages, page_bytes], addressed by logical slot."""
        return self._get(self._index, BufferKey(layer, Kind.INDEX_K), "device index-K")

    def hot_tensor(self, layer: int) -> torch.Tensor:
        """Device hot KV rows of `layer`, [hot_rows, kv_bytes]."""
        return self._get(self._hot, BufferKey(layer, Kind.KV), "device hot buffer")

    def host_tensor(self, layer: int) -> torch.Tensor:
        """Host KV of `layer`, [logical_pages, page_bytes]."""
        return self._get(self._host, BufferKey(layer, Kind.KV), "host KV")

    def _host_rows(self, layer: int) -> torch.Tensor:
        return self.host_tensor(layer).view(self.logical_pages * self.page_size, self.kv_row_bytes)

    # ---- requests -----------------------------------------------------------------------

    def admit(self, rid: RequestId, pages: npt.ArrayLike, length: int = 0) -> int:
        """Give request `rid` a hot block and its logical pages; returns the block id."""
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already admitted to the HiSparse pool")
        if not self._free_blocks:
            raise CapacityError(
                f"no free HiSparse hot buffer for request {rid!r}: all {self.max_requests} buffers of "
                f"{self.block_rows} rows per layer are in use; finish a request or raise the device budget"
            )
        block = self._free_blocks.pop(0)
        req = _Request(
            block, np.zeros(0, dtype=np.int64), 0, {layer: _Residency(self.buffer_size) for layer in self.layout.layers}
        )
        self._reqs[rid] = req
        try:
            self.grow(rid, length, pages)
        except Exception:
            self.release(rid)
            raise
        return block

    def grow(self, rid: RequestId, length: int, pages: npt.ArrayLike = ()) -> None:
        """Append logical `pages` to the request and set its token count (tokens written or being written)."""
        req = self._req(rid)
        new = np.asarray(pages, dtype=np.int64).reshape(-1)
        if new.size and (int(new.min()) < 0 or int(new.max()) >= self.logical_pages):
            raise IndexError(
                f"request {rid!r}: logical pages {new.tolist()} outside the pool's pages 0..{self.logical_pages - 1}"
            )
        pages_all = np.concatenate((req.pages, new))
        if length < req.length or length > pages_all.size * self.page_size:
            raise ValueError(
                f"request {rid!r}: length {length} must be >= its current {req.length} and fit its "
                f"{pages_all.size} pages of {self.page_size} tokens"
            )
        req.pages, req.length = pages_all, length
        for res in req.layers.values():
            res.grow(pages_all.size * self.page_size)

    def release(self, rid: RequestId) -> None:
        """Free the request's hot block (its logical pages belong to the caller's allocator)."""
        req = self._reqs.pop(rid, None)
        if req is not None:
            self._free_blocks.append(req.block)
            self._free_blocks.sort()

    def load_newest(self, rid: RequestId) -> int:
        """Copy the tokens of the request's newest page that are already in the host KV (a prefix computed before
        it was admitted: a PD transfer, a shared prompt, a recompute) into its hot block; returns the tokens copied."""
        req = self._req(rid)
        if not req.length:
            return 0
        pos = np.arange(self._newest_start(req), req.length, dtype=np.int64)
        src = torch.from_numpy(req.pages[pos // self.page_size] * self.page_size + pos % self.page_size)
        dst = as_index(req.block * self.block_rows + self.buffer_size + pos % self.page_size, self.device)
        for layer in self.layout.layers:
            put(self.hot_tensor(layer), dst, take(self._host_rows(layer), src).to(self.device))
        return int(pos.size)

    def prepare(
        self, entries: Sequence[tuple[RequestId, npt.ArrayLike, int, int]], running: Iterable[RequestId]
    ) -> None:
        """Before a step: `entries` = (request id, its page ids in token order, chunk start, chunk end) per batch row.

        Requests admitted but neither in `running` nor in this step are released (finished, aborted, preempted).
        A row whose request is not admitted, or whose start / pages differ from what the pool holds (recomputed
        after a preemption), is (re)admitted with its first `start` tokens and its newest page loaded from the
        host; then every row grows to `end` tokens. Starts a step of stats; step_access() takes these rows."""
        self.begin_step()
        live = set(running) | {e[0] for e in entries}
        for rid in [r for r in self._reqs if r not in live]:
            self.release(rid)
        rids = []
        for rid, page_ids, start, end in entries:
            pages = np.asarray(page_ids, dtype=np.int64)[: ceil_div(end, self.page_size)]
            req = self._reqs.get(rid)
            if req is not None and (
                req.length != start
                or req.pages.size > pages.size
                or not np.array_equal(req.pages, pages[: req.pages.size])
            ):
                self.release(rid)
                req = None
            if req is None:
                self.admit(rid, pages[: ceil_div(start, self.page_size)], start)
                self.load_newest(rid)
            held = self._reqs[rid].pages.size
            self.grow(rid, end, pages[held:])
            rids.append(rid)
        self._step_rids = rids

    def step_access(
        self, extend_lens: torch.Tensor, positions: torch.Tensor, device: torch.device | None = None
    ) -> HiSparseStep:
        """The access a model step uses (StepContext.pool and .rows), for the rows `prepare` was given: new tokens
        per row `extend_lens` [B] and the position of every new token `positions` [T] (ForwardBatch's)."""
        rids = getattr(self, "_step_rids", None)
        if rids is None or len(rids) != extend_lens.numel():
            raise ValueError(
                f"HiSparse step of {extend_lens.numel()} sequences but prepare() was given "
                f"{'none' if rids is None else len(rids)}: call prepare(entries, running) before each step"
            )
        return HiSparseStep(self, list(rids), extend_lens, positions, device or self.device)

    def _req(self, rid: RequestId) -> _Request:
        try:
            return self._reqs[rid]
        except KeyError:
            raise KeyError(f"request {rid!r} is not admitted to the HiSparse pool") from None

    def logical_slots(self, rid: RequestId, positions: torch.Tensor) -> torch.Tensor:
        """Logical token slots (page * page_size + offset) of a request's positions."""
        req = self._req(rid)
        pos = positions.to("cpu", torch.int64).numpy()
        if pos.size and (int(pos.min()) < 0 or int(pos.max()) >= req.pages.size * self.page_size):
            raise IndexError(f"request {rid!r}: positions {pos.min()}..{pos.max()} outside its {req.pages.size} pages")
        return torch.from_numpy(req.pages[pos // self.page_size] * self.page_size + pos % self.page_size)

    def _newest_start(self, req: _Request) -> int:
        return (req.length - 1) // self.page_size * self.page_size if req.length else 0

    # ---- writes ------------------------------------------------------------------------------

    def store_kv(self, layer: int, rid: RequestId, positions: torch.Tensor, values: torch.Tensor) -> None:
        """KV of tokens at `positions` of layer: to the host (backup), and the newest page's to the hot buffer."""
        req = self._req(rid)
        pos = positions.to("cpu", torch.int64)
        self.kv_codec.write(self.host_tensor(layer), self.logical_slots(rid, pos), values.cpu(), self.page_size)
        newest = pos >= self._newest_start(req)
        if bool(newest.any()):
            rows = req.block * self.block_rows + self.buffer_size + pos[newest] % self.page_size
            self.kv_codec.write(self.hot_tensor(layer), rows, values[newest.to(values.device)], 1)

    def store_index(self, layer: int, rid: RequestId, positions: torch.Tensor, values: torch.Tensor) -> None:
        """Index-K of tokens at `positions` of a producer layer, into the device index-K at their logical slots."""
        buf = self.index_tensor(layer)
        assert self.index_codec is not None
        self.index_codec.write(buf, self.logical_slots(rid, positions), values.to(buf.device), self.page_size)

    # ---- swap-in -------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start a decode step: per-step stats restart."""
        self.stats.step = {}
        self.stats.steps += 1

    def swap_in(self, producer: int, topk: Mapping[RequestId, torch.Tensor]) -> dict[int, int]:
        """Make the top-k positions of every request resident for `producer` and each layer reusing its top-k.

        `topk[rid]` holds positions, any shape ([k], or [num_new, k] for several query tokens: their union is
        made resident); each < the request's length; -1 is padding and ignored. Returns rows swapped in per
        layer of the group, this call.
        """
        if producer not in self.groups or self.spec.producer_of(producer) != producer:
            owner = self.spec.producer_of(producer)
            raise ValueError(
                f"layer {producer} is not a producer of this layout's layers: it reuses the top-k of layer {owner}; "
                f"call swap_in with layer {owner}'s top-k"
            )
        self._clock += 1
        clock = self._clock
        wanted: dict[RequestId, np.ndarray] = {}  # checked for every request before anything changes
        for rid, t in topk.items():
            req = self._req(rid)
            pos = t.to("cpu", torch.int64).numpy().reshape(-1)
            pos = np.unique(pos[pos >= 0])  # the union over the request's query tokens, ascending
            if pos.size and int(pos.max()) >= req.length:
                raise IndexError(
                    f"request {rid!r}: top-k position {int(pos.max())} >= its length {req.length} (layer {producer})"
                )
            outside = int((pos < self._newest_start(req)).sum())
            if outside > self.buffer_size:
                raise CapacityError(
                    f"request {rid!r}, layer {producer}: the top-k needs {outside} rows outside the newest page but "
                    f"device_buffer_size is {self.buffer_size}: raise device_buffer_size to at least the top-k"
                )
            wanted[rid] = pos
        out: dict[int, int] = {}
        for layer in self.groups[producer]:
            src_parts, dst_parts = [], []
            lookups = hits = 0
            for rid, pos in wanted.items():
                req = self._reqs[rid]
                res = req.layers[layer]
                base = req.block * self.block_rows
                newest = pos >= self._newest_start(req)
                slots = res.pos_slot[pos]
                hit = newest | (slots >= 0)
                miss_pos = pos[~hit]
                lookups += pos.size
                hits += int(hit.sum())
                # victims: LRU slots not used by this top-k, empty first, then least recently used, then lowest slot
                protected = np.zeros(self.buffer_size, dtype=bool)
                protected[slots[~newest & hit]] = True
                cand = np.flatnonzero(~protected)
                order = np.lexsort((cand, res.last_used[cand]))
                victims = cand[order[: miss_pos.size]]
                old = res.slot_pos[victims]
                res.pos_slot[old[old >= 0]] = -1
                res.slot_pos[victims] = miss_pos
                res.pos_slot[miss_pos] = victims
                res.last_used[slots[~newest & hit]] = clock
                res.last_used[victims] = clock
                rows = np.where(newest, self.buffer_size + pos % self.page_size, res.pos_slot[pos])
                res.rows, res.positions = rows, pos
                if miss_pos.size:
                    src_parts.append(req.pages[miss_pos // self.page_size] * self.page_size + miss_pos % self.page_size)
                    dst_parts.append(base + victims)
            n = sum(p.size for p in src_parts)
            if n:
                src = torch.from_numpy(np.concatenate(src_parts))
                dst = as_index(np.concatenate(dst_parts), self.device)
                put(self.hot_tensor(layer), dst, take(self._host_rows(layer), src).to(self.device, non_blocking=True))
            self.stats.add(layer, lookups, hits, n, n * self.kv_row_bytes)
            out[layer] = n
        return out

    # ---- reads ---------------------------------------------------------------------------------------

    def rows(self, layer: int, rid: RequestId) -> torch.Tensor:
        """Hot-buffer rows (absolute) of the last top-k made resident for `layer`, by ascending position."""
        req = self._req(rid)
        return as_index(req.block * self.block_rows + req.layers[layer].rows, self.device)

    def rows_for(self, layer: int, rid: RequestId, sel: torch.Tensor) -> torch.Tensor:
        """Hot rows (absolute) of the positions `sel` (any shape, -1 padding -> -1), all resident for `layer`."""
        req = self._req(rid)
        res = req.layers[layer]
        pos = sel.to("cpu", torch.int64).numpy()
        idx = np.searchsorted(res.positions, np.where(pos >= 0, pos, 0))
        idx = np.minimum(idx, max(res.positions.size - 1, 0))
        ok = (pos < 0) | ((res.positions.size > 0) & (res.positions[idx] == pos))
        if not bool(ok.all()):
            missing = np.unique(pos[~ok]).tolist()
            raise KeyError(
                f"request {rid!r}, layer {layer}: positions {missing} are not resident; call swap_in with the "
                f"top-k of layer {self.spec.producer_of(layer)} first"
            )
        rows = np.where(pos >= 0, req.block * self.block_rows + res.rows[idx] if res.rows.size else -1, -1)
        return as_index(rows, self.device)

    def positions(self, layer: int, rid: RequestId) -> torch.Tensor:
        """The top-k positions `rows(layer, rid)` holds (the producer's top-k for a shared layer)."""
        return torch.from_numpy(self._req(rid).layers[layer].positions.copy())

    def read_kv(self, layer: int, rid: RequestId) -> torch.Tensor:
        """Float32 KV [k, kv_lora_rank + rope_dim] of the last top-k of `layer`, read from the hot buffer."""
        return self.kv_codec.read(self.hot_tensor(layer), self.rows(layer, rid), 1)

    def read_host_kv(self, layer: int, rid: RequestId, positions: torch.Tensor) -> torch.Tensor:
        """Float32 KV of positions read from the host pool (the reference a hot read must equal)."""
        return self.kv_codec.read(self.host_tensor(layer), self.logical_slots(rid, positions), self.page_size)

    def resident(self, layer: int, rid: RequestId) -> dict[int, int]:
        """{position: LRU slot} of the request's resident rows for `layer` (newest page not included)."""
        res = self._req(rid).layers[layer]
        return {int(p): int(s) for s, p in enumerate(res.slot_pos) if p >= 0}


class HiSparseStep:
    """One model step on a HiSparsePool: PoolAccess's write/read by logical slot, and the attention row source.

    write(KV): host rows at the logical slots, and the newest page's tokens into their request's hot block.
    write/read(INDEX_K): the device index-K at the logical slots. read(KV): the host rows (prefill tokens, the
    expanded path). on_topk / read_selected: the hot buffer, for the step's one-token (decode) rows on the
    absorbed path; a shared layer never swaps in (its producer's on_topk did, for its whole group)."""

    def __init__(
        self,
        pool: HiSparsePool,
        rids: list[RequestId],
        extend_lens: torch.Tensor,
        positions: torch.Tensor,
        device: torch.device,
    ) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        self.rids = rids
        self.device = device
        ext = extend_lens.to("cpu", torch.int64).numpy()
        pos = positions.to("cpu", torch.int64).numpy()
        reqs = [pool._req(r) for r in rids]
        self.tok_row = np.repeat(np.arange(len(rids)), ext)
        blocks = np.array([r.block for r in reqs], dtype=np.int64)
        newest = np.array([pool._newest_start(r) for r in reqs], dtype=np.int64)
        is_new = pos >= newest[self.tok_row]
        rows = blocks[self.tok_row] * pool.block_rows + pool.buffer_size + pos % pool.page_size
        self.hot_dst = as_index(rows[is_new], device)
        self.hot_src = torch.from_numpy(np.flatnonzero(is_new)).to(device)
        self.all_new = bool(is_new.all())
        self.first = np.cumsum(ext) - ext  # first token of each row
        self.hot_rows_of = np.flatnonzero(ext == 1)  # batch rows served from the hot buffer
        self.tok_hot = (ext == 1)[self.tok_row]  # per token
        hot_j = np.full(len(rids), -1, dtype=np.int64)
        hot_j[self.hot_rows_of] = np.arange(self.hot_rows_of.size)
        self.hot_j = hot_j[self.tok_row]  # per token: its row among the decode rows (-1: not one)
        self.swapped = False
        self._tables: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (positions, hot rows)

    def codec(self, kind: Kind) -> Any:
        return self.pool.kv_codec if kind is Kind.KV else self.pool.index_codec

    def write(self, key: BufferKey, slots: torch.Tensor, values: torch.Tensor) -> None:
        p = self.pool
        if key.kind is Kind.INDEX_K:
            buf = p.index_tensor(key.layer)
            assert p.index_codec is not None
            p.index_codec.write(buf, slots.to(buf.device), values.to(buf.device), self.page_size)
            return
        p.kv_codec.write(p.host_tensor(key.layer), slots.to("cpu"), values.to("cpu"), self.page_size)
        if self.hot_dst.numel():
            hot = p.hot_tensor(key.layer)
            vals = values if self.all_new else values.index_select(0, self.hot_src.to(values.device))
            p.kv_codec.write(hot, self.hot_dst, vals.to(hot.device), 1)

    def read(self, key: BufferKey, slots: torch.Tensor) -> torch.Tensor:
        p = self.pool
        if key.kind is Kind.INDEX_K:
            buf = p.index_tensor(key.layer)
            assert p.index_codec is not None
            return p.index_codec.read(buf, slots.to(buf.device), self.page_size)
        out = p.kv_codec.read(p.host_tensor(key.layer), slots.to("cpu"), self.page_size)
        return out.to(self.device, non_blocking=True)

    # ---- the attention row source (dsakv.model.attention.RowSource) --------------------------------------------

    def on_topk(self, producer: int, topk: torch.Tensor, mla_path: str) -> None:
        """A producer's top-k [T, index_topk] (ascending, -1 padded): swap in the missing rows of its group for the
        decode rows, and keep per layer of the group those rows' hot-row table [decode rows, index_topk]."""
        self.swapped = mla_path == "absorbed" and self.hot_rows_of.size > 0
        if not self.swapped:
            return
        p = self.pool
        sel = topk.to("cpu")[torch.from_numpy(self.first[self.hot_rows_of])]  # [decode rows, index_topk]
        rids = [self.rids[b] for b in self.hot_rows_of]
        p.swap_in(producer, {rid: sel[j] for j, rid in enumerate(rids)})
        valid = (sel >= 0).numpy()
        for layer in p.groups[producer]:
            table = np.zeros(sel.shape, dtype=np.int64)  # padding reads row 0 (masked by attention)
            for j, rid in enumerate(rids):
                req = p._reqs[rid]
                table[j, valid[j]] = req.block * p.block_rows + req.layers[layer].rows
            self._tables[layer] = (sel.to(self.device), as_index(table, p.device))

    def read_selected(
        self, layer: int, sel: torch.Tensor, valid: torch.Tensor, table: torch.Tensor, tok_seq: torch.Tensor, q0: int
    ) -> torch.Tensor:
        """Float32 KV rows [E x k, r + d] of tokens q0..q0+E's selected positions `sel` [E, k] (`valid` false:
        padding, any row): hot rows for the step's decode tokens, host rows (slot table) for the others. A decode
        token's picks must be the top-k its layer's group swapped in (its producer's), else ValueError."""
        p = self.pool
        e, k = sel.shape
        hot = self.tok_hot[q0 : q0 + e] if self.swapped else np.zeros(e, dtype=bool)
        parts: list[tuple[np.ndarray, torch.Tensor]] = []
        if hot.any():
            idx = np.flatnonzero(hot)
            it = torch.from_numpy(idx).to(sel.device)
            j = torch.from_numpy(self.hot_j[q0 + idx]).to(self.device)
            got = self._tables.get(layer)
            picks = torch.where(valid, sel, -1)[it]
            if got is None or not torch.equal(picks, got[0][j, :k]):
                raise ValueError(
                    f"layer {layer}: the decode rows select positions its group's swap-in (the top-k of layer "
                    f"{p.spec.producer_of(layer)}) did not make resident"
                )
            rows = got[1][j.to(got[1].device), :k]
            vals = p.kv_codec.read(p.hot_tensor(layer), rows.reshape(-1), 1)
            parts.append((idx, vals.to(self.device)))
        if not hot.all():
            idx = np.flatnonzero(~hot)
            it = torch.from_numpy(idx).to(sel.device)
            slots = table[tok_seq[q0 + it, None], sel[it]]
            parts.append((idx, self.read(BufferKey(layer, Kind.KV), slots.reshape(-1))))
        if len(parts) == 1:
            return parts[0][1]
        width = parts[0][1].shape[-1]
        out = torch.empty((e, k, width), dtype=parts[0][1].dtype, device=self.device)
        for idx, vals in parts:
            out[torch.from_numpy(idx).to(self.device)] = vals.view(idx.size, k, width)
        return out.view(e * k, width)
