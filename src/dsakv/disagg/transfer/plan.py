"""TransferPlan: page ids on both sides -> (src address, dst address, length) blocks, vectorised.

A request's pages are coalesced into runs where both the source and the
destination page ids are consecutive; each run becomes one block per paired
key. Everything is numpy over all keys and runs at once:

    src pages  [7, 8, 9, 3, 4]      runs (src, dst, pages): (7, 0, 3)  (3, 3, 2)
    dst pages  [0, 1, 2, 3, 4]      blocks = pairs x runs, key-major:
                                      src_addr[k, r] = src_base[k] + run_src[r] * page_bytes[k]
                                      dst_addr[k, r] = dst_base[k] + run_dst[r] * page_bytes[k]
                                      length[k, r]   = run_pages[r] * page_bytes[k]

A block can never be empty: a paired key has page_bytes > 0 and a run has >= 1
page. `Blocks.check()` asserts it anyway, and every backend calls it at its
boundary.

Strategy (per request, `choose_strategy`): BLOCKS sends the blocks above, one descriptor per joint run and key.
STAGED first gathers every source page into one registered staging buffer (dsakv.disagg.transfer.staging), key-major
and in request order, so the source side is one contiguous region; the blocks are then one per key and
*destination* run only (`TransferPlan.staged`). It pays when the source is fragmented and the destination
is not (prefix-cache hits and reused prefill pages vs a fresh decode allocation).

A fragmented *destination* is the decode's call (`choose_destination`, at prealloc): it grants a staging slot
(dsakv.disagg.transfer.staging.StagingSlots) and the sender plans into it (`TransferPlan.into_slot`: the slot is one
contiguous run per key, so one block per key and source run; gathered too, the blocks coalesce to one per
range of keys adjacent in both layouts, `Blocks.coalesce`); the decode scatters the slot into its pages. The
rules and their constants come from bench/transfer.py (see choose_strategy, choose_destination). Imports numpy,
spec and disagg.{compat, errors}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from dsakv.disagg.protocol.errors import TransferError
from dsakv.disagg.transfer.compat import KeyPair
from dsakv.spec.layout import MLA_KINDS, BufferKey, Kind

IntArray = npt.NDArray[np.int64]
_KINDS = tuple(Kind)


def _as_ids(name: str, ids: object) -> IntArray:
    arr = np.asarray(ids)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be a 1-D array of page ids, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integer page ids, got dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


@dataclass(frozen=True, eq=False)
class Blocks:
    """Parallel arrays of absolute source address, destination address and length (bytes), int64."""

    src: IntArray
    dst: IntArray
    length: IntArray

    def __post_init__(self) -> None:
        n = self.src.shape
        if self.src.ndim != 1 or self.dst.shape != n or self.length.shape != n:
            raise ValueError(
                f"blocks need three 1-D arrays of one length, got {self.src.shape}, {self.dst.shape}, "
                f"{self.length.shape}"
            )

    @classmethod
    def of(
        cls, src: Sequence[int] | IntArray, dst: Sequence[int] | IntArray, length: Sequence[int] | IntArray
    ) -> Blocks:
        return cls(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64), np.asarray(length, dtype=np.int64))

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def nbytes(self) -> int:
        return int(self.length.sum())

    def slice(self, start: int, stop: int) -> Blocks:
        return Blocks(self.src[start:stop], self.dst[start:stop], self.length[start:stop])

    def merge_starts(self) -> IntArray:
        """Indices of the blocks that do not continue the previous one on both sides (coalesce's run starts)."""
        if len(self) < 2:
            return np.zeros(len(self), dtype=np.int64)
        brk = (self.src[1:] != self.src[:-1] + self.length[:-1]) | (self.dst[1:] != self.dst[:-1] + self.length[:-1])
        return np.concatenate(([0], np.flatnonzero(brk) + 1)).astype(np.int64)

    def coalesce(self) -> Blocks:
        """Merge consecutive blocks that continue each other on both sides (same bytes, fewer descriptors)."""
        starts = self.merge_starts()
        if starts.size == len(self):
            return self
        return Blocks(self.src[starts], self.dst[starts], np.add.reduceat(self.length, starts).astype(np.int64))

    def batches(self, max_blocks: int) -> list[Blocks]:
        """Consecutive slices of at most `max_blocks` blocks (what one engine call accepts)."""
        if max_blocks < 1:
            raise ValueError(f"max_blocks = {max_blocks} must be >= 1")
        return [self.slice(i, i + max_blocks) for i in range(0, len(self), max_blocks)]

    def check(self, where: str = "transfer") -> None:
        """Raise TransferError if the list is empty or holds an empty block or a negative address."""
        if len(self) == 0:
            raise TransferError(f"{where}: no blocks to transfer (an empty plan is never submitted)")
        bad = np.flatnonzero(self.length <= 0)
        if bad.size:
            i = int(bad[0])
            raise TransferError(
                f"{where}: {bad.size} block(s) of length <= 0, first #{i} (src {int(self.src[i]):#x}, dst "
                f"{int(self.dst[i]):#x}, length {int(self.length[i])}): zero-length blocks are a planning bug and "
                "never reach the engine"
            )
        if (self.src < 0).any() or (self.dst < 0).any():
            raise TransferError(f"{where}: negative address in the block list")


@dataclass(frozen=True, eq=False)
class PairTable:
    """The paired keys as arrays (built once per peer at handshake, reused by every plan)."""

    pairs: tuple[KeyPair, ...]
    src_base: IntArray = field(repr=False)
    dst_base: IntArray = field(repr=False)
    page_bytes: IntArray = field(repr=False)
    src_pages: IntArray = field(repr=False)  # capacity (pages) of each source region
    dst_pages: IntArray = field(repr=False)
    kind: IntArray = field(repr=False)  # index into tuple(Kind)

    @classmethod
    def of(cls, pairs: Sequence[KeyPair] | PairTable) -> PairTable:
        if isinstance(pairs, PairTable):
            return pairs
        ps = tuple(pairs)
        if not ps:
            raise ValueError("a transfer plan needs at least one key pair (pair() returned none)")

        def col(values: list[int]) -> IntArray:
            return np.asarray(values, dtype=np.int64)

        return cls(
            ps,
            col([p.src.addr for p in ps]),
            col([p.dst.addr for p in ps]),
            col([p.page_bytes for p in ps]),
            col([p.src.num_pages for p in ps]),
            col([p.dst.num_pages for p in ps]),
            col([_KINDS.index(p.key.kind) for p in ps]),
        )

    def __len__(self) -> int:
        return len(self.pairs)

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return tuple(p.key for p in self.pairs)

    @property
    def bytes_per_page(self) -> int:
        return int(self.page_bytes.sum())


def contiguous_runs(src_pages: IntArray, dst_pages: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """Maximal runs where both page-id sequences step by +1: (run_src, run_dst, run_pages)."""
    n = src_pages.shape[0]
    step = (np.diff(src_pages) != 1) | (np.diff(dst_pages) != 1)
    starts = np.concatenate(([0], np.flatnonzero(step) + 1)).astype(np.int64)
    lengths = np.diff(np.concatenate((starts, [n]))).astype(np.int64)
    return src_pages[starts], dst_pages[starts], lengths


class Strategy(StrEnum):
    BLOCKS = "blocks"  # one descriptor per (key, joint source/destination run)
    STAGED = "staged"  # gather into a registered staging buffer, one descriptor per (key, destination run)


# Measured by bench/transfer.py (GLM-5.2 layout, 101 keys, over TCP on 127.0.0.1; bench/results/transfer.txt
# prints the fitted values of the same run): the extra time of one more descriptor, per backend, fitted as
# (fragmented - contiguous) / (extra blocks), and the gather copy's rate (numpy take into the staging buffer).
# Each is the median of the fits of five 32K runs over sessions 3 and 4 on a shared 2-core host (load 2-9; the
# single fits scatter widely, nixl's from -4 to 27 us): mooncake 25 us (fits 22-31, one outlier 89), nixl 9 us
# (median 9.4 of -3.8, 7.3, 8.3, 9.0, 9.7, 11.0, 22.4, 26.9), gather 5.1 GB/s (3.8-6.1), scatter 5.4 GB/s (4.7-7.0).
DESCRIPTOR_COST_S: dict[str, float] = {"mooncake": 25e-6, "nixl": 9e-6, "local": 1e-6}
DEFAULT_DESCRIPTOR_COST_S = 9e-6  # an engine not measured: the cheapest measured one (staging rarely)
GATHER_BYTES_PER_S = 5.0e9  # numpy take into the staging buffer, 1 thread
SCATTER_BYTES_PER_S = 5.0e9  # the decode's scatter of a slot into its pages (numpy fancy assignment, 1 thread)


def choose_strategy(num_blocks: int, nbytes: int, staged_blocks: int, backend: str = "") -> Strategy:
    """STAGED when the descriptors staging saves cost more than copying every byte once more, else BLOCKS.

        saved = (num_blocks - staged_blocks) x DESCRIPTOR_COST_S[backend]
        cost  = nbytes / GATHER_BYTES_PER_S
        STAGED iff saved > cost

    i.e. many small blocks with a fragmented source. A descriptor is worth 25 us x 5 GB/s = 125 KB of copy on
    mooncake and 45 KB on nixl; a GLM-5.2 page is ~35 KB a key (101 keys, 3.5 MB a page): a source fragmented
    page by page is staged on both, one in runs of 2 pages on mooncake only, in runs of 4 on neither. A
    fragmented destination saves nothing here (staged_blocks == num_blocks): the decode's staging slot is the
    remedy for it (choose_destination).
    """
    if num_blocks <= 0 or nbytes <= 0 or staged_blocks >= num_blocks:
        return Strategy.BLOCKS
    per = DESCRIPTOR_COST_S.get(backend, DEFAULT_DESCRIPTOR_COST_S)
    saved = (num_blocks - staged_blocks) * per
    return Strategy.STAGED if saved > nbytes / GATHER_BYTES_PER_S else Strategy.BLOCKS


def choose_destination(num_keys: int, dst_pages: object, nbytes: int, backend: str = "") -> Strategy:
    """The decode's rule at prealloc: STAGED (grant a staging slot, scatter it after the transfer) when the
    descriptors a contiguous slot saves cost more than the scatter's copy, else BLOCKS (write the pages).

        saved = num_keys x (destination runs - 1) x DESCRIPTOR_COST_S[backend]   (a contiguous source assumed:
        cost  = nbytes / SCATTER_BYTES_PER_S                                       one block per key and run)
        STAGED iff saved > cost

    A fresh allocation (one run) stays BLOCKS; a fragmented one of small pages goes STAGED. The sender may
    gather a fragmented source too, which only adds to the saving."""
    dst = _as_ids("dst_pages", dst_pages)
    if num_keys <= 0 or nbytes <= 0 or dst.size < 2:
        return Strategy.BLOCKS
    runs = int(dst_runs(dst)[0].size)
    per = DESCRIPTOR_COST_S.get(backend, DEFAULT_DESCRIPTOR_COST_S)
    return Strategy.STAGED if num_keys * (runs - 1) * per > nbytes / SCATTER_BYTES_PER_S else Strategy.BLOCKS


def dst_runs(dst_pages: IntArray) -> tuple[IntArray, IntArray]:
    """Maximal runs where the destination ids step by +1: (start index in the request, run length)."""
    n = dst_pages.shape[0]
    starts = np.concatenate(([0], np.flatnonzero(np.diff(dst_pages) != 1) + 1)).astype(np.int64)
    return starts, np.diff(np.concatenate((starts, [n]))).astype(np.int64)


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """The blocks that move one request's pages for every paired key."""

    table: PairTable
    num_pages: int
    run_src: IntArray = field(repr=False)
    run_dst: IntArray = field(repr=False)
    run_pages: IntArray = field(repr=False)
    blocks: Blocks = field(repr=False)
    pair_index: IntArray = field(repr=False)  # per block: index into table.pairs
    src_ids: IntArray = field(repr=False)  # the request's page ids, sender side
    dst_ids: IntArray = field(repr=False)  # and receiver side
    strategy: Strategy = Strategy.BLOCKS
    staging_addr: int = 0  # STAGED: the staging buffer the blocks read from

    @classmethod
    def build(cls, pairs: Sequence[KeyPair] | PairTable, src_pages: object, dst_pages: object) -> TransferPlan:
        """Plan moving sender pages `src_pages[i]` to receiver pages `dst_pages[i]` for every pair."""
        table = PairTable.of(pairs)
        src = _as_ids("src_pages", src_pages)
        dst = _as_ids("dst_pages", dst_pages)
        if src.shape != dst.shape:
            raise ValueError(f"src_pages has {src.size} ids but dst_pages has {dst.size}: they pair one to one")
        if src.size == 0:
            raise ValueError("a transfer plan needs at least one page (nothing to send is not a transfer)")
        for name, ids, cap in (("src", src, table.src_pages), ("dst", dst, table.dst_pages)):
            lo, hi = int(ids.min()), int(ids.max())
            over = np.flatnonzero(cap <= hi)
            if lo < 0 or over.size:
                key = table.pairs[int(over[0])].key if over.size else table.pairs[0].key
                raise ValueError(
                    f"{name} page ids span {lo}..{hi} but {key} has {int(cap[over[0]] if over.size else cap[0])} "
                    f"pages on the {'sender' if name == 'src' else 'receiver'}: page ids out of range"
                )
        if np.unique(dst).size != dst.size:
            vals, counts = np.unique(dst, return_counts=True)
            raise ValueError(f"dst page {int(vals[counts > 1][0])} appears twice: two pages cannot land on one")
        run_src, run_dst, run_pages = contiguous_runs(src, dst)
        pb = table.page_bytes[:, None]
        blocks = Blocks(
            (table.src_base[:, None] + run_src[None, :] * pb).ravel(),
            (table.dst_base[:, None] + run_dst[None, :] * pb).ravel(),
            (run_pages[None, :] * pb).ravel(),
        )
        blocks.check("transfer plan")
        pair_index = np.repeat(np.arange(len(table), dtype=np.int64), run_src.size)
        return cls(table, int(src.size), run_src, run_dst, run_pages, blocks, pair_index, src, dst)

    @classmethod
    def into_slot(
        cls, pairs: Sequence[KeyPair] | PairTable, src_pages: object, slot_addr: int, offsets: Sequence[int]
    ) -> TransferPlan:
        """Plan moving sender pages `src_pages` into a decode staging slot at `slot_addr` that holds, for pair k
        at `offsets[k]`, the request's pages in request order (Manifest.slot_offsets of the decode): the
        destination is one run per key, so one block per key and source run."""
        table = PairTable.of(pairs)
        src = _as_ids("src_pages", src_pages)
        off = np.asarray(offsets, dtype=np.int64)
        if off.shape != (len(table),):
            raise ValueError(f"{off.size} slot offsets for {len(table)} paired keys: one per key")
        if slot_addr <= 0:
            raise ValueError(f"staging slot address {slot_addr:#x} is not a buffer")
        n = max(1, int(src.size))
        slot = replace(table, dst_base=slot_addr + off, dst_pages=np.full(len(table), n, dtype=np.int64))
        return cls.build(slot, src, np.arange(src.size, dtype=np.int64))

    def coalesced(self) -> TransferPlan:
        """The same plan with its blocks merged where they continue each other on both sides (pair_index: the
        first key of each merged block)."""
        starts = self.blocks.merge_starts()
        if starts.size == self.num_blocks:
            return self
        return replace(self, blocks=self.blocks.coalesce(), pair_index=self.pair_index[starts])

    @property
    def staging_offsets(self) -> IntArray:
        """Per key: byte offset of its pages in the staging buffer (key-major, request order)."""
        sizes = self.table.page_bytes * self.num_pages
        return np.concatenate(([0], np.cumsum(sizes)[:-1])).astype(np.int64)

    @property
    def num_staged_blocks(self) -> int:
        """Blocks the STAGED plan would send: one per key and destination run."""
        return len(self.table) * int(dst_runs(self.dst_ids)[0].size)

    def choose(self, backend: str = "") -> Strategy:
        """choose_strategy for this plan over `backend` (its name: the descriptor cost is per engine)."""
        return choose_strategy(self.num_blocks, self.nbytes, self.num_staged_blocks, backend)

    def staged(self, staging_addr: int) -> TransferPlan:
        """The same transfer reading from a staging buffer at `staging_addr` that holds, for key k at
        staging_offsets[k], the pages src_ids in request order (dsakv.disagg.transfer.staging.StagingBuffer.gather)."""
        if staging_addr <= 0:
            raise ValueError(f"staging address {staging_addr:#x} is not a buffer")
        starts, lengths = dst_runs(self.dst_ids)
        t = self.table
        pb = t.page_bytes[:, None]
        blocks = Blocks(
            (staging_addr + self.staging_offsets[:, None] + starts[None, :] * pb).ravel(),
            (t.dst_base[:, None] + self.dst_ids[starts][None, :] * pb).ravel(),
            (lengths[None, :] * pb).ravel(),
        )
        blocks.check("staged transfer plan")
        pair_index = np.repeat(np.arange(len(t), dtype=np.int64), starts.size)
        return replace(
            self, blocks=blocks, pair_index=pair_index, strategy=Strategy.STAGED, staging_addr=int(staging_addr)
        )

    @property
    def pairs(self) -> tuple[KeyPair, ...]:
        return self.table.pairs

    @property
    def num_runs(self) -> int:
        return int(self.run_src.size)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def nbytes(self) -> int:
        return self.num_pages * self.table.bytes_per_page

    def bytes_by_kind(self) -> dict[Kind, int]:
        per = np.bincount(self.table.kind, weights=self.table.page_bytes, minlength=len(_KINDS))
        return {k: int(per[i]) * self.num_pages for i, k in enumerate(_KINDS) if k in MLA_KINDS or per[i]}
