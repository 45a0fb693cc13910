"""The typed control plane: every message of disaggregated serving as a dataclass, and every role's RPCs.

Messages travel through the one codec (dsakv.disagg.protocol.codec: a dataclass is a msgpack map of its fields,
checked against its type hints on arrival) inside the RPC frames of dsakv.disagg.protocol.rpc, or (StepMsg) inside
the per-step header of dsakv.pipeline.stage_comm. The RPC graph (who calls what; `Rpc.caller`):

    router ──────────────── health / ping ─────────────────────────► every worker (prefill stage 0, decode)
    router ── connect(Connect) ──► prefill stage 0 ── connect ──► stage k > 0        (-> Connected)
    prefill stage k ─────── handshake(Hello) ─────────────────────► decode            (-> HelloReply)
    router ── prealloc(Prealloc) ─────────────────────────────────► decode            (-> Preallocated: pages)
    router ── submit(Submit: the decode's pages) ─► prefill stage 0                   (-> Submitted)
    prefill stage 0 ═══ step/tick (StepMsg + hidden + top-k, gloo) ═══► stage 1 ═══► ... stage N-1
    every stage k ── KV of its layers (TransferBackend) ─────────► decode's pages
    every stage k ── stage_done(StageDone) ───────────────────────► decode            (-> StageDoneReply)
    prefill stage k > 0 ── released(Released) ─► prefill stage 0: frees the pages once every stage did
    prefill stage k ── kv_failed(KvFailed) ───────────────────────► decode (the request was dropped)
    decode ── ping ───────────────────────────────────────────────► prefill stage k (liveness while waiting)
    decode ── revoke(Revoke: a failed request's grant) ───────────► prefill stage k (-> Revoked: write in flight?)
    router ── events(EventsQuery, long poll) ─────────────────────► decode            (-> Events: tokens)
    router ── abort(Abort) ──────────────────────────────────────► decode, prefill stage 0
    router ── cache_events(CacheEventsQuery: a cursor) ───────────► prefill stage 0   (-> CacheEvents: page hashes)

The service specs (PREFILL_LEADER_SERVICE, PREFILL_FOLLOWER_SERVICE, DECODE_SERVICE) are these lists;
`rpc.bind` refuses a worker that serves an RPC off its spec or misses one. To add an RPC (an MTP draft
exchange, a decode pipeline stage, authentication's challenge), add its message dataclasses and one `Rpc`
constant here and put it in its service. Imports dsakv.disagg.{rpc, codec}, dsakv.engine.request
(standard library only there); never torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dsakv.disagg.protocol.codec import bounds
from dsakv.disagg.protocol.rpc import Rpc, Service
from dsakv.engine.request import SamplingParams, TokenLogprobs

# ---- logprobs on the wire ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class WireLogprobs:
    """Log-probabilities of a run of tokens (engine.request.TokenLogprobs, column-wise): token i is token_ids[i]
    with logprob logprobs[i], its best alternatives top_ids[i] with top_logprobs[i] (best first). Floats travel
    as msgpack float64, so float32 values arrive exact."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]

    @classmethod
    def pack(cls, entries: Sequence[TokenLogprobs] | None) -> WireLogprobs | None:
        if entries is None:
            return None
        return cls(
            [int(e.token_id) for e in entries],
            [float(e.logprob) for e in entries],
            [[int(t) for t, _ in e.top] for e in entries],
            [[float(v) for _, v in e.top] for e in entries],
        )

    def unpack(self) -> tuple[TokenLogprobs, ...]:
        n = len(self.token_ids)
        if not len(self.logprobs) == len(self.top_ids) == len(self.top_logprobs) == n:
            raise ValueError(f"logprobs of {n} tokens with {len(self.logprobs)} values and {len(self.top_ids)} tops")
        return tuple(
            TokenLogprobs(t, lp, tuple(zip(ids, vals, strict=True)))
            for t, lp, ids, vals in zip(self.token_ids, self.logprobs, self.top_ids, self.top_logprobs, strict=True)
        )


def unpack_logprobs(w: WireLogprobs | None) -> tuple[TokenLogprobs, ...] | None:
    return w.unpack() if w is not None else None


Blob = bytes  # a raw-bytes field type where a message also has a field named `bytes`


# Bounds of the numeric fields (the codec refuses a value outside them, and NaN / infinities everywhere)
MAX_KV_TIMEOUT = 3600.0  # seconds: a request's prefill + KV deadline (every page a decode holds has one)
MAX_QUARANTINE = 600.0  # seconds a timed-out transfer may ask the decode to keep the pages
MAX_STAGES = 256
MAX_ID = 2**31 - 1  # token ids, page ids
MAX_WAIT = 600.0  # seconds: long polls, connect timeouts


