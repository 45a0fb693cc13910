"""Page grants: the capability a prefill needs to write KV into a decode worker's pages.

    key = new_key()                                            # the decode's, fresh per process, never on disk
    g = sign(key, rid="r1#1", prefill="P", boot=decode_boot, pages=[4, 5], expires=time.time() + 21)
    Preallocated(pages, boot, grant=g) ─► router ─► Submit(..., grant=g) ─► prefill stage 0 ─► JobSpec ─► stage k
    verify(key, g, rid=..., prefill=..., boot=..., pages=...)  # GrantRefused naming what does not match

A grant is msgpack [1, rid, prefill, decode boot, pages, expiry (unix seconds), staging slot, slot pages]
followed by its HMAC-SHA256 tag under the decode's grant key. A staging slot >= 0 (dsakv.disagg.transfer.staging.
StagingSlots; the decode's destination pages are fragmented) tells every stage to write the first `slot pages`
pages into that slot of the decode's staging region instead of into `pages`; the decode scatters it. The slot is
signed with the pages, and the decode scatters only the slot its own record of the request holds.
The decode hands the grant key only to prefill stages in their handshake reply, so only the decode mints
grants and only registered stages can check them; the router carries a grant it cannot forge or widen.
Prefill stage 0 refuses a submit whose grant does not verify, has expired, was spent already, or names another
request, decode or prefill, or other pages than `dst_pages`; every stage checks the grant again right before it
starts writing (kv_sender), and the decode accepts a stage's report only with the grant it issued for that
request. Expiry is wall-clock time (hosts of a deployment keep their clocks in sync).
Imports the standard library and msgpack.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import msgpack

from dsakv.disagg.protocol.errors import GrantRefused

TAG = 32


def new_key() -> bytes:
    return os.urandom(32)


@dataclass(frozen=True)
class Grant:
    rid: str
    prefill: str
    boot: str
    pages: tuple[int, ...]
    expires: float
    tag: bytes
    slot: int = -1  # a destination staging slot to write into (-1: write the pages directly)
    slot_pages: int = 0  # how many pages the slot holds (the prompt's)


def sign(
    key: bytes,
    *,
    rid: str,
    prefill: str,
    boot: str,
    pages: Sequence[int],
    expires: float,
    slot: int = -1,
    slot_pages: int = 0,
) -> bytes:
    body = msgpack.packb(
        [1, rid, prefill, boot, [int(p) for p in pages], float(expires), int(slot), int(slot_pages)],
        use_bin_type=True,
    )
    return body + hmac.new(key, b"dsakv-grant-v1" + body, hashlib.sha256).digest()


def parse(key: bytes, blob: bytes) -> Grant:
    """The grant in `blob`, its tag checked (GrantRefused if it is missing, malformed or forged)."""
    if not blob:
        raise GrantRefused("no page grant: a submit must carry the decode's grant from its prealloc reply")
    if not key:
        raise GrantRefused("no grant key for this decode (its handshake did not give one): refused")
    body, tag = blob[:-TAG], blob[-TAG:]
    if len(blob) <= TAG or not hmac.compare_digest(
        tag, hmac.new(key, b"dsakv-grant-v1" + body, hashlib.sha256).digest()
    ):
        raise GrantRefused("the page grant does not verify (forged, altered, or from another decode process)")
    v, rid, prefill, boot, pages, expires, slot, slot_pages = msgpack.unpackb(body, raw=False)
    return Grant(rid, prefill, boot, tuple(pages), float(expires), tag, int(slot), int(slot_pages))


def verify(
    key: bytes,
    blob: bytes,
    *,
    rid: str,
    boot: str,
    pages: Sequence[int],
    prefill: str | None = None,
    now: float | None = None,
) -> Grant:
    """The grant, checked for this request, decode boot, prefill and pages (`pages` must be a prefix of the
    granted ones: a stage writes the prompt's pages, the grant also covers the first decode page) and unexpired."""
    g = parse(key, blob)
    now = time.time() if now is None else now
    if g.rid != rid:
        raise GrantRefused(f"the page grant is for request {g.rid!r}, not {rid!r}")
    if g.boot != boot:
        raise GrantRefused(f"the page grant is from decode boot {g.boot}, not {boot}")
    if prefill is not None and g.prefill != prefill:
        raise GrantRefused(f"the page grant is for prefill {g.prefill!r}, not {prefill!r}")
    want = tuple(int(p) for p in pages)
    if want != g.pages[: len(want)]:
        raise GrantRefused(f"request {rid}: pages {list(want)[:8]} are not the granted pages {list(g.pages)[:8]}")
    if now > g.expires:
        raise GrantRefused(f"request {rid}: the page grant expired {now - g.expires:.1f}s ago")
    return g


class SpentGrants:
    """Grants already used (by tag), kept until they expire: a grant is good for one submit."""

    def __init__(self) -> None:
        self._spent: dict[bytes, float] = {}
        self._lock = threading.Lock()

    def spend(self, g: Grant, now: float | None = None) -> None:
        now = time.time() if now is None else now
        with self._lock:
            for t in [t for t, exp in self._spent.items() if exp < now]:
                del self._spent[t]
            if g.tag in self._spent:
                raise GrantRefused(f"request {g.rid}: the page grant was used already")
            self._spent[g.tag] = g.expires

    def __len__(self) -> int:
        with self._lock:
            return len(self._spent)
