"""Per-request lifecycle: one record type and one state machine per process, on an injected clock.

    router              QUEUED ──dispatch──► DISPATCHED ──first event──► DECODING ──finished──► DONE
                          ▲  └──queue deadline / refused / abort──► DONE     │
                          └──── prefill refused the submit (retry) ──────────┘ (DISPATCHED -> DONE: failed)
    prefill stage       COMPUTING ──last chunk computed──► TRANSFERRING ──every stage released──► DONE
                          └──abort / KV deadline / failed step / pipeline broke──► DONE
    decode              AWAITING_KV ──every stage ok + first token──► DECODING (the engine decodes it)
                          └──stage failed / kv_failed / deadline / stage dead / abort──► FAILED
                        FAILED ──no stage can still write the pages──► DONE (pages freed)

    ledger = Ledger(ROUTER, clock=time.monotonic)          one per process (tests pass a fake clock)
    ledger.add(RouterRequest(rid, ...))                    starts in the machine's first phase
    ledger.move(rec, Phase.DISPATCHED)                     IllegalTransition if the table has no such edge
    ledger.expired()                                       live records whose deadline passed (ledger.now())

A request keeps its id end to end, except that the router sends attempt n of request `rid` as
`attempt_id(rid, n)` ("rid#n"): a request the router re-dispatches after a refused submit is a fresh
request to the decode and prefill, so late events of the old attempt cannot be mistaken for the new one.
Imports nothing from dsakv but errors and engine.request (standard library only there).
"""

from __future__ import annotations

import enum
import math
import queue
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from dsakv.engine.backend import TokenEvent
from dsakv.engine.request import SamplingParams, TokenLogprobs
from dsakv.errors import ConfigError, DsakvError

Blob = bytes  # InboundKv has a field named `bytes`


