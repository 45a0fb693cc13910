"""PipeStep: what stage 0 of every pipeline (the colocated `--pp-size`, the decode pipeline, the prefill pipeline)
tells the later stages with every step, while idle, and at shutdown:

    kind     STEP (a forward: `batch` holds the ForwardBatch fields, encode_batch), TICK (books only, so an idle
             stage's receive never times out), IDLE (DP attention x PP, pipeline/dp_stage.py: this DP rank ran no
             forward this round, so each stage runs its MoE layers' expert-parallel collectives with 0 rows) or
             STOP (the pipeline shuts down: every stage exits)
    hold     request id -> its pages as of this step (each later stage mirrors them in its PageMirror)
    drop     requests whose pages stage 0 freed (finished, aborted, preempted, failed); applied before `hold`
    payload  the role's own part, typed (None for a round-trip pipeline; the prefill's PrefillStep: its rows, new
             jobs, prefix-cache set and host-tier copies); the role's StageHooks.payload decodes it
    logits_at  a round-trip step whose rows want prompt logprobs: per row, the token positions whose logits the
             last stage sends back too, after the one row per chunk (each row's span is its batch row's)

It travels as the StageMessage meta (msgpack of plain data); `of_meta` checks every field's type (the payload:
its own of_meta), so a malformed message breaks the link with a StageLinkError naming the field instead of
failing later. StepBooks is stage 0's side of those books. Imports dsakv.{engine.scheduler, model.batch} and
the pipeline's own modules.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from dsakv.engine.scheduler import ScheduledChunk
from dsakv.model.batch import ForwardBatch
from dsakv.pipeline.batch import encode_batch
from dsakv.pipeline.stage_comm import StageLinkError

STEP, TICK, STOP, IDLE = "step", "tick", "stop", "idle"
KINDS = (STEP, TICK, STOP, IDLE)
FIELDS = ("kind", "batch", "hold", "drop", "payload", "logits_at")


class StepPayload(Protocol):
    """A role's typed part of a step: its wire form (plain data); the role decodes it with its own of_meta."""

    def meta(self) -> Any: ...


P = TypeVar("P", bound=StepPayload)
PayloadOf = Callable[[Any, str], P]  # (the payload's wire form, where) -> the payload; StageLinkError if malformed


@dataclass(frozen=True)
class PipeStep(Generic[P]):
    kind: str
    batch: dict[str, Any] | None = None
    hold: dict[str, list[int]] = field(default_factory=dict)
    drop: list[str] = field(default_factory=list)
    payload: P | None = None
    logits_at: list[list[int]] | None = None

    def meta(self) -> dict[str, Any]:
        m: dict[str, Any] = {"kind": self.kind, "batch": self.batch, "hold": self.hold, "drop": self.drop}
        if self.payload is not None:
            m["payload"] = self.payload.meta()
        if self.logits_at is not None:
            m["logits_at"] = self.logits_at
        return m

    @classmethod
    def of_meta(cls, meta: Any, where: str, payload: PayloadOf[P] | None = None) -> PipeStep[P]:
        """The PipeStep of a received meta map (its payload decoded by `payload`, which a role whose steps carry one
        gives); StageLinkError naming `where` and the bad field otherwise."""

        def bad(what: str) -> StageLinkError:
            return StageLinkError(f"{where}: malformed pipeline step: {what}")

        if not isinstance(meta, dict) or set(meta) - set(FIELDS):
            raise bad(f"meta {str(meta)[:120]!r} is not a map of {', '.join(FIELDS)}")
        kind = meta.get("kind")
        if kind not in KINDS:
            raise bad(f"kind {kind!r} is not one of {', '.join(KINDS)}")
        batch = meta.get("batch")
        if batch is not None and not isinstance(batch, dict):
            raise bad(f"batch is a {type(batch).__name__}, not a map")
        if kind == STEP and batch is None:
            raise bad("a step without its batch")
        hold = meta.get("hold") or {}
        if not isinstance(hold, dict) or not all(
            isinstance(r, str) and isinstance(p, list) and _ints(p) for r, p in hold.items()
        ):
            raise bad("hold is not a map of request id -> page ids")
        drop = meta.get("drop") or []
        if not isinstance(drop, list) or not all(isinstance(r, str) for r in drop):
            raise bad("drop is not a list of request ids")
        raw = meta.get("payload")
        if payload is None and raw is not None:
            raise bad("a payload, but this pipeline's steps carry none")
        got = payload(raw, f"{where}: malformed pipeline step: payload") if payload is not None else None
        at = meta.get("logits_at")
        if at is not None and (
            kind != STEP or not isinstance(at, list) or not all(isinstance(p, list) and _ints(p) for p in at)
        ):
            raise bad(f"logits_at {str(at)[:120]!r} is not a list of token positions per row of a step")
        positions = None if at is None else [list(p) for p in at]
        return cls(kind, batch, {r: list(p) for r, p in hold.items()}, list(drop), got, positions)


def _ints(xs: list[Any]) -> bool:
    return all(isinstance(i, int) for i in xs)


class StepBooks:
    """Stage 0's side of the books later stages mirror: pages held per request since the last message, requests
    dropped since; thread-safe (drops come from the stepping thread and from aborts on other threads)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hold: dict[str, list[int]] = {}
        self._drop: list[str] = []

    def held(self, rid: str, pages: Sequence[int]) -> None:
        with self._lock:
            self._hold[rid] = [int(p) for p in pages]

    def dropped(self, rid: str) -> None:
        with self._lock:
            self._hold.pop(rid, None)
            self._drop.append(rid)

    @property
    def pending(self) -> bool:
        with self._lock:
            return bool(self._hold or self._drop)

    def clear(self) -> None:
        with self._lock:
            self._hold, self._drop = {}, []

    def take(self) -> tuple[dict[str, list[int]], list[str]]:
        with self._lock:
            hold, drop, self._hold, self._drop = self._hold, self._drop, {}, []
        return hold, drop

    def step(self, chunks: Sequence[ScheduledChunk], batch: ForwardBatch, payload: P | None = None) -> PipeStep[P]:
        """The STEP message of a forward over `chunks` (every row's pages held as of this step)."""
        hold, drop = self.take()
        hold.update({c.request.request_id: [int(p) for p in c.request.page_ids] for c in chunks})
        return PipeStep(STEP, encode_batch(batch), hold, drop, payload)

    def tick(self, kind: str = TICK, payload: P | None = None) -> PipeStep[P]:
        hold, drop = self.take()
        return PipeStep(kind, None, hold, drop, payload)
