"""PrefillFollower: stage k > 0 of a prefill worker -- the prefill's hooks on the pipeline's one StageFollower loop
(pipeline/follower.py, as a decode or colocated stage runs it):

    recv (PipeStep + PrefillStep payload + hidden + top-k from stage k-1) ─► drop what stage 0 dropped (a job
        not transferring yet: done, its pages free) ─► replay host-tier copies (pipeline.host_replay)
        ─► book the prefix cache's page set (PageMirror) ─► book new jobs ─► each row's pages (the step's hold)
        ─► this stage's layers ─► send to stage k+1 (not on the last stage)
        ─► last stage: prompt logprobs of the step's chunks (params.prompt_logprobs); the first token of every
           finished prompt (the request's seeded stream, penalties and bias; with its logprobs)
           (with MTP: the draft layer's KV for the step's tokens, engine.speculative.draft_prefill, and the draft
           hidden of every finished prompt)
        ─► every finished prompt: KvSender (this stage's layers -> the decode's pages)
    a tick: the same books, forwarded (no compute)
    transfer reported ─► mirror release, RELEASED to stage 0 (which frees the pages once every stage released)

Imports torch, dsakv.{cache, engine, model, pipeline} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache import HiCacheConfig
from dsakv.cache.host_pool import HostPool, host_pages_for, make_host_pool
from dsakv.disagg.prefill.kv_sender import Transfer
from dsakv.disagg.prefill.stage_context import StageContext, job_of
from dsakv.disagg.prefill.stats import HostReplayStats
from dsakv.disagg.prefill.step import PrefillRow, PrefillStep
from dsakv.disagg.protocol.lifecycle import Phase, StageJob
from dsakv.disagg.protocol.messages import RELEASED, Released
from dsakv.disagg.protocol.rpc import Rpc
from dsakv.engine.engine import read_eos_token_ids
from dsakv.engine.model_runner import logits_at
from dsakv.engine.request import TokenLogprobs
from dsakv.engine.sampling import first_token_request, prompt_logprob_positions, prompt_token_logprobs, sample_batch
from dsakv.engine.speculative import draft_prefill
from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import StageCarry
from dsakv.pipeline.follower import StageFollower, StageHooks
from dsakv.pipeline.host_replay import replay
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.stage_comm import StageLinkError, StageMessage
from dsakv.pipeline.step import STOP, PipeStep
from dsakv.util import ceil_div

log = logging.getLogger(__name__)

Firsts = dict[str, tuple[int, TokenLogprobs | None]]  # request id -> its first token and that token's logprobs


class PrefillFollower(StageHooks[PrefillStep]):
    def __init__(self, ctx: StageContext) -> None:
        self.ctx = ctx
        self.lock = threading.RLock()
        self.payload = PrefillStep.of_meta
        self.pool = DevicePool(ctx.layout, ctx.num_pages, device=ctx.model.device)
        self.mirror = PageMirror(ctx.num_pages, name=f"{ctx.name} stage {ctx.rank} pool")
        self.host_pool: HostPool | None = None
        cache = ctx.cache
        if cache.host_tier:  # the same page count as stage 0's host tier, sized on stage 0's layers
            HiCacheConfig.of(cache)  # validates
            _, host_pages = host_pages_for(ctx.layouts[0], ctx.num_pages, cache.hicache_ratio, cache.hicache_size)
            self.host_pool = make_host_pool(cache.layout, ctx.layout, host_pages)
            self.host_pool.check_compatible(self.pool)
        self.replayed = HostReplayStats()
        self._row_errors: dict[str, str] = {}  # request id -> its own error, failed at its last chunk
        self._firsts: Firsts = {}  # the last stage: this step's first tokens (last_stage -> stepped)
        model_dir = ctx.cfg.model
        self.eos_token_ids = read_eos_token_ids(ctx.spec, Path(model_dir)) if model_dir else ()  # min_tokens masks them
        self.stage = StageFollower(ctx.group, ctx.model, self.pool, self.mirror, ctx.t.stage, hooks=self)

    def handlers(self) -> dict[Rpc[Any, Any], Callable[[Any], Any]]:
        return {}

    on_stop: Callable[[], None] | None = None  # DP attention x PP (prefill/dp_pp.py): stage 0 sends STOP at its stop

    def iteration(self) -> None:
        """One message from stage k-1 through the pipeline's follower (passed on first); a prefill pipeline sends
        STOP only with DP attention x PP (on_stop), otherwise its stages re-form instead: a protocol error."""
        if self.stage.iteration() == STOP:
            if self.on_stop is not None:
                self.on_stop()
                return
            raise StageLinkError(f"stage {self.ctx.rank}: a prefill pipeline got STOP from stage {self.ctx.rank - 1}")

    # ---- the hooks (pipeline/follower.py) ----------------------------------------------------------------------

    def dropped(self, rid: str) -> bool:
        """Stage 0 dropped `rid` (abort, deadline, preemption): a job not transferring yet is done here and its
        pages free; one transferring keeps them until its transfer reported (on_transferred)."""
        self._row_errors.pop(rid, None)
        job = self.ctx.jobs.get(rid)
        if job is None or job.transferring:
            return False
        self.ctx.jobs.move(job, Phase.DONE)
        return True

    def booked(self, step: PipeStep[PrefillStep]) -> None:
        ctx, meta = self.ctx, step.payload
        assert meta is not None  # PrefillStep.of_meta refuses a step without one
        if meta.host_ops is not None:
            if self.host_pool is None:
                raise StageLinkError(
                    f"stage {ctx.rank}: stage 0 sent host-tier copies but this stage has no host tier: start "
                    "every stage with the same --hicache-* options"
                )
            off, loaded = replay(meta.host_ops, self.host_pool, self.pool)
            self.replayed.offload_pages += off
            self.replayed.load_pages += loaded
        if meta.cache is not None:
            self.mirror.set_cached(np.frombuffer(meta.cache, dtype=np.int32).tolist())
        now = ctx.jobs.now()
        for spec in meta.jobs.values():
            job = job_of(spec)
            ctx.jobs.pop(job.rid)  # a request preempted on stage 0 comes back as new
            ctx.jobs.add(job)
            job.deadline = now + spec.left
        missing = [row.rid for row in meta.rows if row.rid not in step.hold]
        if missing:
            raise StageLinkError(f"stage {ctx.rank}: step rows of {missing[:4]} came without their pages")

    def last_stage(
        self,
        f: StageFollower[PrefillStep],
        msg: StageMessage,
        step: PipeStep[PrefillStep],
        batch: ForwardBatch,
        carry: StageCarry,
    ) -> None:
        """The last stage: the prompt logprobs of the step's chunks and the first token of every finished prompt
        (the decode gets them with the KV); nothing goes back to stage 0."""
        assert step.payload is not None
        self._prompt_logprobs(carry, step.payload.rows)
        self._firsts = self._sample(carry, step.payload.rows)

    def stepped(self, step: PipeStep[PrefillStep], batch: ForwardBatch, carry: StageCarry) -> None:
        """Every stage: the KV of every finished prompt to its decode (with the first token from the last stage)."""
        ctx = self.ctx
        assert step.payload is not None
        rows = step.payload.rows
        firsts, self._firsts = self._firsts, {}
        drafts = self._draft(batch, carry, rows, firsts) if ctx.draft is not None else {}
        with self.lock:
            ctx.stats.steps += 1
            for row in rows:
                job = ctx.jobs.get(row.rid)
                why = self._row_errors.pop(row.rid, None) if row.last else None
                if why is not None and job is not None:
                    self._fail_row(job, why)
                elif row.last and job is not None:
                    ctx.jobs.move(job, Phase.TRANSFERRING)
                    src = step.hold[row.rid][: ceil_div(job.prompt_len, ctx.page_size)]
                    tok, lps = firsts.get(row.rid, (None, None))
                    plps = tuple(job.prompt_logprobs) if ctx.last and job.params.prompt_logprobs is not None else None
                    ctx.sender.queue(Transfer(job, src, tok, lps, plps, draft_hidden=drafts.get(row.rid)))

    def _fail_row(self, job: StageJob, why: str) -> None:
        """One request's row failed on this stage (its prompt logprobs, its first token): that request alone fails
        (decode is told) and this stage's part of it is done (stage 0 frees its pages once its own transfer
        reported); the pipeline goes on. Called at the request's last chunk, when stage 0 is transferring it."""
        ctx = self.ctx
        log.warning("prefill %s stage %d: request %s failed alone: %s", ctx.name, ctx.rank, job.rid, why)
        self.mirror.release(job.rid)
        ctx.fail(job, f"prefill {ctx.name} stage {ctx.rank}: {why}")
        stage0 = ctx.group.peer_info.get(0, {}).get("rpc")
        if stage0:  # from this stage's process, with the grant (stage 0 refuses a release without them)
            ctx.notifier.post(
                str(stage0), RELEASED, Released(job.rid, ctx.rank, ctx.sender.links.hello.boot, job.grant)
            )

    def _draft(
        self, batch: ForwardBatch, carry: StageCarry, seqs: list[PrefillRow], firsts: Firsts
    ) -> dict[str, bytes]:
        """Last stage with MTP: the draft layer's KV for the step's tokens (entry i: hidden i + token i+1; after a
        chunk, the next prompt token stage 0 sent, or the first token); the draft hidden of each finished prompt."""
        after = []
        for row in seqs:
            if row.last:  # a dropped request (no job, no first token) still needs some token: its KV is not sent
                nxt: int | None = firsts[row.rid][0] if row.rid in firsts else 0
            else:
                nxt = row.next_token
            if nxt is None:
                raise StageLinkError(f"stage {self.ctx.rank}: {row.rid}'s chunk came without the token after it")
            after.append(nxt)
        assert self.ctx.draft is not None
        out = draft_prefill(self.ctx.model, self.ctx.draft, self.pool, batch, carry.hidden, after)
        return {row.rid: self.ctx.draft_hidden(out[i]) for i, row in enumerate(seqs) if row.rid in firsts}

    def _prompt_logprobs(self, carry: StageCarry, seqs: list[PrefillRow]) -> None:
        """Last stage: the prompt logprobs of this step's chunks (params.prompt_logprobs), from the hidden states of
        the same forward; position t gives prompt token t + 1 (stage 0 skips the prefix cache for these)."""
        want: list[tuple[StageJob, PrefillRow, list[int]]] = []
        with self.lock:
            for row in seqs:
                job = self.ctx.jobs.get(row.rid)
                if job is None:
                    continue
                end = row.start + row.num_tokens
                pos = prompt_logprob_positions(job.params, row.start, end, len(job.prompt_logprobs), job.prompt_len)
                if pos and (job.prompt_ids is None or pos[0] != len(job.prompt_logprobs)):
                    raise StageLinkError(
                        f"stage {self.ctx.rank}: prompt logprobs of {row.rid} from position {pos[0]} but it has "
                        f"{len(job.prompt_logprobs)} (or no prompt ids from stage 0)"
                    )
                if pos:
                    want.append((job, row, pos))
        if not want:
            return
        spans = [(r.start, r.start + r.num_tokens) for r in seqs]
        index = {id(r): i for i, r in enumerate(seqs)}
        positions: list[list[int]] = [[] for _ in seqs]
        for _, row, pos in want:
            positions[index[id(row)]] = pos
        logits = logits_at(self.ctx.model, carry.hidden, spans, positions)
        for job, row, pos in want:
            assert job.prompt_ids is not None
            k = int(job.params.prompt_logprobs or 0)
            try:
                job.prompt_logprobs.extend(prompt_token_logprobs(logits[index[id(row)]], job.prompt_ids, pos, k))
            except Exception as e:  # this request alone fails, at its last chunk (_fail_row)
                self._row_errors.setdefault(job.rid, f"prompt logprobs failed: {type(e).__name__}: {e}")

    def _sample(self, carry: StageCarry, seqs: list[PrefillRow]) -> Firsts:
        """Last stage: the first generated token (and its logprobs) of every sequence whose prompt completed this
        step: token 0 of the request's seeded stream, drawn from the logits after its penalties, bias, min_tokens
        and temperature (the decode worker draws tokens 1.. from the same seed and params)."""
        assert carry.logits is not None
        rows, reqs = [], []
        with self.lock:
            for i, row in enumerate(seqs):
                job = self.ctx.jobs.get(row.rid)
                if row.last and job is not None:
                    rows.append(i)
                    reqs.append(first_token_request(row.rid, job.prompt_ids, job.params, job.seed, self.eos_token_ids))
        if not rows:
            return {}
        got = sample_batch(carry.logits[rows], reqs)
        firsts: Firsts = {}
        for req, t, lp, err in zip(reqs, got.tokens, got.logprobs, got.errors, strict=True):
            if err is not None:  # its own error: that request fails alone (iteration -> _fail_row)
                self._row_errors.setdefault(req.request_id, f"first token: {err}")
            elif req.request_id not in self._row_errors:
                firsts[req.request_id] = (int(t), lp)
        return firsts

    def on_transferred(self, job: StageJob, ok: bool) -> None:
        ctx = self.ctx
        with self.lock:
            if job.rid in ctx.jobs:
                ctx.jobs.move(job, Phase.DONE)
            self.mirror.release(job.rid)
            stage0 = ctx.group.peer_info.get(0, {}).get("rpc")
        if stage0:
            boot = ctx.sender.links.hello.boot  # stage 0 checks it is this stage's process, with the grant
            ctx.notifier.post(str(stage0), RELEASED, Released(job.rid, ctx.rank, boot, job.grant))
        ctx.wake.set()

    def on_break(self, why: str) -> None:
        """The pipeline broke: what this stage has not started transferring fails (decode is told)."""
        ctx = self.ctx
        with self.lock:
            self.mirror.set_cached(())
            self._row_errors.clear()
            for job in ctx.jobs.values():
                if not job.transferring:
                    self.mirror.release(job.rid)
                    ctx.fail(job, why)

    # ---- views -----------------------------------------------------------------------------------------

    def integrity(self) -> str:
        return self.mirror.integrity()

    def pages_used(self) -> int:
        return self.mirror.num_used

    def cached_pages(self) -> list[int]:
        return self.mirror.cached

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        return None

    def idle(self) -> bool:
        with self.lock:
            return not self.ctx.jobs

    def health_fields(self) -> dict[str, Any]:
        with self.lock:
            return {"host_replayed": self.replayed.as_dict()}
