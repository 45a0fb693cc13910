"""The page-hash chain that names a prompt's whole pages, and the prefill's bounded log of the page hashes its
prefix cache holds: what a prefill reports in CACHE_EVENTS and the router mirrors (disagg/router/routing.py).

    h = page_hashes(prompt, page_size=16)      # h[i] = blake2b(h[i-1] || int64 tokens of page i)
    log = CacheEventLog(); log.update(current_hashes); delta = log.since(cursor)

Standard library only (no torch): the router is a light process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

_SEED = b"dsakv-router-prefix"
HASH_BYTES = 16  # one page hash (blake2b digest size)


def root_hash(page_size: int) -> bytes:
    """The chain's seed: page size is part of a page's identity."""
    if page_size <= 0:
        raise ValueError(f"page_size = {page_size} must be > 0")
    return _SEED + page_size.to_bytes(4, "little")


def chain_hash(prev: bytes, page_tokens: bytes) -> bytes:
    """The hash of one page: blake2b(previous page's hash || the page's tokens as little-endian int64)."""
    return hashlib.blake2b(prev + page_tokens, digest_size=HASH_BYTES).digest()


def page_hashes(prompt: Sequence[int], page_size: int) -> list[bytes]:
    """Chained hash of each whole page of `prompt`: h[i] = blake2b(h[i-1] || int64 tokens of page i)."""
    out, h = [], root_hash(page_size)
    for i in range(len(prompt) // page_size):
        h = chain_hash(h, array("q", prompt[i * page_size : (i + 1) * page_size]).tobytes())
        out.append(h)
    return out


def pack(hashes: Iterable[bytes]) -> bytes:
    return b"".join(hashes)


def unpack(blob: bytes) -> list[bytes]:
    if len(blob) % HASH_BYTES:
        raise ValueError(f"a packed hash list of {len(blob)} bytes is not a multiple of {HASH_BYTES}")
    return [blob[i : i + HASH_BYTES] for i in range(0, len(blob), HASH_BYTES)]


@dataclass(frozen=True)
class CacheDelta:
    """What changed in a prefill's cached page set after a cursor (the body of a CacheEvents reply)."""

    cursor: int  # pass this as `since` next time
    reset: bool  # `stored` is the whole set: drop what you had
    stored: list[bytes]
    removed: list[bytes]
    pages: int  # the set's size now (a check for the mirror)


class CacheEventLog:
    """The prefill's side: the set of page hashes its cache holds and a bounded log of its changes.

    update(hashes) diffs the current set against the last one and appends one event per page stored or removed;
    since(cursor) is the net change after `cursor`, or the whole set (reset) when the log no longer reaches back
    that far (it keeps at most max_events events) or the cursor is not one it gave (-1, or from another boot)."""

    def __init__(self, max_events: int = 1 << 16) -> None:
        if max_events < 1:
            raise ValueError(f"max_events = {max_events} must be >= 1")
        self.max_events = max_events
        self.seq = 0  # events ever logged
        self._set: dict[bytes, None] = {}
        self._log: deque[tuple[int, bool, bytes]] = deque()  # (seq, stored?, hash)

    def __len__(self) -> int:
        return len(self._set)

    def update(self, hashes: Iterable[bytes]) -> tuple[int, int]:
        """The cache now holds exactly `hashes`; returns (pages stored, pages removed) since the last update."""
        now = dict.fromkeys(hashes)
        gone = [h for h in self._set if h not in now]
        new = [h for h in now if h not in self._set]
        for stored, hs in ((False, gone), (True, new)):
            for h in hs:
                self.seq += 1
                self._log.append((self.seq, stored, h))
        while len(self._log) > self.max_events:
            self._log.popleft()
        self._set = now
        return len(new), len(gone)

    def since(self, cursor: int) -> CacheDelta:
        first = self._log[0][0] if self._log else self.seq + 1
        if cursor < 0 or cursor > self.seq or cursor < first - 1:
            return CacheDelta(self.seq, True, list(self._set), [], len(self._set))
        last: dict[bytes, bool] = {}
        for seq, stored, h in self._log:
            if seq > cursor:
                last[h] = stored
        return CacheDelta(
            self.seq,
            False,
            [h for h, st in last.items() if st],
            [h for h, st in last.items() if not st],
            len(self._set),
        )