class Phase(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    COMPUTING = "computing"
    TRANSFERRING = "transferring"
    AWAITING_KV = "awaiting_kv"
    DECODING = "decoding"
    FAILED = "failed"
    DONE = "done"


class IllegalTransition(DsakvError):
    """A request was moved along an edge its process's state machine does not have (a bug)."""


@dataclass(frozen=True)
class Machine:
    name: str
    start: Phase
    edges: Mapping[Phase, frozenset[Phase]]
    terminal: frozenset[Phase]

    def allows(self, a: Phase, b: Phase) -> bool:
        return b in self.edges.get(a, frozenset())

    def transitions(self) -> list[tuple[Phase, Phase]]:
        return [(a, b) for a, bs in self.edges.items() for b in sorted(bs, key=lambda p: p.value)]

    def phases(self) -> list[Phase]:
        seen = {self.start} | set(self.edges) | {b for bs in self.edges.values() for b in bs}
        return sorted(seen, key=lambda p: list(Phase).index(p))


def _machine(name: str, start: Phase, edges: dict[Phase, set[Phase]], terminal: set[Phase]) -> Machine:
    return Machine(name, start, {a: frozenset(b) for a, b in edges.items()}, frozenset(terminal))


P = Phase
ROUTER = _machine(
    "router",
    P.QUEUED,
    {P.QUEUED: {P.DISPATCHED, P.DONE}, P.DISPATCHED: {P.QUEUED, P.DECODING, P.DONE}, P.DECODING: {P.DONE}},
    {P.DONE},
)
PREFILL_STAGE = _machine(
    "prefill stage",
    P.COMPUTING,
    {P.COMPUTING: {P.TRANSFERRING, P.DONE}, P.TRANSFERRING: {P.DONE}},
    {P.DONE},
)
DECODE = _machine(
    "decode",
    P.AWAITING_KV,
    {P.AWAITING_KV: {P.DECODING, P.FAILED}, P.FAILED: {P.DONE}},
    {P.DECODING, P.DONE},
)


@dataclass(kw_only=True)
class Tracked:
    """What every process knows of a request: its id, phase, since when (ledger clock), deadline, error."""

    rid: str
    phase: Phase = Phase.QUEUED
    since: float = 0.0
    deadline: float = math.inf
    error: str | None = None


@dataclass(kw_only=True)
class RouterRequest(Tracked):
    """The router's record: the client's request, where it was dispatched, its token stream."""

    prompt: list[int]
    params: SamplingParams
    q: queue.Queue[TokenEvent] = field(default_factory=queue.Queue)
    attempt: int = 0
    wire: str | None = None  # attempt_id(rid, attempt) while dispatched
    decode: str | None = None
    prefill: str | None = None
    tokens: int = 0
    t_submit: float = 0.0
    t_first: float | None = None
    done: set[int] = field(default_factory=set)  # choices (of params.n) that finished
    refusal: str | None = None  # the last refusal a dispatch attempt met (e.g. a decode with no free pages)


@dataclass(kw_only=True)
class StageJob(Tracked):
    """A prefill stage's record: where the request's KV goes and by when (deadline: the KV deadline)."""

    prompt_len: int
    decode: str
    decode_boot: str
    dst_pages: list[int]
    params: SamplingParams
    seed: int
    pending: set[int] = field(default_factory=set)  # stage 0: stages that still read its pages
    prompt_ids: list[int] | None = None  # the last stage of a PP prefill: prompt logprobs / penalties need them
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # last stage: prompt tokens 1..
    grant: bytes = b""  # the decode's page grant for dst_pages (grants.py), checked before every write

    @property
    def transferring(self) -> bool:
        return self.phase is Phase.TRANSFERRING


@dataclass(kw_only=True)
class InboundKv(Tracked):
    """The decode's record of a request whose KV is being written into its pages (deadline: KV + grace)."""

    prefill: str
    num_stages: int
    stage_rpc: dict[int, str]
    kv_timeout: float
    stage_boot: dict[int, str] = field(default_factory=dict)  # who may report each stage (registered boot ids)
    grant: bytes = b""  # the page grant issued for the request: a stage's report must carry it
    reported: dict[int, bool] = field(default_factory=dict)
    first_token: int | None = None
    first_logprobs: TokenLogprobs | None = None  # of the first token (the last stage's), params.logprobs
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt tokens 1.. (the last stage's)
    cached_tokens: int = 0  # stage 0's prefix-cache hit
    hold_until: float = 0.0  # a timed-out transfer may still write until then
    dead: set[int] = field(default_factory=set)
    revoked: set[int] = field(default_factory=set)  # stages that promised never to write (Revoke: no write in flight)
    revoke_next: float = 0.0  # (failed) when to ask the unsettled stages to revoke again
    bytes: int = 0
    draft_hidden: Blob | None = None  # MTP: the last stage's draft output (StageDone.draft_hidden)
    slot: int = -1  # the destination staging slot granted (disagg.staging.StagingSlots; -1: pages written directly)
    slot_dst: list[int] = field(default_factory=list)  # the pages the slot scatters into, in request order
    slot_keys: tuple[Any, ...] = ()  # the decode keys its prefill stages write (BufferKey)
    scattering: bool = False  # the scatter is running: the pages are not freed meanwhile

    def missing(self) -> list[int]:
        return [k for k in range(self.num_stages) if k not in self.reported]

    def settled(self) -> bool:
        """No stage can still write: every one reported, is gone, or revoked its write."""
        return all(k in self.reported or k in self.dead or k in self.revoked for k in range(self.num_stages))

    def unsettled(self) -> list[int]:
        return [k for k in range(self.num_stages) if not (k in self.reported or k in self.dead or k in self.revoked)]


T = TypeVar("T", bound=Tracked)


class Ledger(Generic[T]):
    """The live requests of one process, moved only along its machine's edges. Not locked: the owner's lock
    guards it."""

    def __init__(self, machine: Machine, clock: Callable[[], float] = time.monotonic, keep_done: bool = False) -> None:
        self.machine = machine
        self.clock = clock
        self.keep_done = keep_done  # keep records in a terminal phase until pop() (the router: until read)
        self._recs: dict[str, T] = {}
        self.moves: dict[tuple[Phase, Phase], int] = {}  # edge -> count (which transitions happened)

    def now(self) -> float:
        return self.clock()

    def add(self, rec: T) -> T:
        if rec.rid in self._recs:
            raise ConfigError(f"request id {rec.rid!r} is already in use on this {self.machine.name}")
        rec.phase = self.machine.start
        rec.since = self.clock()
        self._recs[rec.rid] = rec
        return rec

    def get(self, rid: str) -> T | None:
        return self._recs.get(rid)

    def move(self, rec: T, phase: Phase, error: str | None = None) -> None:
        if not self.machine.allows(rec.phase, phase):
            raise IllegalTransition(
                f"{self.machine.name}: request {rec.rid} cannot go {rec.phase.value} -> {phase.value}"
            )
        self.moves[(rec.phase, phase)] = self.moves.get((rec.phase, phase), 0) + 1
        rec.phase = phase
        rec.since = self.clock()
        if error is not None and rec.error is None:
            rec.error = error
        if phase in self.machine.terminal and not self.keep_done:
            self._recs.pop(rec.rid, None)

    def pop(self, rid: str) -> T | None:
        return self._recs.pop(rid, None)

    def expired(self) -> list[T]:
        """Live (non-terminal) records whose deadline passed."""
        now = self.clock()
        return [r for r in self._recs.values() if r.deadline <= now and r.phase not in self.machine.terminal]

    def in_phase(self, *phases: Phase) -> list[T]:
        return [r for r in self._recs.values() if r.phase in phases]

    def values(self) -> list[T]:
        return list(self._recs.values())

    def __contains__(self, rid: object) -> bool:
        return rid in self._recs

    def __len__(self) -> int:
        return len(self._recs)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._recs))


def attempt_id(rid: str, attempt: int) -> str:
    """The id the router sends attempt `attempt` of request `rid` under."""
    return f"{rid}#{attempt}"