# ---- common: liveness, health, integrity ----------------------------------------------------------------


@dataclass(frozen=True)
class Ping:
    pass


@dataclass(frozen=True)
class PingReply:
    pid: int
    boot: str
    stage: int | None = None
    epoch: str | None = None


@dataclass(frozen=True)
class HealthQuery:
    pass


@dataclass(frozen=True)
class IntegrityQuery:
    pass


@dataclass(frozen=True)
class LinkSummary:
    """A prefill stage's handshaken link to one decode worker."""

    addr: str
    boot: str
    pairs: int
    skipped: list[str]
    bytes_per_page: int
    decode_stages: list[int] = field(default_factory=lambda: [0])  # the decode stages this stage sends to


@dataclass(frozen=True)
class StageInfo:
    """One pipeline stage as stage 0 sees it (formation), or a handshaken prefill stage as decode sees it."""

    stage: int
    rpc: str
    pid: int | None = None
    boot: str | None = None
    prefill: str | None = None
    layers: list[int] | None = None  # [first, last]
    # a decode pipeline's stage, as its own health reports it (None when it did not answer)
    ok: bool | None = None
    pages_total: int | None = None
    pages_used: int | None = None
    bytes_per_token: int | None = None
    integrity: str | None = None
    error: str | None = None


@dataclass(frozen=True)
class TransferHealth:
    count: int
    failures: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Health:
    """A worker's state, as the router, demo and tests read it. Role-specific fields are None elsewhere."""

    ok: bool
    role: str  # "prefill" | "decode"
    name: str
    pid: int
    boot: str
    elide: bool
    backend: str
    page_size: int
    pages_total: int
    pages_used: int
    pages_free: int
    capacity_tokens: int
    integrity: str
    counters: dict[str, int]
    stages: list[StageInfo] = field(default_factory=list)
    # prefill stages
    stage: int = 0
    num_stages: int = 1
    epoch: str | None = None
    down: str | None = None
    layers: list[int] | None = None
    jobs: int | None = None
    transfers_in_flight: int | None = None
    links: list[LinkSummary] | None = None
    prefix_cache_enabled: bool | None = None
    host_tier: bool | None = None
    cache_pages: int | None = None
    transfer: TransferHealth | None = None
    waiting: int | None = None  # stage 0 (and decode)
    running: int | None = None  # stage 0 (and decode)
    awaiting_release: int | None = None  # stage 0
    prefix_cache: dict[str, Any] | None = None  # stage 0: HiCacheStats.to_dict()
    host_replayed: dict[str, int] | None = None  # stages k > 0
    # decode
    bytes_per_token: int | None = None
    max_prompt_tokens: int | None = None
    inbound: int | None = None
    failed_held: int | None = None
    spec: dict[str, float] | None = None  # decode with MTP: Engine.spec_stats()
    pipeline: list[StageInfo] | None = None  # pipelined decode, stage 0: every decode stage (rpc, pid, layers)
    kv_bytes_pairs: dict[str, int] | None = None  # pipelined decode, stage 0: "<prefill>:<k>-><j>" -> bytes landed
    staging_slots: list[int] | None = None  # decode with destination staging: [free, total] slots
    vocab_size: int | None = None  # decode: the model's vocabulary (the router 400s token ids >= it)


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


# ---- decode -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """A prefill stage's handshake: its manifest, where it is, which pipeline it belongs to."""

    prefill: str
    stage: int = field(metadata=bounds(0, MAX_STAGES - 1))
    num_stages: int = field(metadata=bounds(1, MAX_STAGES))
    rpc: str
    manifest: bytes
    boot: str = ""  # the stage's process (its ping answers with it); the decode registers the stage under it


@dataclass(frozen=True)
class DecodeStageRef:
    """One stage of a pipelined decode worker, as its stage 0 tells a prefill stage at handshake."""

    stage: int
    rpc: str
    manifest: bytes
    boot: str = ""


@dataclass(frozen=True)
class HelloReply:
    manifest: bytes
    boot: str
    name: str
    stages: list[DecodeStageRef] = field(default_factory=list)  # a pipelined decode: every stage (its keys there)
    ranks: list[DecodeStageRef] = field(default_factory=list)  # a TP decode: ranks 1.. (stage = rank), own pools
    grant_key: bytes = b""  # verifies this decode's page grants (only registered stages get it)


@dataclass(frozen=True)
class Prealloc:
    """Reserve pages for a prompt that prefill worker `prefill` (num_stages stages) computes."""

    rid: str
    prompt_ids: list[int] = field(metadata=bounds(0, MAX_ID, each=True))
    params: SamplingParams
    prefill: str
    num_stages: int = field(metadata=bounds(1, MAX_STAGES))
    kv_timeout: float = field(metadata=bounds(0.001, MAX_KV_TIMEOUT))


