"""StageFollower: stage k > 0 of every pipeline (the colocated `--pp-size`, the decode pipeline, the prefill pipeline),
one loop with the role's hooks (StageHooks):

    msg = receive from stage k-1 (bounded by the stage timeout) -> PipeStep (its payload: hooks.payload)
    books (under hooks.lock): drop (each one hooks.dropped allows), hooks.booked(step) (the payload's books: the
          prefill's host-tier replay, prefix-cache set and new jobs), then hold, into the stage's PageMirror
          (stage 0's allocator decides every page id)
    STEP: this stage's layers over the carried hidden states (and top-k) -> stage k+1 (the meta unchanged); the
          last stage runs hooks.last_stage instead; then hooks.stepped on every stage
    TICK / STOP: passed on unchanged (STOP: the caller's loop ends)
    IDLE: this stage's MoE layers with 0 rows (model/parallel.idle_forward: the round's expert-parallel
          collectives of a DP rank with no work, pipeline/dp_stage.py), then passed on like a tick

The default hooks (StageHooks itself) are a round-trip pipeline's: no payload, every drop releases its pages, the
last stage sends the logits (float32, one row per chunk, then the prompt-logprob positions a step names in its
`logits_at`) back to stage 0, where the Engine samples. The prefill's
hooks (disagg/prefill/follower.py): the last stage samples the first token, every stage sends its KV, and pages
are released once the stage's transfer reported.

A failed or timed-out send/receive raises StageLinkError (the group is broken); what to do then (re-form, exit)
is the caller's. Not thread-safe: one thread (the stage loop) runs it. Imports torch, dsakv.{cache, model},
engine.model_runner (logits at positions) and the pipeline's own modules.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Generic

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.engine.model_runner import logits_at
from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import StageCarry
from dsakv.model.parallel import idle_forward
from dsakv.pipeline.batch import decode_batch
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError, StageMessage
from dsakv.pipeline.step import IDLE, STEP, STOP, P, PayloadOf, PipeStep
from dsakv.util.stats import Stats


@dataclass
class FollowerStats(Stats):
    """A following stage's counters (a decode stage's health shows them)."""

    steps: int = 0  # steps this stage ran
    ticks: int = 0  # idle ticks passed on
    pages_peak: int = 0  # the most pages its mirror held at once


class StageHooks(Generic[P]):
    """A role's part of a later stage's loop; these defaults are a round-trip pipeline's (decode, colocated)."""

    payload: PayloadOf[P] | None = None  # decodes the steps' payload (None: the steps carry none)
    lock: AbstractContextManager[Any] = nullcontext()  # held while the books are applied

    def dropped(self, rid: str) -> bool:
        """Stage 0 dropped `rid`: True if its pages are free on this stage now."""
        return True

    def booked(self, step: PipeStep[P]) -> None:
        """The payload's books, after the drops and before the holds."""

    def last_stage(
        self, f: StageFollower[P], msg: StageMessage, step: PipeStep[P], batch: ForwardBatch, carry: StageCarry
    ) -> None:
        """The last stage's action after its layers: the logits back to stage 0 (float32, one row per chunk), then
        those at the positions the step's `logits_at` names, row after row (prompt logprobs)."""
        assert carry.logits is not None
        back = carry.logits.float()
        if step.logits_at is not None:
            starts = batch.prefix_lens.tolist()
            spans = [(a, a + n) for a, n in zip(starts, batch.extend_lens.tolist(), strict=True)]
            try:
                if len(step.logits_at) != len(spans):
                    raise ValueError(f"{len(step.logits_at)} rows of positions for a step of {len(spans)} rows")
                extra = logits_at(f.model, carry.hidden, spans, step.logits_at)
            except ValueError as e:  # a malformed step: the link breaks naming the field
                raise StageLinkError(f"stage {f.rank}: step {msg.step}: malformed pipeline step: logits_at: {e}") from e
            back = torch.cat([back, *(x.to(back.device) for x in extra)])
        f.group.send_to(0, StageMessage(msg.step, {}, back.cpu()))

    def stepped(self, step: PipeStep[P], batch: ForwardBatch, carry: StageCarry) -> None:
        """Every stage, after its layers ran and the step went on (or, on the last stage, after last_stage)."""


class StageFollower(Generic[P]):
    def __init__(
        self,
        group: StageGroup,
        model: Any,
        pool: DevicePool,
        mirror: PageMirror,
        stage_timeout: float,
        hooks: StageHooks[P] | None = None,
    ) -> None:
        self.group, self.model, self.pool, self.mirror = group, model, pool, mirror
        self.stage_timeout = stage_timeout
        self.hooks: StageHooks[P] = hooks if hooks is not None else StageHooks()
        self.rank, self.size = group.rank, group.size
        self.last = self.rank == self.size - 1
        self.stats = FollowerStats()

    def iteration(self) -> str:
        """Receive, mirror and run (or pass on) one message from stage k-1; its kind (STEP, TICK or STOP)."""
        hooks = self.hooks
        msg = self.group.recv_prev(timeout=self.stage_timeout)
        where = f"stage {self.rank}: step {msg.step} from stage {self.rank - 1}"
        step: PipeStep[P] = PipeStep.of_meta(msg.meta, where, hooks.payload)
        with hooks.lock:
            for rid in step.drop:
                if hooks.dropped(rid):
                    self.mirror.release(rid)
            hooks.booked(step)
            for rid, pages in step.hold.items():
                self.mirror.hold(rid, pages)
        self.stats.pages_peak = max(self.stats.pages_peak, self.mirror.num_used)
        if step.kind == IDLE:  # DP attention x PP: this DP rank's share of the round's all-to-alls, 0 rows
            idle_forward(self.model, self.pool.layout.main_layers)
        if step.kind != STEP:
            self.stats.ticks += step.kind != STOP
            if not self.last:
                self.group.send_next(msg)
            return step.kind
        if step.batch is None or msg.hidden is None:
            raise StageLinkError(f"stage {self.rank}: step {msg.step} arrived without its batch or hidden states")
        batch = decode_batch(step.batch)
        with torch.no_grad():
            carry = self.model.stage_forward(batch, self.pool, StageCarry(hidden=msg.hidden, topk=msg.topk))
        if self.last:
            hooks.last_stage(self, msg, step, batch, carry)
        else:
            self.group.send_next(StageMessage(msg.step, msg.meta, carry.hidden, carry.topk))
        hooks.stepped(step, batch, carry)
        self.stats.steps += 1
        return STEP

    def forget(self) -> None:
        """The pipeline broke: stage 0 failed what it held, so this stage's books are empty again."""
        for rid in self.mirror.owners:
            self.mirror.release(rid)
