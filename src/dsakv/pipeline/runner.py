"""The Engine's StepRunner on a pipeline's stage 0: runs this stage's layers and leaves the step message for stage 1
in `outbox` (PipelineRunner: a prefill pipeline's leader, whose last stage samples), or sends it at once and gets
the last stage's logits back so the Engine samples on stage 0 (RoundTripRunner: the decode pipeline and the
colocated `--pp-size`). The step message's type is the role's (`step_msg` builds it, `encode` puts it on the wire).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Generic, Protocol, TypeVar

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.engine.model_runner import build_batch, logits_at
from dsakv.engine.sampling import sample_batch
from dsakv.engine.scheduler import ScheduledChunk
from dsakv.engine.speculative import draft_prefill
from dsakv.errors import ConfigError
from dsakv.model.dsa_model import DSAModel
from dsakv.model.mtp import MTPDraft
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError, StageMessage
from dsakv.pipeline.step import PipeStep

M = TypeVar("M")


class RunnerContext(Protocol):
    """What a PipelineRunner reads of its stage (a prefill StageContext, or a decode pipeline's stage 0)."""

    @property
    def model(self) -> DSAModel: ...

    @property
    def page_size(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def last(self) -> bool: ...

    @property
    def draft(self) -> MTPDraft | None: ...

    def draft_hidden(self, hidden: torch.Tensor) -> bytes: ...


class PipelineRunner(Generic[M]):
    """The Engine's StepRunner on stage 0: runs this stage's layers and leaves the step for stage 1 in `outbox`
    (the leader sends it once Engine.step returned: the gloo send waits for stage 1, and the engine's lock is
    not held meanwhile, so submissions and health are answered while the pipeline is busy)."""

    def __init__(
        self,
        ctx: RunnerContext,
        pool: DevicePool,
        step_msg: Callable[[Sequence[ScheduledChunk], Any], M],
        encode: Callable[[M], dict[str, Any]],
    ) -> None:
        self.ctx = ctx
        self.pool = pool
        self.step_msg = step_msg
        self.encode = encode
        self.step = 0
        self.ran = False
        self.outbox: tuple[StageMessage, M] | None = None
        self.draft_out: dict[str, bytes] = {}  # MTP (pp_size 1): this step's draft hidden per finished prompt
        if ctx.last:  # the Engine computes prompt logprobs where the last layer is (here only when pp_size is 1)
            self.run_with_prompt_logits = self._run_with_prompt_logits

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        return self._forward(chunks)[0]

    def _run_with_prompt_logits(
        self, chunks: Sequence[ScheduledChunk], positions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        logits, hidden = self._forward(chunks)
        return logits, logits_at(self.ctx.model, hidden, [(c.start, c.end) for c in chunks], positions)

    def _forward(self, chunks: Sequence[ScheduledChunk]) -> tuple[torch.Tensor | None, torch.Tensor]:
        self.ran = True
        self.step += 1
        self.draft_out = {}
        batch = build_batch(chunks, self.ctx.page_size)
        meta = self.step_msg(chunks, batch) if self.ctx.size > 1 else None
        with torch.no_grad():
            carry = self.ctx.model.stage_forward(batch, self.pool)
        if meta is not None:
            self.outbox = (StageMessage(self.step, self.encode(meta), carry.hidden, carry.topk), meta)
        if self.ctx.draft is not None and carry.logits is not None:
            self._draft(chunks, batch, carry.hidden, carry.logits)
        return (carry.logits if self.ctx.last else None), carry.hidden

    def _draft(self, chunks: Sequence[ScheduledChunk], batch: Any, hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """MTP on a single-stage prefill: the draft layer's KV for the step's tokens; a finished prompt's token
        after it is the first token, drawn here as the Engine draws it next (the request's seeded stream)."""
        assert self.ctx.draft is not None
        rows = [i for i, c in enumerate(chunks) if c.samples]
        # a row that cannot be sampled drafts after token 0 (the Engine fails that request alone right after)
        toks = sample_batch(logits[rows], [chunks[i].request for i in rows]).tokens if rows else []
        firsts = dict(zip(rows, toks, strict=True))
        after = [firsts[i] if i in firsts else c.request.token_ids(c.end, c.end + 1)[0] for i, c in enumerate(chunks)]
        out = draft_prefill(self.ctx.model, self.ctx.draft, self.pool, batch, hidden, after)
        for i in rows:
            self.draft_out[chunks[i].request.request_id] = self.ctx.draft_hidden(out[i])


class RoundTripContext(RunnerContext, Protocol):
    """What a RoundTripRunner reads of stage 0 beyond a RunnerContext: its group and the bound on the logits' wait."""

    @property
    def group(self) -> StageGroup: ...

    @property
    def stage_timeout(self) -> float: ...


@dataclass
class Stage0:
    """The RoundTripContext of stage 0 of a round-trip pipeline (never its last stage; no MTP draft)."""

    model: DSAModel
    page_size: int
    size: int
    group: StageGroup
    stage_timeout: float
    last: bool = False
    draft: None = None

    def draft_hidden(self, hidden: torch.Tensor) -> bytes:
        raise ConfigError("stage 0 of a round-trip pipeline runs no MTP draft layer")


class RoundTripRunner(PipelineRunner[PipeStep]):
    """Stage 0's StepRunner of a round-trip pipeline: this stage's layers, the step on to stage 1 at once, and the
    last stage's logits back (float32, one row per chunk), so the Engine samples as a single-process one does;
    with prompt logprobs (run_with_prompt_logits) also the logits at the prompt positions they need.

    `on_sent()` runs after every send (the idle tick's clock); `on_error(e)` turns a broken link into the error the
    step's requests fail with (e.g. naming a stage process that died); `broken` keeps its text for the caller."""

    ctx: RoundTripContext

    def __init__(
        self,
        ctx: RoundTripContext,
        pool: DevicePool,
        step_msg: Callable[[Sequence[ScheduledChunk], Any], PipeStep],
        encode: Callable[[PipeStep], dict[str, Any]],
        on_sent: Callable[[], None] | None = None,
        on_error: Callable[[StageLinkError], Exception] | None = None,
    ) -> None:
        self._logits_at: list[list[int]] | None = None
        super().__init__(ctx, pool, lambda c, b: replace(step_msg(c, b), logits_at=self._logits_at), encode)
        self.on_sent = on_sent
        self.on_error = on_error
        self.broken: str | None = None

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None:
        return self._round_trip(chunks, None)

    def run_with_prompt_logits(
        self, chunks: Sequence[ScheduledChunk], positions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor | None, list[torch.Tensor]]:
        """run(), plus the float32 logits at the given token positions of each chunk (prompt logprobs), which the
        last stage computes from its hidden states and returns after the one row per chunk."""
        at = [[int(t) for t in p] for p in positions]
        back = self._round_trip(chunks, at)
        return back[: len(chunks)], list(back[len(chunks) :].split([len(p) for p in at]))

    def _round_trip(self, chunks: Sequence[ScheduledChunk], at: list[list[int]] | None) -> torch.Tensor:
        self._logits_at = at  # the step message built by super().run names them (PipeStep.logits_at)
        try:
            super().run(chunks)
        finally:
            self._logits_at = None
        assert self.outbox is not None
        msg, _ = self.outbox
        self.outbox = None
        want = len(chunks) + (sum(len(p) for p in at) if at is not None else 0)
        g, last = self.ctx.group, self.ctx.size - 1
        try:
            g.send_next(msg)
            if self.on_sent is not None:
                self.on_sent()
            back = g.recv_from(last, self.ctx.stage_timeout, dtype=torch.float32)
            if back.step != self.step or back.hidden is None or back.hidden.shape[0] != want:
                why = (
                    f"stage 0: step {self.step} got logits of step {back.step} for "
                    f"{None if back.hidden is None else back.hidden.shape[0]} rows from stage {last}, not "
                    f"{want}"
                )
                g.break_(why)
                raise StageLinkError(why)
        except StageLinkError as e:
            err = self.on_error(e) if self.on_error is not None else e
            self.broken = str(err)
            if err is e:
                raise
            raise err from e
        return back.hidden.to(self.ctx.model.device)
