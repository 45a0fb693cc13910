"""The router's choice of a (prefill, decode) pair for one request: decode by load, prefill by prefix affinity.

    aff = PrefixAffinity()
    hashes = page_hashes(prompt, page_size=16)        # chained hash of each whole page of the prompt
    aff.matched(prefill_addr, hashes)                 # leading pages that prefill reported cached
    d = pick_decode([Load(...), ...])                 # least loaded decode
    p, why = pick_prefill([Load(...), ...], matched={addr: pages}, rule=AffinityRule())

Decode rule: the fewest requests the router has in flight there, then the most free pages (its last Health),
then the fewest running + waiting requests (Health), then the address (so a tie is deterministic).

Prefill rule: the least loaded prefill L (fewest in flight, then fewest running + waiting, then most free pages,
then address) unless another prefill B holds more of the prompt: B (most matched pages, ties broken by load)
is chosen when `matched[B] - matched[L] >= rule.min_gain_pages` (default 1: at least one whole page of prefill
saved) and B does not have more than `rule.max_imbalance` requests in flight beyond L (default 4), so one hot
prefix cannot pile every request onto one prefill. Otherwise L ("load").

What a prefill caches is what it reports (its cache events, not a guess): the prefill names every whole page of
its prefix cache (device or host tier) by its chained page hash (a page is named by the hash of every token up to
its end, so a hit on page i implies pages < i) and answers CACHE_EVENTS(since=cursor) with the pages stored and
removed since that cursor (or its whole set, `reset`, when the cursor is unknown to it: first poll, restart, a
log that overflowed). The router polls every prefill with its health and keeps one mirror per prefill
(`PrefixAffinity.apply`), bounded by the capacity the prefill states and by MAX_MIRROR_PAGES; a mirror whose
prefill restarted (new boot) or re-formed (new epoch) starts again from a reset. Between a prefill caching
pages and the next poll the router does not know them yet (the request then goes by load); an evicted page stops
counting at the first poll after the eviction.

    log = CacheEventLog()                      # prefill side (disagg/prefill/prefix_events.py walks the radix tree)
    log.update(current_hashes); ev = log.since(cursor)
    aff.apply(addr, boot, epoch, ev)           # router side

Standard library only (no torch): the router is a light process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

_SEED = b"dsakv-router-prefix"
HASH_BYTES = 16  # one page hash (blake2b digest size)
MAX_MIRROR_PAGES = 1 << 22  # the most pages the router mirrors for one prefill, whatever it claims (64 MiB)


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


@dataclass
class _Mirror:
    boot: str
    epoch: str | None
    cursor: int = -1
    pages: dict[bytes, None] = field(default_factory=dict)


class PrefixAffinity:
    """Per prefill address, a mirror of the page hashes that prefill reports cached (its cache events)."""

    def __init__(self, max_pages: int = MAX_MIRROR_PAGES) -> None:
        self.max_pages = max_pages
        self._m: dict[str, _Mirror] = {}

    def cursor(self, addr: str, boot: str, epoch: str | None) -> int:
        """The `since` to ask `addr` for: -1 (its whole set) unless the mirror is of this boot and epoch."""
        m = self._m.get(addr)
        return m.cursor if m is not None and (m.boot, m.epoch) == (boot, epoch) else -1

    def apply(self, addr: str, boot: str, epoch: str | None, d: CacheDelta, capacity: int) -> str | None:
        """Apply a prefill's reply; None if the mirror now equals its set, else why it was dropped (an
        inconsistent or oversized reply: the mirror is emptied and the next poll asks for the whole set)."""
        m = self._m.get(addr)
        if d.reset or m is None or (m.boot, m.epoch) != (boot, epoch):
            if not d.reset:
                self._m.pop(addr, None)
                return f"a delta after cursor {d.cursor} without a base (boot {boot}, epoch {epoch})"
            m = self._m[addr] = _Mirror(boot, epoch)
        for h in d.removed:
            m.pages.pop(h, None)
        for h in d.stored:
            m.pages[h] = None
        limit = min(max(0, capacity), self.max_pages)
        if len(m.pages) != d.pages or len(m.pages) > limit:
            self._m.pop(addr, None)
            return (
                f"the mirror holds {len(m.pages)} pages, the prefill says {d.pages} (capacity {capacity}, "
                f"router limit {self.max_pages})"
            )
        m.cursor = d.cursor
        return None

    def matched(self, addr: str, hashes: Sequence[bytes]) -> int:
        """How many leading pages of the prompt (given as its page hashes) that prefill has cached."""
        m = self._m.get(addr)
        if m is None or not m.pages:
            return 0
        n = 0
        for h in hashes:
            if h not in m.pages:
                break
            n += 1
        return n

    def forget(self, addr: str) -> None:
        """That prefill lost its cache (restarted / re-formed / stopped answering)."""
        self._m.pop(addr, None)

    def size(self, addr: str) -> int:
        m = self._m.get(addr)
        return len(m.pages) if m is not None else 0

    def has(self, addr: str, h: bytes) -> bool:
        m = self._m.get(addr)
        return m is not None and h in m.pages


@dataclass(frozen=True)
class Load:
    """One candidate worker's load as the router sees it."""

    addr: str
    in_flight: int  # the router's requests dispatched there and not finished (exact, not polled)
    pages_free: int = 0  # last Health
    queued: int = 0  # last Health: running + waiting


@dataclass(frozen=True)
class AffinityRule:
    min_gain_pages: int = 1  # affinity only if it saves at least this many whole pages over the least loaded
    max_imbalance: int = 4  # ... and the affine prefill has at most this many more requests in flight

    def __post_init__(self) -> None:
        if self.min_gain_pages < 1:
            raise ValueError(f"min_gain_pages = {self.min_gain_pages} must be >= 1 (a gain of 0 pages is no gain)")
        if self.max_imbalance < 0:
            raise ValueError(f"max_imbalance = {self.max_imbalance} must be >= 0")


def pick_decode(cands: Sequence[Load]) -> Load:
    if not cands:
        raise ValueError("pick_decode: no candidate")
    return min(cands, key=lambda c: (c.in_flight, -c.pages_free, c.queued, c.addr))


def _prefill_load(c: Load) -> tuple[int, int, int, str]:
    return (c.in_flight, c.queued, -c.pages_free, c.addr)


def pick_prefill(cands: Sequence[Load], matched: Mapping[str, int], rule: AffinityRule) -> tuple[Load, str]:
    """(the prefill to use, "affinity" | "load") under the rule in the module docstring."""
    if not cands:
        raise ValueError("pick_prefill: no candidate")
    least = min(cands, key=_prefill_load)
    best = min(cands, key=lambda c: (-matched.get(c.addr, 0), *_prefill_load(c)))
    gain = matched.get(best.addr, 0) - matched.get(least.addr, 0)
    if best is not least and gain >= rule.min_gain_pages and best.in_flight - least.in_flight <= rule.max_imbalance:
        return best, "affinity"
    if best is least and matched.get(best.addr, 0) >= rule.min_gain_pages:
        return best, "affinity"  # the least loaded is also where the prefix is
    return least, "load"
