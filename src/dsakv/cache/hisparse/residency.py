"""HiSparse residency: per request and producer group, the logical positions its hot block holds and their
last-used clocks; swap-in of a step's missing top-k rows host -> device (LRU, all requests at once); the reads
of resident rows (dsakv.cache.hisparse composes it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dsakv.cache.hisparse.rows import RequestId, SwapRows, _decode_rows, _Request
from dsakv.cache.hisparse.stats import HiSparseStats
from dsakv.cache.page_copy import as_index
from dsakv.errors import CapacityError
from dsakv.spec.layout import KVLayout


class Residency:
    """The residency half of HiSparsePool (a mixin; HiSparsePool holds the state): which logical positions each
    request's hot block holds per producer group, swap-in of the missing top-k rows (LRU), and the reads."""

    spec: Any
    layout: KVLayout
    page_size: int
    buffer_size: int
    block_rows: int
    device: torch.device
    kv_codec: Any
    index_codec: Any
    kv_row_bytes: int
    stats: HiSparseStats
    groups: dict[int, tuple[int, ...]]
    producer_of: dict[int, int]
    _gidx: dict[int, int]
    _state: torch.Tensor
    _clocks: list[int]
    _reqs: dict[RequestId, _Request]
    _work: tuple[SwapRows, torch.Tensor] | None
    _cols: torch.Tensor
    _hot_words: dict[int, torch.Tensor]
    _host_words: dict[int, torch.Tensor]
    _index_words: dict[int, torch.Tensor]

    if TYPE_CHECKING:  # HiSparsePool's own, used here

        def _req(self, rid: RequestId) -> _Request: ...

        def hot_tensor(self, layer: int) -> torch.Tensor: ...

        def index_tensor(self, layer: int) -> torch.Tensor: ...

        def host_tensor(self, layer: int) -> torch.Tensor: ...

        def logical_slots(self, rid: RequestId, positions: torch.Tensor) -> torch.Tensor: ...

    # ---- swap-in -------------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Start a decode step: per-step stats restart."""
        self.stats.step = {}
        self.stats.steps += 1

    def _check_producer(self, producer: int) -> None:
        if producer not in self.groups or self.spec.producer_of(producer) != producer:
            owner = self.spec.producer_of(producer)
            raise ValueError(
                f"layer {producer} is not a producer of this layout's layers: it reuses the top-k of layer {owner}; "
                f"call swap_in with layer {owner}'s top-k"
            )

    def swap_in(self, producer: int, topk: Mapping[RequestId, torch.Tensor]) -> dict[int, int]:
        """Make the top-k positions of every request resident for `producer` and each layer reusing its top-k.

        `topk[rid]` holds positions, any shape ([k], or [num_new, k] for several query tokens: their union is
        made resident); each < the request's length; -1 is padding and ignored. Returns rows swapped in per
        layer of the group, this call. (The per-request form of swap_rows, which a model step calls.)
        """
        self._check_producer(producer)
        rids = list(topk)
        reqs = [self._req(rid) for rid in rids]
        wanted = []
        for t in topk.values():
            pos = t.reshape(-1).to(self.device, torch.int64)
            wanted.append(torch.unique(pos[pos >= 0]))  # the union over the request's query tokens, ascending
        pos = torch.full((len(rids), max((w.numel() for w in wanted), default=0)), -1, dtype=torch.int64)
        pos = pos.to(self.device)
        for i, w in enumerate(wanted):
            pos[i, : w.numel()] = w
        pages = np.full((len(rids), max((r.pages.size for r in reqs), default=0)), -1, dtype=np.int64)
        for i, r in enumerate(reqs):
            pages[i, : r.pages.size] = r.pages
        rows = self.swap_rows_of(
            rids, np.array([r.block for r in reqs], dtype=np.int64), np.array([r.length for r in reqs]), pages
        )
        _, n = self.swap_rows(producer, rows, pos)
        self._flush()
        return {layer: n for layer in self.groups[producer]}

    def swap_rows_of(
        self, rids: Sequence[RequestId], blocks: np.ndarray, lengths: np.ndarray, pages: np.ndarray
    ) -> SwapRows:
        """SwapRows for requests `rids` (hot blocks, token counts, padded page table), on the pool's device: the
        derived columns computed on the host, everything moved in one copy."""
        p, d = self.page_size, len(rids)
        blocks = np.asarray(blocks, dtype=np.int64).reshape(d)
        lengths = np.asarray(lengths, dtype=np.int64).reshape(d)
        pages = np.asarray(pages, dtype=np.int64)
        pages = pages.reshape(d, pages.size // d if d else 0)
        newest = np.maximum(lengths - 1, 0) // p * p
        packed = np.concatenate(
            (
                np.stack((blocks, lengths, newest, newest - self.block_rows + p, blocks * self.block_rows), 1),
                pages,
                pages * p,
            ),
            axis=1,
        )
        t = torch.from_numpy(packed).to(self.device)
        m = pages.shape[1]
        return SwapRows(
            rids, t[:, 0], t[:, 1], t[:, 1:2], t[:, 5 : 5 + m], t[:, 2:3], t[:, 3:4], t[:, 4:5], t[:, 5 + m :]
        )

    # The position an empty row holds: below -1 (a top-k's padding), so that no entry of a top-k matches it.
    EMPTY = -2
    # Up to this many [D, K, S] elements, hits are found by one broadcast compare; beyond, by a batched
    # searchsorted over each block's sorted slots (fewer ops against O(D K log S) work).
    BROADCAST_ELEMS = 1 << 18
    # A group's clock is int32: past CLOCK_LIMIT swap-ins its clocks shift down by CLOCK_LIMIT - CLOCK_WINDOW (rows
    # last used more than CLOCK_WINDOW swap-ins ago then tie as the oldest, lowest slot first).
    CLOCK_LIMIT = (1 << 31) - 2
    CLOCK_WINDOW = 1 << 30

    def swap_rows(self, producer: int, rows: SwapRows, pos: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The swap-in of one producer group for D requests at once, vectorised (no loop over requests or rows).

        pos [D, K] (int64, the pool's device): each request's top-k positions in `rows` order, -1 padding, no
        position twice in a row. Positions in a request's newest page are hits (its hot newest page); the others
        are looked up in the group's LRU slots of its block; each miss takes the least recently used slot not hit
        by this top-k (empty first, then the lowest slot), misses in row-major order. The missing rows are then
        copied host -> device with one index_select and one index_copy_ per layer of the group. Checked before
        anything changes (one device -> host sync, with the counts): every position < its request's length, and
        at most device_buffer_size positions outside the newest page.
        Returns (hot rows [D, K]: each position's absolute row in the hot buffer, padding: the block's first
        row; rows swapped in per layer of the group)."""
        g = self._gidx.get(producer)
        if g is None:
            self._check_producer(producer)
        assert g is not None
        if self._clocks[g] >= self.CLOCK_LIMIT:
            self._rebase_clock(g)
        self._clocks[g] += 1
        clock = self._clocks[g]
        size, page, scratch = self.buffer_size, self.page_size, self.block_rows
        d, k = pos.shape
        if not d or not k:
            self.stats.add_group(self.groups[producer], 0, 0, 0, 0)
            return rows.base + torch.zeros_like(pos), 0
        work = self._work
        if work is None or work[0] is not rows:  # a new step's rows: one working copy of all groups' state
            self._flush()
            work = self._work = (rows, self._state.index_select(1, rows.blocks))
        state = work[1][g]  # [D, 2, S + P + 1], changed in place
        slot_pos, last_used = state[:, 0], state[:, 1]
        pos32 = pos.to(torch.int32)
        valid = pos >= 0
        new = pos >= rows.newest  # in the newest page (hits of its hot rows), never in an LRU slot
        lru = valid ^ new
        if d * k * size <= self.BROADCAST_ELEMS:
            # an LRU slot holds a position < the newest page's start (or EMPTY, which no entry equals): a match is
            # a hit of an LRU entry
            hit, hit_slot = (pos32[:, :, None] == slot_pos[:, None, :size]).max(dim=2)
        else:
            ordered, perm = slot_pos[:, :size].sort(dim=1)
            at = torch.searchsorted(ordered, pos32.contiguous()).clamp_(max=size - 1)
            hit = lru & (ordered.gather(1, at) == pos32)
            hit_slot = perm.gather(1, at)
        miss = lru ^ hit
        nmiss = miss.sum(1)
        checks = [(pos - rows.lengths_col).amax(), valid.sum(), nmiss.sum()]
        if k > size:  # only then can a row need more than size slots (a model step's top-k is <= the buffer)
            checks.append(lru.sum(1).max())
        over, lookups, n, *most = torch.stack(checks).tolist()
        if over >= 0 or (most and most[0] > size):
            need = lru.sum(1)
            i = int(((need > size) | (pos.amax(1) >= rows.lengths)).nonzero()[0, 0])
            rid, length = rows.rids[i], int(rows.lengths[i])
            if int(pos[i].max()) >= length:
                raise IndexError(
                    f"request {rid!r}: top-k position {int(pos[i].max())} >= its length {length} (layer {producer})"
                )
            raise CapacityError(
                f"request {rid!r}, layer {producer}: the top-k needs {int(need[i])} rows outside the newest page "
                f"but device_buffer_size is {size}: raise device_buffer_size to at least the top-k"
            )
        hit_or_scratch = torch.where(hit, hit_slot, scratch)
        slot = torch.where(new, pos - rows.newest_shift, hit_or_scratch)
        if n:
            # victims: per row the LRU slots by (last used, slot); this top-k's hits, marked with the newest clock,
            # sort last and are never taken (a row's misses <= its free + unhit slots); row j takes nmiss[j]
            last_used.scatter_(1, hit_or_scratch, clock)
            order = last_used[:, :size].sort(dim=1, stable=True).indices
            slot.masked_scatter_(miss, order[self._cols < nmiss[:, None]])  # row-major, as miss.nonzero()
        slot_pos.scatter_(1, slot, pos32)  # hits rewrite their own position; padding writes the scratch column
        last_used.scatter_(1, slot, clock)
        hot = rows.base + torch.where(valid, slot, 0)
        group = self.groups[producer]
        if n:
            at = miss.view(-1).nonzero().view(-1)  # the misses, row-major
            src = (rows.page_starts.gather(1, pos.clamp(min=0) // page) + pos % page).view(-1).index_select(0, at)
            src = src.cpu()
            dst = hot.view(-1).index_select(0, at)
            for layer in group:
                self._copy_in(layer, dst, src)
        self.stats.add_group(group, lookups, lookups - n, n, n * self.kv_row_bytes)
        return hot, n

    def _flush(self) -> None:
        """Write the step's working copy of the state back (see _work)."""
        if self._work is not None:
            rows, work = self._work
            self._work = None
            self._state.index_copy_(1, rows.blocks, work)

    def residency_digest(self) -> str:
        """16 hex digits over the residency after the last step: every group's and block's logical position per
        hot row and its last-used clock, the groups' clocks, each admitted request's block, length and pages
        (the TP ranks of one group compare it after every step: engine/tp_spec.py). Reads the state once."""
        import hashlib

        self._flush()
        h = hashlib.sha1(self._state.cpu().numpy().tobytes())
        h.update(repr(self._clocks).encode())
        for rid in sorted(self._reqs, key=str):
            req = self._reqs[rid]
            h.update(repr((str(rid), req.block, req.length)).encode())
            h.update(req.pages.tobytes())
        return h.hexdigest()[:16]

    def _rebase_clock(self, g: int) -> None:
        self._flush()
        shift = self.CLOCK_LIMIT - self.CLOCK_WINDOW
        used = self._state[g, :, 1]
        used.copy_(torch.where(used >= 0, (used - shift).clamp(min=0), -1))
        self._clocks[g] -= shift

    def _words(self, table: dict[int, torch.Tensor], layer: int, get: Any) -> torch.Tensor:
        words = table.get(layer)
        if words is None:
            get(layer)  # raises the KeyError naming the layer and kind
            raise AssertionError(f"layer {layer}: no row view")  # pragma: no cover
        return words

    def read_hot(self, layer: int, rows: torch.Tensor) -> torch.Tensor:
        """Float32 KV of absolute hot rows `rows` (device index) of `layer`: one gather of whole rows, decoded."""
        words = self._words(self._hot_words, layer, self.hot_tensor)
        return _decode_rows(self.kv_codec, words.index_select(0, rows))

    def read_host(self, layer: int, slots: torch.Tensor) -> torch.Tensor:
        """Float32 KV of logical token slots `slots` (CPU index) of `layer`, from the host rows."""
        words = self._words(self._host_words, layer, self.host_tensor)
        return _decode_rows(self.kv_codec, words.index_select(0, slots))

    def _copy_in(self, layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Hot rows `dst` (device index) of `layer` = its host rows `src` (CPU index): one gather on the host, one
        host -> device copy, one index_copy_ on the device."""
        host, hot = self._host_words[layer], self._hot_words[layer]
        hot.index_copy_(0, dst, host.index_select(0, src).to(hot.device, non_blocking=True))

    # ---- reads ---------------------------------------------------------------------------------------

    def _group_block(self, layer: int, rid: RequestId) -> tuple[int, int]:
        req = self._req(rid)
        if layer not in self.producer_of:
            raise KeyError(f"layer {layer} is not one of this HiSparse pool's layers {list(self.layout.layers)}")
        return self._gidx[self.producer_of[layer]], req.block

    def _last_topk(self, layer: int, rid: RequestId) -> tuple[np.ndarray, np.ndarray]:
        """(positions, block-relative hot rows) of the last top-k made resident for `layer`, by ascending position:
        the rows (LRU slots and newest-page rows) its group's last swap-in for the request hit or filled (those
        with the block's newest clock)."""
        g, b = self._group_block(layer, rid)
        self._flush()
        slot_pos, used = self._state[g, b].cpu().numpy()
        clock = used.max()
        rows = np.flatnonzero(used[: self.block_rows] == clock) if clock >= 0 else np.zeros(0, dtype=np.int64)
        pos = slot_pos[rows]
        order = np.argsort(pos, kind="stable")
        return pos[order], rows[order]

    def rows(self, layer: int, rid: RequestId) -> torch.Tensor:
        """Hot-buffer rows (absolute) of the last top-k made resident for `layer`, by ascending position."""
        _, rows = self._last_topk(layer, rid)
        return as_index(self._req(rid).block * self.block_rows + rows, self.device)

    def rows_for(self, layer: int, rid: RequestId, sel: torch.Tensor) -> torch.Tensor:
        """Hot rows (absolute) of the positions `sel` (any shape, -1 padding -> -1), all resident for `layer`."""
        positions, rows = self._last_topk(layer, rid)
        pos = sel.to("cpu", torch.int64).numpy()
        idx = np.searchsorted(positions, np.where(pos >= 0, pos, 0))
        idx = np.minimum(idx, max(positions.size - 1, 0))
        ok = (pos < 0) | ((positions.size > 0) & (positions[idx] == pos))
        if not bool(ok.all()):
            missing = np.unique(pos[~ok]).tolist()
            raise KeyError(
                f"request {rid!r}, layer {layer}: positions {missing} are not resident; call swap_in with the "
                f"top-k of layer {self.spec.producer_of(layer)} first"
            )
        base = self._req(rid).block * self.block_rows
        out = np.where(pos >= 0, base + rows[idx] if rows.size else -1, -1)
        return as_index(out, self.device)

    def positions(self, layer: int, rid: RequestId) -> torch.Tensor:
        """The top-k positions `rows(layer, rid)` holds (the producer's top-k for a shared layer)."""
        return torch.from_numpy(self._last_topk(layer, rid)[0])

    def read_kv(self, layer: int, rid: RequestId) -> torch.Tensor:
        """Float32 KV [k, kv_lora_rank + rope_dim] of the last top-k of `layer`, read from the hot buffer."""
        return self.kv_codec.read(self.hot_tensor(layer), self.rows(layer, rid), 1)

    def read_host_kv(self, layer: int, rid: RequestId, positions: torch.Tensor) -> torch.Tensor:
        """Float32 KV of positions read from the host pool (the reference a hot read must equal)."""
        return self.kv_codec.read(self.host_tensor(layer), self.logical_slots(rid, positions), self.page_size)

    def resident(self, layer: int, rid: RequestId) -> dict[int, int]:
        """{position: LRU slot} of the request's resident rows for `layer` (newest page not included)."""
        g, b = self._group_block(layer, rid)
        self._flush()
        return {int(p): s for s, p in enumerate(self._state[g, b, 0, : self.buffer_size].tolist()) if p >= 0}
