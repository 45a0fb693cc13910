"""The decode's messages (re-exported by protocol.messages): the prefill stages' and the router's calls to a
decode (handshake, prealloc, stage_done, kv_failed, events), and a decode worker's HEALTH reply (DecodeHealth)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from dsakv.config import MAX_KV_TIMEOUT, MAX_WAIT
from dsakv.disagg.protocol.codec import bounds
from dsakv.disagg.protocol.messages_base import (
    MAX_ID,
    MAX_QUARANTINE,
    MAX_STAGES,
    Blob,
    Health,
    StageInfo,
    WireLogprobs,
)
from dsakv.engine.request import SamplingParams

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
    tp_size: int = field(default=1, metadata=bounds(1, MAX_STAGES))  # the stage's TP ranks (each holds its keys)


@dataclass(frozen=True)
class DecodeStageRef:
    """One stage of a pipelined decode worker (or one TP rank r >= 1 of a stage: its own pool), as its stage 0 tells
    a prefill stage at handshake."""

    stage: int
    rpc: str
    manifest: bytes
    boot: str = ""
    rank: int = field(default=0, metadata=bounds(0, MAX_STAGES - 1))  # HelloReply.ranks: the stage's TP rank


@dataclass(frozen=True)
class HelloReply:
    manifest: bytes
    boot: str
    name: str
    stages: list[DecodeStageRef] = field(default_factory=list)  # a pipelined decode: every stage (its keys there)
    ranks: list[DecodeStageRef] = field(default_factory=list)  # a TP decode: every stage's ranks 1.., own pools
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
    # a TP prefill stage (senders > 1 ranks, each its own pool): bytes landed per prefill rank -> decode rank, and
    # the (prefill rank, decode rank) routes the sender rule gave the request (each must have landed)
    senders: int = field(default=1, metadata=bounds(1, MAX_STAGES))
    sender_parts: dict[int, dict[int, int]] = field(default_factory=dict)
    routes: list[list[int]] = field(default_factory=list)


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


# ---- health ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DecodeHealth(Health):
    """A decode worker's (or decode pipeline stage's) HEALTH reply: the common part and what a decode fills."""

    ROLE: ClassVar[str] = "decode"

    bytes_per_token: int | None = None
    max_prompt_tokens: int | None = None
    inbound: int | None = None
    failed_held: int | None = None
    spec: dict[str, float] | None = None  # decode with MTP: Engine.spec_stats()
    pipeline: list[StageInfo] | None = None  # pipelined decode, stage 0: every decode stage (rpc, pid, layers)
    kv_bytes_pairs: dict[str, int] | None = None  # pipelined decode, stage 0: "<prefill>:<k>-><j>" -> bytes landed
    staging_slots: list[int] | None = None  # decode with destination staging: [free, total] slots
    vocab_size: int | None = None  # decode: the model's vocabulary (the router 400s token ids >= it)
    features: list[str] | None = None  # engine.backend.FEATURES it serves (None: all; a DeepSeek-V4 decode: none)
