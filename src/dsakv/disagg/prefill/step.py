"""PrefillStep: the prefill's payload of a pipeline step (pipeline.step.PipeStep.payload), stage 0 -> every later stage.

    rows      one PrefillRow per sequence of the step, in batch order: tokens [start, start + num_tokens) of the
              request (its pages are the PipeStep's `hold`); `last`: the prompt's last chunk (the stage transfers
              the request after this step); `next_token`: the prompt token after a chunk that is not the last
              (the MTP draft layer's last entry)
    jobs      the requests whose first chunk is in this step: where their KV goes and by when (messages.JobSpec)
    cache     int32 page ids of the prefix cache, when its set changed (PageMirror.set_cached)
    host_ops  the host-tier copies stage 0 made since the last message, to replay first (pipeline.host_replay)

The PipeStep's `drop` is the prefill's drops (a request aborted, expired or preempted on stage 0); every stage
frees a request's pages only once its transfer reported (stage 0: once every stage released them).
`PrefillStep.of_meta` checks every field against the type hints (the one codec) and what the types cannot say
(host ops that pair, whole int32 page ids), so a malformed step breaks the link with a StageLinkError naming
the field. Imports dsakv.disagg.protocol and dsakv.pipeline only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.errors import MessageError
from dsakv.disagg.protocol.messages import JobSpec
from dsakv.pipeline.host_replay import HostOp
from dsakv.pipeline.stage_comm import StageLinkError


@dataclass(frozen=True)
class PrefillRow:
    """One sequence of a prefill step: tokens [start, start + num_tokens) of request rid."""

    rid: str
    start: int
    num_tokens: int
    last: bool  # the prompt's last chunk: the stage transfers the request after this step
    next_token: int | None = None  # the prompt token after this chunk (not last): the draft layer's last entry


@dataclass(frozen=True)
class PrefillStep:
    """What a prefill's later stages need of a step (or a tick: no rows, no jobs) beyond the PipeStep's books."""

    rows: list[PrefillRow] = field(default_factory=list)
    jobs: dict[str, JobSpec] = field(default_factory=dict)  # requests whose first chunk is in this step
    cache: bytes | None = None  # int32 page ids of the prefix cache, when the set changed
    host_ops: list[HostOp] | None = None  # host-tier copies to replay (pipeline.host_replay)

    def meta(self) -> Any:
        return to_wire(self)

    @classmethod
    def of_meta(cls, meta: Any, where: str) -> PrefillStep:
        """The PrefillStep of a received payload; StageLinkError naming `where` and the bad field otherwise."""
        if meta is None:
            raise StageLinkError(f"{where}: missing (every prefill step and tick carries one)")
        try:
            step = from_wire(cls, meta, "PrefillStep")
        except MessageError as e:
            raise StageLinkError(f"{where}: {e}") from None
        if step.cache is not None and len(step.cache) % 4:
            raise StageLinkError(f"{where}: PrefillStep.cache: {len(step.cache)} bytes are not int32 page ids")
        for i, op in enumerate(step.host_ops or ()):
            why = op.problem()
            if why is not None:
                raise StageLinkError(f"{where}: PrefillStep.host_ops[{i}]: {why}")
        for rid, job in step.jobs.items():
            if job.rid != rid:
                raise StageLinkError(f"{where}: PrefillStep.jobs[{rid!r}]: the job of request {job.rid!r}")
        return step


__all__ = ["PrefillRow", "PrefillStep"]