@dataclass(frozen=True)
class Preallocated:
    pages: list[int]
    boot: str
    grant: bytes = b""  # signed: (rid, prefill, this boot, pages, expiry); the prefill writes only these pages


@dataclass(frozen=True)
class StageDone:
    """Stage `stage` of prefill `prefill` finished (ok) or failed its transfer of request `rid`."""

    rid: str
    prefill: str
    stage: int = field(metadata=bounds(0, MAX_STAGES - 1))
    ok: bool
    error: str | None = None
    quarantine_s: float = field(default=0.0, metadata=bounds(0.0, MAX_QUARANTINE))  # a timed-out write may land
    bytes: int = field(default=0, metadata=bounds(0, 2**48))
    first_token: int | None = field(default=None, metadata=bounds(0, MAX_ID))  # the last stage's sampled token
    first_logprobs: WireLogprobs | None = None  # last stage: the first token's (params.logprobs)
    prompt_logprobs: WireLogprobs | None = None  # last stage: prompt tokens 1.. (params.prompt_logprobs)
    cached_tokens: int = field(default=0, metadata=bounds(0, 2**48))  # stage 0: prompt tokens its prefix cache supplied
    draft_hidden: Blob | None = None  # last stage with MTP: float32 [H], the draft's output at the last entry
    parts: dict[int, int] = field(default_factory=dict)  # pipelined decode: decode stage -> bytes landed there
    rank_parts: dict[int, int] = field(default_factory=dict)  # TP decode: decode rank -> bytes landed there
    boot: str = ""  # the reporting stage's process: must be the one registered for this stage
    grant: Blob = b""  # the request's page grant, as the stage received it
    slot: int = field(default=-1, metadata=bounds(-1, 2**16))  # the staging slot it wrote into (the grant's; -1: none)


@dataclass(frozen=True)
class StageDoneReply:
    accepted: bool
    started: bool = False


@dataclass(frozen=True)
class KvFailed:
    """A prefill dropped the request before its transfer (deadline, abort, broken pipeline)."""

    rid: str
    error: str
    source: str = ""
    boot: str = ""  # the reporting stage's process: must be the one registered for `stage` of the request
    stage: int = field(default=-1, metadata=bounds(-1, MAX_STAGES - 1))  # the reporting stage (-1: none: refused)
    grant: Blob = b""  # the request's page grant, as the stage received it


@dataclass(frozen=True)
class EventsQuery:
    since: int = field(default=0, metadata=bounds(0, 2**62))
    wait: float = field(default=0.0, metadata=bounds(0.0, MAX_WAIT))


@dataclass(frozen=True)
class EventRow:
    """One token event of the decode worker's event log."""

    seq: int
    rid: str
    tokens: list[int]
    finished: bool
    reason: str | None = None
    error: str | None = None
    choice: int = 0  # which of the request's params.n choices (rid is the request's)
    logprobs: WireLogprobs | None = None  # of `tokens`, when params.logprobs is set
    prompt_logprobs: WireLogprobs | None = None  # choice 0's first event, when params.prompt_logprobs is set
    cached_tokens: int = 0  # the prefill's prefix-cache hit (prompt tokens), choice 0


@dataclass(frozen=True)
class Events:
    cursor: int
    events: list[EventRow]
    lost: bool
    boot: str = ""


# ---- pipeline steps (stage k -> stage k+1, in stage_comm's header) -----------------------------------------

STEP = "step"
TICK = "tick"


@dataclass(frozen=True)
class StepRow:
    """One sequence of a pipeline step: tokens [start, start + num_tokens) of request rid, on `pages`."""

    rid: str
    start: int
    num_tokens: int
    pages: list[int]
    last: bool  # the prompt's last chunk: the stage transfers the request after this step
    next_token: int | None = None  # the prompt token after this chunk (not last): the draft layer's last entry


@dataclass(frozen=True)
class JobSpec:
    """Where a request's KV goes and by when (`left` seconds from when the message was built)."""

    rid: str
    prompt_len: int
    decode: str
    decode_boot: str
    dst_pages: list[int]
    left: float
    params: SamplingParams
    seed: int
    prompt_ids: list[int] | None = None  # for the last stage: prompt logprobs / repetition penalty need them
    grant: bytes = b""


@dataclass(frozen=True)
class HostOp:
    """One host-tier copy stage 0 made, to replay: kind "o" (device -> host) or "l" (host -> device)."""

    kind: str
    src: bytes  # int64 page ids
    dst: bytes


