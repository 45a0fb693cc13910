"""The router's choice of a (prefill, decode) pair for one request: decode by load, prefill by prefix affinity.

    aff = PrefixAffinity()
    hashes = page_hashes(prompt, page_size=16)        # chained hash of each whole page of the prompt
    aff.matched(prefill_addr, hashes)                 # leading pages the router has already sent there
    aff.record(prefill_addr, hashes, capacity=pages)  # after a SUBMIT: that prefill now caches them (LRU-bounded)
    d = pick_decode([Load(...), ...])                 # least loaded decode
    p, why = pick_prefill([Load(...), ...], matched={addr: pages}, rule=AffinityRule())

Decode rule: the fewest requests the router has in flight there, then the most free pages (its last Health),
then the fewest running + waiting requests (Health), then the address (so a tie is deterministic).

Prefill rule: the least loaded prefill L (fewest in flight, then fewest running + waiting, then most free pages,
then address) unless another prefill B holds more of the prompt: B (most matched pages, ties broken by load)
is chosen when `matched[B] - matched[L] >= rule.min_gain_pages` (default 1: at least one whole page of prefill
saved) and B does not have more than `rule.max_imbalance` requests in flight beyond L (default 4), so one hot
prefix cannot pile every request onto one prefill. Otherwise L ("load").

What a prefill caches is known from what the router sent there: the chained page hashes of every prompt it
submitted (a page is named by the hash of every token up to its end, so a hit on page i implies pages < i),
kept per prefill as an LRU set bounded by that prefill's page count (its cache cannot hold more), and forgotten
when the prefill restarts or re-forms (new boot or epoch). It is an estimate: the prefill's own cache may have
evicted a page since; a wrong guess costs only the prefill compute that affinity hoped to save.

Standard library only (no torch): the router is a light process.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_SEED = b"dsakv-router-prefix"


def page_hashes(prompt: Sequence[int], page_size: int) -> list[bytes]:
    """Chained hash of each whole page of `prompt`: h[i] = blake2b(h[i-1] || int64 tokens of page i)."""
    if page_size <= 0:
        raise ValueError(f"page_size = {page_size} must be > 0")
    out, h = [], _SEED + page_size.to_bytes(4, "little")
    for i in range(len(prompt) // page_size):
        toks = array("q", prompt[i * page_size : (i + 1) * page_size]).tobytes()
        h = hashlib.blake2b(h + toks, digest_size=16).digest()
        out.append(h)
    return out


class PrefixAffinity:
    """Per prefill address, the page hashes the router has sent there (LRU, bounded by the prefill's pages)."""

    def __init__(self) -> None:
        self._sent: dict[str, OrderedDict[bytes, None]] = {}

    def matched(self, addr: str, hashes: Sequence[bytes]) -> int:
        """How many leading pages of the prompt (given as its page hashes) that prefill should have cached."""
        s = self._sent.get(addr)
        if not s:
            return 0
        n = 0
        for h in hashes:
            if h not in s:
                break
            n += 1
        return n

    def record(self, addr: str, hashes: Sequence[bytes], capacity: int) -> None:
        """`addr` was sent a prompt with these pages; keep at most `capacity` pages (least recently sent go)."""
        s = self._sent.setdefault(addr, OrderedDict())
        for h in hashes:
            s[h] = None
            s.move_to_end(h)
        while len(s) > max(0, capacity):
            s.popitem(last=False)

    def forget(self, addr: str) -> None:
        """That prefill lost its cache (restarted / re-formed)."""
        self._sent.pop(addr, None)

    def size(self, addr: str) -> int:
        return len(self._sent.get(addr, ()))


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
