"""The Engine's step loop (a mixin of engine.Engine): schedule, run the rows (forward, prompt logprobs, sampling),
fail a row alone or the whole step, speculative steps (engine/speculative.py), and the token counters."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from dsakv.cache.allocator import IntegrityError, PageAllocator
from dsakv.engine.build import StepRunner
from dsakv.engine.request import RequestOutput
from dsakv.engine.sampling import prompt_logprob_positions, prompt_token_logprobs, sample_batch
from dsakv.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from dsakv.errors import DsakvError, StepRetry

log = logging.getLogger("dsakv.engine.engine")


class EngineStep:
    """Needs (set by Engine.__init__) the attributes below."""

    scheduler: Scheduler
    allocator: PageAllocator
    runner: StepRunner
    speculator: Any
    on_schedule: Callable[[SchedulerOutput], None] | None
    check_every_step: bool
    _lock: threading.RLock
    _pending: list[RequestOutput]
    _held: SchedulerOutput | None
    _steps: int
    _prefill_tokens: int
    _decode_tokens: int
    _generated: int

    if TYPE_CHECKING:

        def check_integrity(self) -> None: ...

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of every request that got a token, finished, failed or was aborted."""
        with self._lock:
            outputs, self._pending = self._pending, []
            sched, self._held = self._held, None
            if sched is not None:  # a step a re-formed group interrupted: the same rows again (aborts left out)
                sched = SchedulerOutput([c for c in sched.chunks if not c.request.is_finished], sched.preempted)
            else:
                sched = self.scheduler.schedule()
                if self.on_schedule is not None:
                    self.on_schedule(sched)
            if sched.is_empty:
                sch = self.scheduler
                # requests waiting on pages that only an outside event frees (a KV transfer, a release) are not
                # stalled; anything else that cannot run with nothing running is a bug: fail loudly, never spin
                if sch.has_unfinished() and not (sched.preempted or sch.awaiting_kv or sch.kept):
                    raise IntegrityError(
                        f"scheduler stalled: {self.scheduler.num_waiting} waiting and {self.scheduler.num_running} "
                        f"running requests but nothing could be scheduled ({self.allocator.num_free} pages free)"
                    )
                return outputs
            self._steps += 1
            if self.speculator is not None:
                return self._spec_step(sched, outputs)
            chunks = sched.chunks
            errors: dict[int, str] = {}  # chunk index -> its request's own error: that request fails alone
            try:
                next_tokens = self._run_rows(chunks, errors)
            except StepRetry:
                self._hold(sched, outputs)
                raise
            except Exception as e:  # the step failed: its requests finish with the error, pages come back
                sched = self._fail_rows(sched, outputs, errors)
                return self._fail_step(sched, outputs, e, "model")
            if errors:
                next_tokens = [t for i, t in enumerate(next_tokens) if i not in errors]
                sched = self._fail_rows(sched, outputs, errors)
                chunks = sched.chunks
            self._count_tokens(chunks)
            got = self.scheduler.update(sched, next_tokens)
            self._generated += len(got)
            outputs.extend(RequestOutput.of(r, 1) for r in got)
            if self.check_every_step:
                self.check_integrity()
            return outputs

    def _hold(self, sched: Any, outputs: list[RequestOutput]) -> None:
        """The step's collective broke (a rank died, engine/dp.py): hold it for the re-formed group, nothing lost."""
        self._held, self._pending = sched, outputs + self._pending
        self._steps -= 1

    def _run_rows(self, chunks: Sequence[ScheduledChunk], errors: dict[int, str]) -> list[int | None]:
        """The step's forward and sampling; a row whose admission (HiSparse), prompt logprobs, logits or sampling
        fails gets errors[i] (the others go on without it). The token of each chunk (None: it did not sample)."""
        prepare = getattr(self.runner, "prepare_rows", None)  # HiSparse: rows the pool cannot take fail alone
        if prepare is not None:
            errors.update(prepare(chunks))
        idx = [i for i in range(len(chunks)) if i not in errors]
        run = [chunks[i] for i in idx]
        next_tokens: list[int | None] = [None] * len(chunks)
        if not run:
            return next_tokens
        positions = [self._prompt_logprob_positions(c) for c in run]
        with_prompt = getattr(self.runner, "run_with_prompt_logits", None)  # ModelRunner (all layers)
        if any(positions) and with_prompt is not None:
            logits, extra = with_prompt(run, positions)
            for j, err in self._add_prompt_logprobs(run, positions, extra).items():
                errors[idx[j]] = err
        else:
            logits = self.runner.run(run)
        rows = [j for j, c in enumerate(run) if c.samples and idx[j] not in errors]
        if rows and logits is None:  # a later pipeline stage samples: placeholder tokens here
            for j in rows:
                next_tokens[idx[j]] = 0
        elif rows:
            assert logits is not None
            picked = logits if len(rows) == len(run) else logits[rows]  # decode: every row samples
            got = sample_batch(picked, [run[j].request for j in rows])
            for j, t, lp, bad in zip(rows, got.tokens, got.logprobs, got.errors, strict=True):
                if bad is not None:
                    errors[idx[j]] = bad
                    continue
                next_tokens[idx[j]] = t
                if lp is not None:
                    run[j].request.output_logprobs.append(lp)
        return next_tokens

    def _fail_rows(
        self, sched: SchedulerOutput, outputs: list[RequestOutput], errors: dict[int, str]
    ) -> SchedulerOutput:
        """Fail the requests of the rows in `errors` alone (pages freed); the step without them."""
        if not errors:
            return sched
        for i, err in sorted(errors.items()):
            log.warning("request %s failed alone in its step: %s", sched.chunks[i].request.request_id, err)
        rest, failed = self.scheduler.fail_rows(sched, errors)
        if self.speculator is not None:
            for r in failed:
                self.speculator.forget(r.request_id)
        outputs.extend(RequestOutput.of(r, 0) for r in failed)
        return rest

    def _fail_step(self, sched: Any, outputs: list[RequestOutput], e: Exception, what: str) -> list[RequestOutput]:
        """A step raised: its requests finish with the error and their pages (and draft state) come back."""
        say = log.error if isinstance(e, DsakvError) else log.exception  # a known failure: its message says it all
        say("%s step failed for %d requests: %s: %s", what, len(sched.chunks), type(e).__name__, e)
        failed = self.scheduler.fail(sched, f"model step failed: {type(e).__name__}: {e}")
        if self.speculator is not None:
            for r in failed:
                self.speculator.forget(r.request_id)
        outputs.extend(RequestOutput.of(r, 0) for r in failed)
        if self.check_every_step:
            self.check_integrity()
        return outputs

    def _spec_step(self, sched: Any, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """step() with speculative decoding (engine/speculative.py): draft, verify, accept, roll back."""
        chunks = sched.chunks
        positions = [self._prompt_logprob_positions(c) for c in chunks]
        try:
            produced = self.speculator.run(chunks, positions)
        except StepRetry:  # the verify's all-to-all broke: nothing kept yet (drafts and states change after it)
            self._hold(sched, outputs)
            raise
        except Exception as e:  # the step failed: its requests finish with the error, pages come back
            return self._fail_step(sched, outputs, e, "speculative")
        errors = dict(self.speculator.errors)
        if any(positions):  # prompt logprobs of the prefill chunks that asked (a NaN fails that request alone)
            for i, err in self._add_prompt_logprobs(chunks, positions, self.speculator.prompt_logits).items():
                errors.setdefault(i, err)
        if errors:
            produced = [t for i, t in enumerate(produced) if i not in errors]
            sched = self._fail_rows(sched, outputs, errors)
            chunks = sched.chunks
        self._count_tokens(chunks)
        before = {c.request.request_id: c.request.num_output_tokens for c in chunks}
        got = self.scheduler.update_spec(sched, produced)
        for r in got:
            n = r.num_output_tokens - before[r.request_id]
            self._generated += n
            self.speculator.keep_logprobs(r, n)
            outputs.append(RequestOutput.of(r, n))
            if r.is_finished:
                self.speculator.forget(r.request_id)
        self.speculator.prune(self.scheduler.requests)
        if self.check_every_step:
            self.check_integrity()
        return outputs

    def spec_stats(self) -> dict[str, float] | None:
        """Speculative decoding counters (acceptance rate, mean accepted length, ...), None without speculation."""
        with self._lock:
            return self.speculator.stats.to_dict() if self.speculator is not None else None

    def _count_tokens(self, chunks: Sequence[Any]) -> None:
        """The step's decode tokens (a decode chunk: its token and its verified drafts) and prefill tokens."""
        for c in chunks:
            if c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens:
                self._decode_tokens += 1 + c.num_draft
            else:
                self._prefill_tokens += c.num_tokens

    @staticmethod
    def _prompt_logprob_positions(c: Any) -> list[int]:
        """Positions of chunk c whose logits give a prompt token's logprob (position t -> prompt token t + 1)."""
        req = c.request
        return prompt_logprob_positions(req.params, c.start, c.end, len(req.prompt_logprobs), req.num_prompt_tokens)

    @staticmethod
    def _add_prompt_logprobs(
        chunks: Sequence[Any], positions: list[list[int]], extra: list[torch.Tensor]
    ) -> dict[int, str]:
        """Prompt logprobs of each chunk; a chunk whose logits cannot give them (NaN) is returned by index with its
        error (that request fails alone)."""
        errors: dict[int, str] = {}
        for j, (c, pos, lg) in enumerate(zip(chunks, positions, extra, strict=True)):
            if not pos:
                continue
            req = c.request
            if pos[0] != len(req.prompt_logprobs):
                raise IntegrityError(
                    f"{req.request_id}: prompt logprobs from position {pos[0]}, has {len(req.prompt_logprobs)}"
                )
            k = int(req.params.prompt_logprobs or 0)
            try:
                req.prompt_logprobs.extend(prompt_token_logprobs(lg, req.prompt_ids, pos, k))
            except Exception as e:
                errors[j] = f"prompt logprobs failed: {type(e).__name__}: {e}"
        return errors
