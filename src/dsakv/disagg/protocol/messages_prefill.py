"""The prefill's messages (re-exported by protocol.messages): the router's and the stages' calls to a prefill
(connect, submit, abort, released, revoke, cache events), and a prefill stage's HEALTH reply (PrefillHealth)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsakv.config import MAX_KV_TIMEOUT, MAX_WAIT
from dsakv.disagg.protocol.codec import bounds
from dsakv.disagg.protocol.messages_base import MAX_ID, MAX_STAGES, Health, LinkSummary
from dsakv.engine.request import SamplingParams

# ---- prefill ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Connect:
    """Handshake prefill (every stage) with a decode worker; stage 0 forwards it to stages k > 0."""

    decode: str
    boot: str | None = None
    timeout: float | None = field(default=None, metadata=bounds(0.0, MAX_WAIT))


@dataclass(frozen=True)
class Connected:
    decode: str
    boot: str
    epoch: str | None
    stages: list[LinkSummary]  # stage 0's link first, then every later stage's


@dataclass(frozen=True)
class Submit:
    """Prefill `prompt_ids` and write the KV to the decode's pages `dst_pages` within kv_timeout seconds.
    `grant`: the decode's signed page grant for exactly these pages (Preallocated.grant, see grants.py)."""

    rid: str
    prompt_ids: list[int] = field(metadata=bounds(0, MAX_ID, each=True))
    params: SamplingParams
    seed: int
    decode: str
    decode_boot: str
    dst_pages: list[int] = field(metadata=bounds(0, MAX_ID, each=True))
    kv_timeout: float = field(metadata=bounds(0.001, MAX_KV_TIMEOUT))
    grant: bytes = b""


@dataclass(frozen=True)
class Submitted:
    accepted: bool
    epoch: str | None


@dataclass(frozen=True)
class Abort:
    rid: str
    why: str = "aborted"
    choice: int | None = field(default=None, metadata=bounds(0, 4096))  # decode, n > 1: only this choice (None: all)


@dataclass(frozen=True)
class Released:
    """Stage `stage` is done with the request's pages (its transfer finished or failed). Stage 0 accepts it only
    from the process that stage `stage` of its pipeline is (boot: the one it formed the epoch with) and with the
    request's page grant, for a request whose pages that stage still reads."""

    rid: str
    stage: int = field(metadata=bounds(0, MAX_STAGES))
    boot: str = ""  # the releasing stage's process
    grant: bytes = b""  # the request's page grant, as the stage received it (JobSpec.grant)


@dataclass(frozen=True)
class Revoke:
    """Decode -> every prefill stage of a request it no longer waits for (aborted, failed): never start writing
    the pages of `grant`; say whether a write of them is in flight (or may still land: a timed-out one)."""

    rid: str
    grant: bytes


@dataclass(frozen=True)
class Revoked:
    in_flight: bool  # a write of the grant's pages is running or in its quarantine: keep the pages for now
    boot: str = ""  # the answering stage's process (the decode takes the promise only from the one it waits for)


@dataclass(frozen=True)
class CacheEventsQuery:
    """What changed in the prefix cache after `since` (a cursor from an earlier reply; -1: the whole set)."""

    since: int = field(default=-1, metadata=bounds(-1, 2**62))


@dataclass(frozen=True)
class CacheEvents:
    """The prefix cache's whole pages stored / removed after the cursor, as chained page hashes (page_hashes.py),
    each 16 bytes, concatenated; reset: `stored` is the whole set (the cursor was unknown or too old)."""

    boot: str
    epoch: str | None
    page_size: int
    cursor: int
    reset: bool
    stored: bytes
    removed: bytes
    pages: int  # pages cached now
    capacity: int  # the most pages the cache can hold (device + host tier)


# ---- health ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TransferHealth:
    count: int
    failures: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class PrefillHealth(Health):
    """A prefill stage's HEALTH reply: the common part and what a prefill stage fills (None where it does not)."""

    ROLE: ClassVar[str] = "prefill"

    jobs: int | None = None
    transfers_in_flight: int | None = None
    links: list[LinkSummary] | None = None
    prefix_cache_enabled: bool | None = None
    host_tier: bool | None = None
    cache_pages: int | None = None
    transfer: TransferHealth | None = None
    awaiting_release: int | None = None  # stage 0
    prefix_cache: dict[str, Any] | None = None  # stage 0: HiCacheStats.to_dict()
    host_replayed: dict[str, int] | None = None  # stages k > 0
    rank_pages: list[int] | None = None  # a TP stage: pages in use on each TP rank (the others' as last gathered)
