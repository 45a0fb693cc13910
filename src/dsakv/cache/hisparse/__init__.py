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

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.device_pool import Region
from dsakv.cache.hisparse.residency import Residency
from dsakv.cache.hisparse.rows import RequestId, SwapRows, _Request, _row_dtype, _StepRows
from dsakv.cache.hisparse.stats import HiSparseStats, LayerStats
from dsakv.cache.hisparse.step import HiSparseStep
from dsakv.cache.kv_access import codec_for
from dsakv.cache.page_copy import as_index, put, take
from dsakv.errors import CapacityError, ConfigError
from dsakv.spec.layout import BufferKey, Kind, KVLayout
from dsakv.util import ceil_div

__all__ = ["HiSparsePool", "HiSparseStats", "HiSparseStep", "LayerStats", "RequestId", "SwapRows"]


class HiSparsePool(Residency):
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
        self.stats = HiSparseStats()
        # layer groups: producer -> [producer, shared layers reusing its top-k], over this layout's layers
        self.groups: dict[int, tuple[int, ...]] = {}
        for layer in layout.layers:
            self.groups.setdefault(self.spec.producer_of(layer), ())
            self.groups[self.spec.producer_of(layer)] += (layer,)
        self.producer_of = {layer: p for p, group in self.groups.items() for layer in group}
        self._gidx = {p: g for g, p in enumerate(self.groups)}
        # Residency, one table per producer group (every layer of a group is given the same top-k at the same
        # steps, so its layers' hot rows always hold the same positions), by hot block, on the device:
        #   state [G, blocks, 2, S + P + 1] int32: [0] the logical position each row of the block holds (EMPTY
        #   = -2, empty), [1] the clock (the group's swap-in count) of the swap-in that last hit or filled it (-1
        #   never). Columns are the block's rows: buffer_size LRU slots, page_size newest-page rows, then one
        #   scratch column that padding entries of a top-k write to (so every swap-in of a block sets its newest
        #   clock: its rows with that clock are the last top-k).
        g, dev = len(self.groups), self.device
        self._state = torch.full((g, max_requests, 2, self.block_rows + 1), -1, dtype=torch.int32, device=dev)
        self._state[:, :, 0] = self.EMPTY
        self._clocks = [0] * g  # per group: its swap-ins, in order
        # the state of one step's blocks, all groups ([G, D, 2, S + P + 1]), that swap_rows works on in place (one
        # gather for the step's 5-ish group swap-ins, not one per group); written back by _flush() before anything
        # else reads or changes the state (the next step's rows, admit, a reader, a clock rebase)
        self._work: tuple[SwapRows, torch.Tensor] | None = None
        self._cols = torch.arange(buffer_size, device=dev)
        # row views every copy, read and write goes through: [rows, row bytes] as float32 for the fp32 formats
        # (no encoding), else as the widest words the row bytes allow (fp8 / bf16 formats: int64)
        self._kv_dtype = _row_dtype(self.kv_codec)
        self._hot_words = {k.layer: t.view(self._kv_dtype) for k, t in self._hot.items()}
        self._host_words = {
            k.layer: t.view(logical_pages * self.page_size, self.kv_row_bytes).view(self._kv_dtype)
            for k, t in self._host.items()
        }
        self._index_words: dict[int, torch.Tensor] = {}  # single-segment index formats, rows by logical slot
        if self.index_codec is not None and len(self.index_codec.segments) == 1:
            iw = self.index_codec.bytes_per_token
            self._index_words = {
                k.layer: t.view(logical_pages * self.page_size, iw).view(_row_dtype(self.index_codec))
                for k, t in self._index.items()
            }
        self._step: _StepRows | None = None

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
        """Give request `rid` a hot block (its residency cleared) and its logical pages; returns the block id."""
        if rid in self._reqs:
            raise ValueError(f"request {rid!r} is already admitted to the HiSparse pool")
        if not self._free_blocks:
            raise CapacityError(
                f"no free HiSparse hot buffer for request {rid!r}: all {self.max_requests} buffers of "
                f"{self.block_rows} rows per layer are in use; finish a request or raise the device budget"
            )
        block = self._free_blocks.pop(0)
        self._reqs[rid] = _Request(block, np.zeros(0, dtype=np.int64), 0)
        self._flush()
        self._state[:, block] = -1
        self._state[:, block, 0] = self.EMPTY
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
        pages_all = np.concatenate((req.pages, new)) if new.size else req.pages
        if length < req.length or length > pages_all.size * self.page_size:
            raise ValueError(
                f"request {rid!r}: length {length} must be >= its current {req.length} and fit its "
                f"{pages_all.size} pages of {self.page_size} tokens"
            )
        req.pages, req.length = pages_all, length

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
        self, entries: Sequence[tuple[RequestId, Sequence[int], int, int]], running: Iterable[RequestId]
    ) -> dict[int, Exception]:
        """Before a step: `entries` = (request id, its page ids in token order, chunk start, chunk end) per batch row.

        Requests admitted but neither in `running` nor in this step are released (finished, aborted, preempted).
        A row whose request is not admitted, or whose start / last held page differ from what the pool holds
        (recomputed after a preemption), is (re)admitted with its first `start` tokens and its newest page loaded
        from the host; then every row grows to `end` tokens. Starts a step of stats; step_access() takes these rows.

        A row that cannot be admitted or grown (no free hot buffer: CapacityError; pages outside the pool) is
        released and left out of the step: the failures are returned by row index, the step is the other rows."""
        self.begin_step()
        self._flush()
        live = set(running)
        live.update(e[0] for e in entries)
        for rid in [r for r in self._reqs if r not in live]:
            self.release(rid)
        rids: list[RequestId] = []
        blocks: list[int] = []
        lengths: list[int] = []
        page_lists = []
        failed: dict[int, Exception] = {}
        for i, (rid, page_ids, start, end) in enumerate(entries):
            try:
                req = self._prepare_row(rid, page_ids, start, end)
            except (CapacityError, IndexError, ValueError) as e:
                self.release(rid)
                failed[i] = e
                continue
            rids.append(rid)
            blocks.append(req.block)
            lengths.append(end)
            page_lists.append(req.pages)
        table = np.full((len(rids), max((p.size for p in page_lists), default=0)), -1, dtype=np.int64)
        for i, p in enumerate(page_lists):
            table[i, : p.size] = p
        self._step = _StepRows(rids, np.asarray(blocks, dtype=np.int64), np.asarray(lengths, dtype=np.int64), table)
        return failed

    def _prepare_row(self, rid: RequestId, page_ids: Sequence[int], start: int, end: int) -> _Request:
        need = ceil_div(end, self.page_size)
        req = self._reqs.get(rid)
        if req is not None:
            held = req.pages.size
            # the same request, one chunk on: its length and pages are the ones held (else recomputed after
            # a preemption, on other pages: start again); the held pages compared by their last one
            if req.length != start or held > need or (held and int(page_ids[held - 1]) != int(req.pages[-1])):
                self.release(rid)
                req = None
        if req is None:
            pages = np.asarray(page_ids[:need], dtype=np.int64)
            self.admit(rid, pages[: ceil_div(start, self.page_size)], start)
            self.load_newest(rid)
            req = self._reqs[rid]
        held = req.pages.size
        self.grow(rid, end, page_ids[held:need] if need > held else ())
        return req

    def step_access(
        self, extend_lens: torch.Tensor, positions: torch.Tensor, device: torch.device | None = None
    ) -> HiSparseStep:
        """The access a model step uses (StepContext.pool and .rows), for the rows `prepare` was given: new tokens
        per row `extend_lens` [B] and the position of every new token `positions` [T] (ForwardBatch's)."""
        rows = self._step
        if rows is None or len(rows.rids) != extend_lens.numel():
            raise ValueError(
                f"HiSparse step of {extend_lens.numel()} sequences but prepare() was given "
                f"{'none' if rows is None else len(rows.rids)}: call prepare(entries, running) before each step"
            )
        return HiSparseStep(self, rows, extend_lens, positions, device or self.device)

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
