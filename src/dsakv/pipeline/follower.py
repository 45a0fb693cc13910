"""StageFollower: stage k > 0 of a round-trip pipeline (the colocated `--pp-size`, the decode pipeline).

    msg = receive from stage k-1 (bounded by the stage timeout) -> PipeStep
    books: drop, then hold, into the stage's PageMirror (stage 0's allocator decides every page id)
    STEP: this stage's layers over the carried hidden states (and top-k) -> stage k+1; the last stage sends the
          logits (float32, one row per chunk) back to stage 0, where the Engine samples
    TICK / STOP: passed on unchanged (STOP: the caller's loop ends)

A failed or timed-out send/receive raises StageLinkError (the group is broken); what to do then (re-form, exit)
is the caller's. Not thread-safe: one thread (the stage loop) runs it. Imports torch, dsakv.{cache, model} and
the pipeline's own modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.model.dsa_model import StageCarry
from dsakv.pipeline.batch import decode_batch
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError, StageMessage
from dsakv.pipeline.step import STEP, STOP, PipeStep
from dsakv.util.stats import Stats


@dataclass
class FollowerStats(Stats):
    """A following stage's counters (a decode stage's health shows them)."""

    steps: int = 0  # steps this stage ran
    ticks: int = 0  # idle ticks passed on
    pages_peak: int = 0  # the most pages its mirror held at once


class StageFollower:
    def __init__(
        self, group: StageGroup, model: Any, pool: DevicePool, mirror: PageMirror, stage_timeout: float
    ) -> None:
        self.group, self.model, self.pool, self.mirror = group, model, pool, mirror
        self.stage_timeout = stage_timeout
        self.rank, self.size = group.rank, group.size
        self.last = self.rank == self.size - 1
        self.stats = FollowerStats()

    def iteration(self) -> str:
        """Receive, mirror and run (or pass on) one message from stage k-1; its kind (STEP, TICK or STOP)."""
        msg = self.group.recv_prev(timeout=self.stage_timeout)
        step = PipeStep.of_meta(msg.meta, f"stage {self.rank}: step {msg.step} from stage {self.rank - 1}")
        for rid in step.drop:
            self.mirror.release(rid)
        for rid, pages in step.hold.items():
            self.mirror.hold(rid, pages)
        self.stats.pages_peak = max(self.stats.pages_peak, self.mirror.num_used)
        if step.kind != STEP:
            self.stats.ticks += step.kind != STOP
            if not self.last:
                self.group.send_next(msg)
            return step.kind
        if step.batch is None or msg.hidden is None:
            raise StageLinkError(f"stage {self.rank}: step {msg.step} arrived without its batch or hidden states")
        with torch.no_grad():
            carry = self.model.stage_forward(
                decode_batch(step.batch), self.pool, StageCarry(hidden=msg.hidden, topk=msg.topk)
            )
        if self.last:
            assert carry.logits is not None
            self.group.send_to(0, StageMessage(msg.step, {}, carry.logits.float().cpu()))
        else:
            self.group.send_next(StageMessage(msg.step, msg.meta, carry.hidden, carry.topk))
        self.stats.steps += 1
        return STEP

    def forget(self) -> None:
        """The pipeline broke: stage 0 failed what it held, so this stage's books are empty again."""
        for rid in self.mirror.owners:
            self.mirror.release(rid)