@dataclass(frozen=True)
class StepMsg:
    """What stage 0 tells the later stages with every step (kind STEP) or while idle (kind TICK)."""

    kind: str
    seqs: list[StepRow] = field(default_factory=list)
    jobs: dict[str, JobSpec] = field(default_factory=dict)  # requests whose first chunk is in this step
    batch: dict[str, Any] | None = None  # ForwardBatch fields (encode_batch)
    drop: list[str] = field(default_factory=list)  # requests stage 0 dropped (abort, deadline, preemption)
    cache: bytes | None = None  # int32 page ids of the prefix cache, when the set changed
    host_ops: list[HostOp] | None = None  # host-tier copies to replay (host_replay)
    hold: dict[str, list[int]] = field(default_factory=dict)  # decode pipeline: new preallocations (mirrored)


# ---- the RPCs and the services ------------------------------------------------------------------------------

ANY = None  # Rpc.roles: any role holding the deployment's secret
ROUTER, PREFILL, DECODE = ("router",), ("prefill",), ("decode",)

PING: Rpc[Ping, PingReply] = Rpc(
    "ping", Ping, PingReply, "router, decode", "liveness: pid, boot, epoch", roles=ANY, retry=True
)
HEALTH: Rpc[HealthQuery, Health] = Rpc("health", HealthQuery, Health, "router, demo, tests", "state", ANY, True)
CHECK_INTEGRITY: Rpc[IntegrityQuery, str] = Rpc(
    "check_integrity", IntegrityQuery, str, "tests", "'ok' or what does not balance", ANY, True
)
CONNECT: Rpc[Connect, Connected] = Rpc(
    "connect", Connect, Connected, "router, stage 0", "handshake with a decode", ("router", "prefill")
)
SUBMIT: Rpc[Submit, Submitted] = Rpc("submit", Submit, Submitted, "router", "queue a prompt for prefill", ROUTER)
ABORT: Rpc[Abort, bool] = Rpc("abort", Abort, bool, "router", "drop a request, free its pages", ROUTER)
RELEASED: Rpc[Released, bool] = Rpc(
    "released", Released, bool, "stage k > 0", "stage k is done with the pages", PREFILL, retry=True
)
REVOKE: Rpc[Revoke, Revoked] = Rpc(
    "revoke", Revoke, Revoked, "decode", "never write a dropped request's pages; is a write in flight?", DECODE, True
)
HANDSHAKE: Rpc[Hello, HelloReply] = Rpc("handshake", Hello, HelloReply, "prefill stage k", "pair manifests", PREFILL)
PREALLOC: Rpc[Prealloc, Preallocated] = Rpc("prealloc", Prealloc, Preallocated, "router", "reserve pages", ROUTER)
STAGE_DONE: Rpc[StageDone, StageDoneReply] = Rpc(
    "stage_done", StageDone, StageDoneReply, "prefill stage k", "stage k's transfer finished or failed", PREFILL, True
)
KV_FAILED: Rpc[KvFailed, bool] = Rpc(
    "kv_failed", KvFailed, bool, "prefill stage k", "the prefill dropped it", PREFILL, retry=True
)
EVENTS: Rpc[EventsQuery, Events] = Rpc("events", EventsQuery, Events, "router", "token events after a cursor", ROUTER)
CACHE_EVENTS: Rpc[CacheEventsQuery, CacheEvents] = Rpc(
    "cache_events",
    CacheEventsQuery,
    CacheEvents,
    "router",
    "prefix-cache pages stored / removed after a cursor",
    ROUTER,
)

_WORKER = (PING, HEALTH, CHECK_INTEGRITY)
PREFILL_LEADER_SERVICE = Service("prefill stage 0", (*_WORKER, CONNECT, SUBMIT, ABORT, RELEASED, CACHE_EVENTS, REVOKE))
PREFILL_FOLLOWER_SERVICE = Service("prefill stage k", (*_WORKER, CONNECT, REVOKE))
DECODE_SERVICE = Service("decode", (*_WORKER, HANDSHAKE, PREALLOC, STAGE_DONE, KV_FAILED, EVENTS, ABORT))
DECODE_FOLLOWER_SERVICE = Service("decode stage k", _WORKER)  # KV lands by the backend; stage 0 answers the rest
SERVICES = (PREFILL_LEADER_SERVICE, PREFILL_FOLLOWER_SERVICE, DECODE_SERVICE, DECODE_FOLLOWER_SERVICE)


def fetch_health(addr: str, timeout: float = 5.0) -> Health:
    """One worker's Health (a fresh connection, closed after): for the demo, benches and tests."""
    from dsakv.disagg.protocol.rpc import RpcClient

    client = RpcClient(addr, timeout=timeout, connect_timeout=min(2.0, timeout))
    try:
        return client.request(HEALTH, HealthQuery())
    finally:
        client.close()
