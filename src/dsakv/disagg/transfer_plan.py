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
boundary. Imports numpy, spec and disagg.{compat, errors}.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from dsakv.disagg.compat import KeyPair
from dsakv.disagg.errors import TransferError
from dsakv.spec.layout import BufferKey, Kind

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
        return cls(table, int(src.size), run_src, run_dst, run_pages, blocks, pair_index)

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
        return {k: int(per[i]) * self.num_pages for i, k in enumerate(_KINDS)}
