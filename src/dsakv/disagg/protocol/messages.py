"""The typed control plane: every message of disaggregated serving as a dataclass, and every role's RPCs.

Messages travel through the one codec (dsakv.disagg.protocol.codec: a dataclass is a msgpack map of its fields,
checked against its type hints on arrival) inside the RPC frames of dsakv.disagg.protocol.rpc, or (JobSpec, in the
prefill's PrefillStep payload of a pipeline.step.PipeStep) inside the per-step header of dsakv.pipeline.stage_comm.
The RPC graph (who calls what; `Rpc.caller`):

    router ──────────────── health / ping ─────────────────────────► every worker (prefill stage 0, decode)
                                             (-> PrefillHealth / DecodeHealth: a Health, decoded by its role)
    router ── connect(Connect) ──► prefill stage 0 ── connect ──► stage k > 0        (-> Connected)
    prefill stage k ─────── handshake(Hello) ─────────────────────► decode            (-> HelloReply)
    router ── prealloc(Prealloc) ─────────────────────────────────► decode            (-> Preallocated: pages)
    router ── submit(Submit: the decode's pages) ─► prefill stage 0                   (-> Submitted)
    prefill stage 0 ═══ step/tick (PipeStep + PrefillStep, hidden, top-k; gloo) ═══► stage 1 ═══► ... stage N-1
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

from dataclasses import dataclass
from typing import TypeVar

from dsakv.disagg.protocol.errors import MessageError
from dsakv.disagg.protocol.messages_base import (
    MAX_ID,
    MAX_QUARANTINE,
    MAX_STAGES,
    Blob,
    DPRankInfo,
    Health,
    HealthQuery,
    IntegrityQuery,
    LinkSummary,
    Ping,
    PingReply,
    StageInfo,
    WireLogprobs,
    unpack_logprobs,
)
from dsakv.disagg.protocol.messages_decode import (
    DecodeHealth,
    DecodeStageRef,
    EventRow,
    Events,
    EventsQuery,
    Hello,
    HelloReply,
    KvFailed,
    Prealloc,
    Preallocated,
    StageDone,
    StageDoneReply,
)
from dsakv.disagg.protocol.messages_prefill import (
    Abort,
    CacheEvents,
    CacheEventsQuery,
    Connect,
    Connected,
    PrefillHealth,
    Released,
    Revoke,
    Revoked,
    Submit,
    Submitted,
    TransferHealth,
)
from dsakv.disagg.protocol.rpc import Rpc, Service
from dsakv.engine.request import SamplingParams

H = TypeVar("H", bound=Health)

# ---- the prefill pipeline step's new jobs (disagg/prefill/step.py: PrefillStep.jobs) -------------------------


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
    """One worker's Health (a fresh connection, closed after): for the demo, benches and tests. It is the
    worker's role's subclass (PrefillHealth or DecodeHealth); prefill_health / decode_health also check which."""
    from dsakv.disagg.protocol.rpc import RpcClient

    client = RpcClient(addr, timeout=timeout, connect_timeout=min(2.0, timeout))
    try:
        return client.request(HEALTH, HealthQuery())
    finally:
        client.close()


def _of_role(addr: str, h: Health, want: type[H]) -> H:
    if not isinstance(h, want):
        raise MessageError(f"health reply from {addr}: a {h.role} worker, expected a {want.ROLE} one")
    return h


def prefill_health(addr: str, timeout: float = 5.0) -> PrefillHealth:
    """fetch_health of a prefill stage (MessageError if `addr` is another role's worker)."""
    return _of_role(addr, fetch_health(addr, timeout), PrefillHealth)


def decode_health(addr: str, timeout: float = 5.0) -> DecodeHealth:
    """fetch_health of a decode worker or decode pipeline stage (MessageError if it is another role's)."""
    return _of_role(addr, fetch_health(addr, timeout), DecodeHealth)


__all__ = [
    "ABORT",
    "ANY",
    "Abort",
    "Blob",
    "CACHE_EVENTS",
    "CHECK_INTEGRITY",
    "CONNECT",
    "CacheEvents",
    "CacheEventsQuery",
    "Connect",
    "Connected",
    "DECODE_FOLLOWER_SERVICE",
    "DECODE_SERVICE",
    "DecodeHealth",
    "DPRankInfo",
    "DecodeStageRef",
    "EVENTS",
    "EventRow",
    "Events",
    "EventsQuery",
    "HANDSHAKE",
    "HEALTH",
    "Health",
    "HealthQuery",
    "Hello",
    "HelloReply",
    "IntegrityQuery",
    "JobSpec",
    "KV_FAILED",
    "KvFailed",
    "LinkSummary",
    "MAX_ID",
    "MAX_QUARANTINE",
    "MAX_STAGES",
    "PING",
    "PREALLOC",
    "PREFILL_FOLLOWER_SERVICE",
    "PREFILL_LEADER_SERVICE",
    "Ping",
    "PingReply",
    "PrefillHealth",
    "Prealloc",
    "Preallocated",
    "RELEASED",
    "REVOKE",
    "Released",
    "Revoke",
    "Revoked",
    "SERVICES",
    "STAGE_DONE",
    "SUBMIT",
    "StageDone",
    "StageDoneReply",
    "StageInfo",
    "Submit",
    "Submitted",
    "TransferHealth",
    "WireLogprobs",
    "decode_health",
    "fetch_health",
    "prefill_health",
    "unpack_logprobs",
]
