"""PageAllocator: page ids with refcounts, vectorised with numpy.

Contract:
- alloc(n) returns n distinct free page ids (int64 array), each with refcount 1,
  or raises CapacityError (allocating nothing) if fewer than n are free.
- incref(ids) / decref(ids) change refcounts; a page whose refcount reaches 0 is free.
  free(ids) is decref for pages held once.
- Holders register what they hold with `hold(owner, ids)` / `release(owner)` so
  check_integrity() can prove: free + held-by-owners == total, and every page's
  refcount equals the number of owners holding it.
Imports only numpy and dsakv.errors.
"""

from __future__ import annotations

from collections.abc import Hashable

import numpy as np
import numpy.typing as npt

from dsakv.errors import CapacityError

IntArray = npt.NDArray[np.int64]


class IntegrityError(AssertionError):
    """The allocator's books do not balance."""


class PageAllocator:
    def __init__(self, num_pages: int, name: str = "pool") -> None:
        if num_pages < 1:
            raise CapacityError(f"{name}: a pool needs at least one page, got {num_pages}")
        self.num_pages = num_pages
        self.name = name
        self.refcount = np.zeros(num_pages, dtype=np.int32)
        # free pages as a stack; lowest ids come out first
        self._free = np.arange(num_pages - 1, -1, -1, dtype=np.int64)
        self._nfree = num_pages
        self._owners: dict[Hashable, IntArray] = {}

    # ---- counts ---------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self._nfree

    @property
    def num_used(self) -> int:
        return self.num_pages - self._nfree

    def can_alloc(self, n: int) -> bool:
        return n <= self._nfree

    # ---- alloc / refcounts -------------------------------------------------------

    def alloc(self, n: int, owner: Hashable | None = None) -> IntArray:
        """n free page ids, refcount 1 each; with `owner`, also hold(owner, ids)."""
        if n < 0:
            raise ValueError(f"alloc({n}): page count must be >= 0")
        if n > self._nfree:
            raise CapacityError(f"{self.name}: asked for {n} pages but only {self._nfree} of {self.num_pages} are free")
        ids = self._free[self._nfree - n : self._nfree][::-1].copy()
        self._nfree -= n
        self.refcount[ids] = 1
        if owner is not None:
            self.hold(owner, ids)
        return ids

    def incref(self, ids: IntArray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and np.any(self.refcount[ids] <= 0):
            bad = ids[self.refcount[ids] <= 0]
            raise IntegrityError(f"{self.name}: incref of free page(s) {bad[:8].tolist()}")
        np.add.at(self.refcount, ids, 1)

    def decref(self, ids: IntArray) -> None:
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        np.subtract.at(self.refcount, ids, 1)
        if np.any(self.refcount[ids] < 0):
            bad = np.unique(ids[self.refcount[ids] < 0])
            np.add.at(self.refcount, ids, 1)
            raise IntegrityError(f"{self.name}: double free of page(s) {bad[:8].tolist()}")
        freed = np.unique(ids[self.refcount[ids] == 0])
        n = freed.size
        self._free[self._nfree : self._nfree + n] = freed[::-1]
        self._nfree += n

    def free(self, ids: IntArray) -> None:
        self.decref(ids)

    # ---- ownership book-keeping ------------------------------------------------------

    def hold(self, owner: Hashable, ids: IntArray) -> None:
        """Record that `owner` holds one reference to each of `ids` (appends)."""
        ids = np.asarray(ids, dtype=np.int64)
        prev = self._owners.get(owner)
        self._owners[owner] = ids.copy() if prev is None else np.concatenate([prev, ids])

    def unhold(self, owner: Hashable, ids: IntArray) -> None:
        """Forget `ids` from `owner`'s holdings (one occurrence each); refcounts are not touched."""
        prev = self._owners.get(owner)
        if prev is None:
            raise IntegrityError(f"{self.name}: owner {owner!r} holds nothing")
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size == 0:
            return
        # multiset difference, vectorised: the k-th occurrence of a page in `ids` removes its k-th holding
        order = np.argsort(prev, kind="stable")
        sp = prev[order]
        uniq, want = np.unique(ids, return_counts=True)
        lo = np.searchsorted(sp, uniq, side="left")
        hi = np.searchsorted(sp, uniq, side="right")
        short = (hi - lo) < want
        if np.any(short):
            raise IntegrityError(f"{self.name}: owner {owner!r} does not hold page(s) {uniq[short][:8].tolist()}")
        drop_sorted = np.zeros(sp.size, dtype=bool)
        starts = np.repeat(lo, want)
        within = np.arange(want.sum()) - np.repeat(np.cumsum(want) - want, want)
        drop_sorted[starts + within] = True
        keep = np.ones(prev.size, dtype=bool)
        keep[order[drop_sorted]] = False
        rest = prev[keep]
        if rest.size:
            self._owners[owner] = rest
        else:
            del self._owners[owner]

    def drop(self, owner: Hashable, ids: IntArray) -> None:
        """`owner` lets go of one reference to each of `ids`: unhold then decref."""
        self.unhold(owner, ids)
        self.decref(ids)

    def held_by(self, owner: Hashable) -> IntArray:
        return self._owners.get(owner, np.zeros(0, dtype=np.int64))

    def release(self, owner: Hashable) -> IntArray:
        """Drop every reference `owner` holds; returns the ids it held."""
        ids = self._owners.get(owner, np.zeros(0, dtype=np.int64))
        self.decref(ids)  # raises (changing nothing) on a double free, so the books stay as they were
        self._owners.pop(owner, None)
        return ids

    @property
    def owners(self) -> dict[Hashable, IntArray]:
        return dict(self._owners)

    # ---- integrity -------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + held == total and refcounts match holders."""
        free = self._free[: self._nfree]
        if free.size and (free.min() < 0 or free.max() >= self.num_pages):
            raise IntegrityError(f"{self.name}: the free list holds an id outside 0..{self.num_pages - 1}")
        if np.unique(free).size != free.size:
            raise IntegrityError(f"{self.name}: a page is on the free list twice")
        if np.any(self.refcount[free] != 0):
            raise IntegrityError(f"{self.name}: free page(s) with refcount > 0: {free[self.refcount[free] != 0][:8]}")
        expected = np.zeros(self.num_pages, dtype=np.int64)
        for ids in self._owners.values():
            np.add.at(expected, ids, 1)
        leaked = np.nonzero((self.refcount > 0) & (expected == 0))[0]
        if leaked.size:
            raise IntegrityError(
                f"{self.name}: page(s) {leaked[:8].tolist()} are allocated (refcount "
                f"{self.refcount[leaked[:8]].tolist()}) but held by no owner: a page leaked"
            )
        if not np.array_equal(expected, self.refcount):
            diff = np.nonzero(expected != self.refcount)[0]
            raise IntegrityError(
                f"{self.name}: refcounts do not match holders at page(s) {diff[:8].tolist()} "
                f"(refcount {self.refcount[diff[:8]].tolist()}, held {expected[diff[:8]].tolist()})"
            )
        used = int(np.count_nonzero(self.refcount))
        if used + self._nfree != self.num_pages:
            raise IntegrityError(
                f"{self.name}: {self._nfree} free + {used} held != {self.num_pages} total pages (a page leaked)"
            )
