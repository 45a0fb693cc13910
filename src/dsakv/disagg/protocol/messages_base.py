"""The messages every role shares (re-exported by protocol.messages, whose docstring draws the RPC graph):
logprobs on the wire, the numeric fields' bounds, liveness, health and integrity."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from dsakv.disagg.protocol.errors import MessageError
from dsakv.engine.request import TokenLogprobs

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


# Bounds of the numeric fields (the codec refuses a value outside them, and NaN / infinities everywhere); the time
# bounds MAX_KV_TIMEOUT and MAX_WAIT are dsakv.config.timeouts's (the flags are checked against them too)
MAX_QUARANTINE = 600.0  # seconds a timed-out transfer may ask the decode to keep the pages
MAX_STAGES = 256
MAX_ID = 2**31 - 1  # token ids, page ids


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
class DPRankInfo:
    """One DP rank of a prefill or decode instance with DP attention, as the last lockstep round saw it
    (disagg/decode/dp.py, disagg/prefill/dp.py)."""

    rank: int
    addr: str  # its RPC address (the router routes to it as a worker of its own)
    pages_free: int
    pages_used: int
    pages_total: int
    running: int
    waiting: int
    integrity_ok: bool
    up: bool = True  # False: out of the group (dead; rank 0 restarts it), `down` says why (its exit status)
    down: str | None = None


@dataclass(frozen=True)
class Health:
    """What every worker's HEALTH reply holds, whatever its role: liveness, its pool, counters and integrity, and
    where it sits in a pipeline. A worker answers with its role's subclass (PrefillHealth in messages_prefill,
    DecodeHealth in messages_decode), which adds only the fields that role fills; on the wire it is the map of
    its fields, and the reader's codec decodes it as the subclass its `role` names (`wire_variant`)."""

    ROLE: ClassVar[str] = ""  # the subclass's role ("prefill" | "decode"); the base is never built
    _BY_ROLE: ClassVar[dict[str, type[Health]]] = {}

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
    # prefill stage 0: the pipeline's stages; decode: the prefill stages that handshook with it
    stages: list[StageInfo] = field(default_factory=list)
    # a pipeline stage (prefill, or a pipelined decode)
    stage: int = 0
    num_stages: int = 1
    epoch: str | None = None
    down: str | None = None
    layers: list[int] | None = None
    waiting: int | None = None  # prefill stage 0, decode
    running: int | None = None  # prefill stage 0, decode (stage k > 0: the requests it mirrors)
    # DP attention (disagg/decode/dp.py, disagg/prefill/dp.py): this rank, the instance's size, every rank's RPC
    # address (rank order) and every rank's pages / requests / integrity from the last lockstep round
    dp_rank: int | None = None
    dp_size: int | None = None
    dp_addrs: list[str] | None = None
    dp_ranks: list[DPRankInfo] | None = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.ROLE:
            Health._BY_ROLE[cls.ROLE] = cls

    def __post_init__(self) -> None:
        if not type(self).ROLE:
            raise TypeError("Health is the common part: build a PrefillHealth or a DecodeHealth")
        if self.role != type(self).ROLE:
            raise ValueError(f"a {type(self).__name__} has role {type(self).ROLE!r}, not {self.role!r}")

    @classmethod
    def wire_variant(cls, data: Mapping[str, Any]) -> type[Health]:
        """The class a HEALTH map decodes as (codec hook): the subclass its "role" names."""
        sub = Health._BY_ROLE.get(data.get("role"))  # type: ignore[arg-type]
        if sub is None:
            raise MessageError(f"role: got {data.get('role')!r}, expected one of {sorted(Health._BY_ROLE)}")
        return sub
