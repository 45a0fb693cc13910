"""PageMirror: the page books of a PP stage other than stage 0.

Stage 0's PageAllocator decides page ids for every stage of a prefill worker (all stage pools
have the same page count); a later stage only mirrors who holds which page, so its own
`check_integrity()` can prove no page leaked and no page is held twice:

    mirror.hold(rid, pages)     the request's page list as of this step (grows chunk by chunk)
    mirror.release(rid)         after its transfer finished or failed, or when stage 0 dropped it
    mirror.set_cached(pages)    the pages stage 0's prefix cache holds (sent with the step metadata when they
                                change): a cache hit on stage 0 reuses them, so they hold this stage's KV too.
                                Requests may share cached pages; any other page held twice is an error.
Imports numpy and dsakv.cache.allocator only.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from dsakv.cache.allocator import IntegrityError


class PageMirror:
    def __init__(self, num_pages: int, name: str = "stage pool") -> None:
        self.num_pages = num_pages
        self.name = name
        self._held: dict[str, list[int]] = {}
        self._cached: frozenset[int] = frozenset()
        self._lock = threading.Lock()

    def hold(self, rid: str, pages: Iterable[int]) -> None:
        ids = [int(p) for p in pages]
        bad = [p for p in ids if not 0 <= p < self.num_pages]
        if bad:
            raise IntegrityError(f"{self.name}: request {rid} got page(s) {bad[:8]} outside 0..{self.num_pages - 1}")
        with self._lock:
            self._held[rid] = ids

    def release(self, rid: str) -> list[int]:
        with self._lock:
            return self._held.pop(rid, [])

    def set_cached(self, pages: Iterable[int]) -> None:
        ids = frozenset(int(p) for p in pages)
        bad = sorted(p for p in ids if not 0 <= p < self.num_pages)
        if bad:
            raise IntegrityError(f"{self.name}: prefix cache page(s) {bad[:8]} outside 0..{self.num_pages - 1}")
        with self._lock:
            self._cached = ids

    @property
    def cached(self) -> list[int]:
        with self._lock:
            return sorted(self._cached)

    @property
    def num_cached(self) -> int:
        with self._lock:
            return len(self._cached)

    def held_by(self, rid: str) -> list[int]:
        with self._lock:
            return list(self._held.get(rid, []))

    @property
    def owners(self) -> list[str]:
        with self._lock:
            return list(self._held)

    @property
    def num_used(self) -> int:
        """Distinct pages held by requests or by the prefix cache."""
        with self._lock:
            used = set(self._cached)
            for v in self._held.values():
                used.update(v)
            return len(used)

    @property
    def num_free(self) -> int:
        return self.num_pages - self.num_used

    def integrity(self) -> str:
        """'ok', or what check_integrity found (a stage's health / CHECK_INTEGRITY answer)."""
        try:
            self.check_integrity()
        except AssertionError as e:
            return str(e)
        return "ok"

    def check_integrity(self) -> None:
        """Raise IntegrityError if a page that the prefix cache does not hold is held twice (by one request or
        two); cached pages may be shared by the requests that hit them."""
        with self._lock:
            if not self._held:
                return
            allp = np.concatenate([np.asarray(v, dtype=np.int64) for v in self._held.values()])
            cached = np.fromiter(self._cached, dtype=np.int64, count=len(self._cached))
        vals, counts = np.unique(allp, return_counts=True)
        twice = vals[(counts > 1) & ~np.isin(vals, cached)]
        if twice.size:
            raise IntegrityError(f"{self.name}: page(s) {twice[:8].tolist()} are held twice")
