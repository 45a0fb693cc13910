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
Imports torch and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

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
