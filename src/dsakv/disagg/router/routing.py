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

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from dsakv.disagg.protocol.page_hashes import CacheDelta, CacheEventLog, pack, page_hashes, unpack

__all__ = [  # the page-hash chain and its event log (protocol.page_hashes) are re-exported for the router's users
    "MAX_MIRROR_PAGES",
    "AffinityRule",
    "CacheDelta",
    "CacheEventLog",
    "Load",
    "PrefixAffinity",
    "pack",
    "page_hashes",
    "pick_decode",
    "pick_prefill",
    "unpack",
]

MAX_MIRROR_PAGES = 1 << 22  # the most pages the router mirrors for one prefill, whatever it claims (64 MiB)


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
