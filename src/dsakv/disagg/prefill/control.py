"""The prefill leader's control events: what the RPC threads (ABORT, RELEASED) and the KvSender (a transfer
reported) queue for the leader's loop, which applies them between engine steps (PipelineLeader._apply_control)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AbortJob:
    """The router aborted request `rid`: drop it if it is still computing (a transferring one ends by itself)."""

    rid: str
    why: str


@dataclass(frozen=True)
class StageReleased:
    """Stage `stage` is done with request `rid`'s pages (its transfer reported): one of the N releases."""

    rid: str
    stage: int


ControlEvent = AbortJob | StageReleased

__all__ = ["AbortJob", "ControlEvent", "StageReleased"]
