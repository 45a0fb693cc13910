"""PipelineLeader: stage 0 of a prefill worker -- an `engine.Engine` over its own layers that drives the pipeline.

    SUBMIT ─► engine.add_request(prompt, params with max_new_tokens=1, keep_pages=True)   (+ a StageJob)
    loop: control (RELEASED / ABORT from other threads, KV deadlines) ─► engine.step():
          scheduler (chunked prefill, prefix cache, preemption) ─► PipelineRunner.run(chunks):
              ForwardBatch ─► this stage's layers ─► PipeStep (batch, each row's pages, drops: StepBooks) with
              its PrefillStep payload (rows, new jobs, cache set, host copies) + hidden + top-k; logits only if
              stage 0 is also the last stage (then, with MTP, the draft layer's KV for the step's tokens and the
              draft's hidden state of every finished prompt)
          ─► once Engine.step returned (its lock released): the step to stage 1 (StageGroup, gloo)
          ─► outputs: a request whose prompt finished goes TRANSFERRING (KvSender; first token if last stage);
             a failed step's requests are dropped (decode told)
    idle: a tick (drops, cache set, host copies) every Timeouts.tick so later stages' receives never time out
    every stage's release (its transfer reported) ─► once all N released, engine.release(rid) frees the pages

The Engine is the one scheduler/allocator/prefix cache (HiCache) of the worker: later stages mirror its books
(PageMirror) and replay its host-tier copies (a HiCache observer, pipeline.host_replay.HostCopyLog). The leader's
lock is the engine's lock. Imports torch, dsakv.{engine, model} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache import HiCache
from dsakv.config import PoolConfig
from dsakv.disagg.prefill.control import AbortJob, ControlEvent, StageReleased
from dsakv.disagg.prefill.kv_sender import Transfer
from dsakv.disagg.prefill.leader_views import LeaderViews
from dsakv.disagg.prefill.prefix_events import PrefixEvents
from dsakv.disagg.prefill.stage_context import StageContext, job_spec
from dsakv.disagg.prefill.step import PrefillRow, PrefillStep
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.errors import Forbidden, GrantRefused, Unavailable
from dsakv.disagg.protocol.lifecycle import Phase, StageJob
from dsakv.disagg.protocol.messages import (
    ABORT,
    CACHE_EVENTS,
    RELEASED,
    SUBMIT,
    Abort,
    CacheEvents,
    CacheEventsQuery,
    JobSpec,
    Released,
    Submit,
    Submitted,
)
from dsakv.disagg.protocol.rpc import Rpc
from dsakv.disagg.protocol.wire import page_list
from dsakv.engine.engine import Engine
from dsakv.engine.request import FinishReason, RequestOutput
from dsakv.engine.scheduler import ScheduledChunk, SchedulerOutput
from dsakv.errors import CapacityError, ConfigError
from dsakv.pipeline.host_replay import HostCopyLog
from dsakv.pipeline.runner import PipelineRunner
from dsakv.pipeline.stage_comm import StageLinkError, StageMessage
from dsakv.pipeline.step import IDLE, PipeStep, StepBooks
from dsakv.util import ceil_div

log = logging.getLogger(__name__)


class PipelineLeader(LeaderViews):
    """The RPCs and the loop; the views (integrity, figures, HEALTH fields) are in leader_views.py."""

    def __init__(self, ctx: StageContext) -> None:
        cfg = ctx.cfg
        self.ctx = ctx
        # the tree's engine branch, over this stage's layers, with the page count every stage shares; its cache
        # branch may hold a storage tier with pp_size 1 only (PrefillConfig refuses more). The prefill does not
        # speculate (with MTP the last stage only computes the draft layer's KV: ctx.draft, draft_prefill)
        self.engine = Engine(
            (ctx.spec, ctx.model),
            replace(cfg.engine, pool=PoolConfig(num_pages=ctx.num_pages), speculative_num_steps=0),
            model_dir=cfg.model,  # loaded once by the stage; the checkpoint still names the weights fingerprint
            layout=ctx.layout,
            runner=self._runner,
        )
        self.engine.on_schedule = self._on_schedule
        self.pool = self.engine.pool
        self.lock = self.engine.lock
        self.cache = self.engine.prefix_cache if isinstance(self.engine.prefix_cache, HiCache) else None
        self.copy_log: HostCopyLog | None = None
        if self.cache is not None and self.cache.host is not None and ctx.size > 1:
            self.copy_log = HostCopyLog()
            self.cache.add_observer(self.copy_log)
        self._cache_sent: tuple[int, ...] | None = None  # the cache page set later stages last got
        self._control: deque[ControlEvent] = deque()  # from the RPC threads and the sender, for the loop
        self.books = StepBooks()  # the drops later stages apply with the next step or tick (each row's pages: hold)
        self._last_send = 0.0
        self.prefix_events = PrefixEvents(ctx.page_size)  # the router's prefix affinity reads these
        self.boot = ""  # the worker's boot id (PrefillStage sets it once its service exists)
        self.spent = grants.SpentGrants()  # page grants submitted already (each is good for one submit)
        self.on_job: Callable[[StageJob], None] | None = None  # called (engine lock held) with each new job

    def _runner(self, pool: DevicePool) -> PipelineRunner[PipeStep[PrefillStep]]:
        self.runner = PipelineRunner(self.ctx, pool, self._step_msg, PipeStep.meta)
        return self.runner

    # ---- RPC (other threads) ------------------------------------------------------------------------

    def handlers(self) -> dict[Rpc[Any, Any], Callable[[Any], Any]]:
        return {SUBMIT: self.submit, ABORT: self.abort, RELEASED: self.released, CACHE_EVENTS: self.cache_events}

    def cache_events(self, q: CacheEventsQuery) -> CacheEvents:
        """The prefix cache's pages stored / removed after the router's cursor (prefix_events.py)."""
        with self.lock:
            cap = self.ctx.num_pages
            if self.cache is not None and self.cache.host_alloc is not None:
                cap += self.cache.host_alloc.num_pages
            radix = self.cache.radix if self.cache is not None else None
            return self.prefix_events.query(radix, q.since, cap, self.boot, self.ctx.group.epoch)

    def submit(self, p: Submit) -> Submitted:
        ctx = self.ctx
        rid, prompt, ps = p.rid, p.prompt_ids, ctx.page_size
        self._check_grant(p)  # GrantRefused: nothing queued, nothing written
        with self.lock:
            if ctx.stop.is_set() or not ctx.group.formed or ctx.down_reason is not None:
                raise Unavailable(f"prefill {ctx.name} is unavailable: {ctx.down_reason or 'stopping'}")
            if rid in ctx.jobs:
                raise ConfigError(f"request id {rid!r} is already in use on prefill {ctx.name}")
            if len(p.dst_pages) < ceil_div(len(prompt), ps):
                raise CapacityError(
                    f"request {rid}: {len(p.dst_pages)} decode pages for a {len(prompt)}-token prompt, need "
                    f"{ceil_div(len(prompt), ps)} of {ps} tokens"
                )
            # one token: the first, sampled where the last stage is (here only when this is the last stage), with
            # the request's penalties and bias (min_tokens >= 1 masks eos / stop ids for it as on decode); one
            # choice (decode forks the others)
            ps_ = p.params
            last_needs_prompt = ctx.size > 1 and (ps_.prompt_logprobs is not None or ps_.penalised)
            one = replace(ps_, max_new_tokens=1, min_tokens=min(ps_.min_tokens, 1), n=1, seed=p.seed)
            self.engine.add_request(prompt, one, rid, keep_pages=True)  # ConfigError / CapacityError: nothing kept
            job = StageJob(
                rid=rid,
                prompt_len=len(prompt),
                decode=p.decode,
                decode_boot=p.decode_boot,
                dst_pages=p.dst_pages,
                params=p.params,
                seed=p.seed,
                prompt_ids=list(prompt) if last_needs_prompt else None,
                grant=p.grant,
            )
            ctx.jobs.add(job)
            job.deadline = ctx.jobs.now() + p.kv_timeout
            if self.on_job is not None:  # a TP stage: its other ranks learn the job with the add (prefill/ranks.py)
                self.on_job(job)
            ctx.stats.submitted += 1
        ctx.wake.set()
        return Submitted(accepted=True, epoch=ctx.group.epoch)

    def _check_grant(self, p: Submit) -> None:
        """The submit's page grant: signed by decode p.decode (boot p.decode_boot) for this request, this prefill
        and exactly p.dst_pages, unexpired and not used before (grants.py)."""
        ctx = self.ctx
        try:
            link = ctx.sender.links.get(p.decode, p.decode_boot, timeout=ctx.t.rpc)
            g = grants.verify(
                link.grant_key, p.grant, rid=p.rid, boot=p.decode_boot, pages=p.dst_pages, prefill=ctx.name
            )
            if len(g.pages) != len(p.dst_pages):
                raise GrantRefused(f"request {p.rid}: {len(p.dst_pages)} pages given, {len(g.pages)} granted")
            if ctx.sender.is_revoked(p.grant):
                raise GrantRefused(f"request {p.rid}: the decode revoked its page grant (it gave up on the request)")
            self.spent.spend(g)
        except GrantRefused as e:
            ctx.stats.grants_refused += 1
            log.warning("prefill %s: submit of %s refused: %s", ctx.name, p.rid, e)
            raise

    def abort(self, p: Abort) -> bool:
        with self.lock:
            self._control.append(AbortJob(p.rid, p.why or "aborted by the router"))
        self.ctx.wake.set()
        return True

    def released(self, p: Released) -> bool:
        """Stage p.stage is done with the request's pages: accepted only from that stage's process (the boot it
        formed this epoch with) with the request's grant, for a request whose pages it still reads (Forbidden
        otherwise; False for a request that is gone or that it released already: a retried call)."""
        ctx = self.ctx
        with self.lock:
            info = ctx.group.peer_info.get(p.stage) if 0 < p.stage < ctx.size else None
            boot = str(info.get("boot", "")) if info is not None else ""
            if not boot or p.boot != boot:
                raise self._refuse_release(
                    p, f"it comes from boot {p.boot or '(none)'}, but stage {p.stage} of this pipeline is "
                    f"{'boot ' + boot if boot else 'no stage that reports releases'}",
                )  # fmt: skip
            job = ctx.jobs.get(p.rid)
            if job is None:
                return False
            if not hmac.compare_digest(p.grant, job.grant):
                raise self._refuse_release(p, "it does not carry the request's grant")
            if not job.transferring or p.stage not in job.pending:
                return False
            self._control.append(StageReleased(p.rid, p.stage))
        ctx.wake.set()
        return True

    def _refuse_release(self, p: Released, why: str) -> Forbidden:
        ctx = self.ctx
        ctx.stats.releases_refused += 1
        log.warning("prefill %s: refused the release of %s by stage %d: %s", ctx.name, p.rid, p.stage, why)
        return Forbidden(f"prefill {ctx.name}: released of {p.rid} stage {p.stage} refused: {why}")

    def on_transferred(self, job: StageJob, ok: bool) -> None:
        """KvSender: this stage's transfer of `job` reported (ok or not): one of N releases."""
        with self.lock:
            self._control.append(StageReleased(job.rid, 0))
        self.ctx.wake.set()

    # ---- the loop ------------------------------------------------------------------------------------

    def iteration(self) -> None:
        ctx = self.ctx
        self._apply_control()
        tick = None
        with self.lock:
            self.runner.ran, self.runner.outbox = False, None
            outs = self.engine.step()
            self._settle(outs)
            ran, out = self.runner.ran, self.runner.outbox
            if ran:
                ctx.stats.steps += 1
            elif ctx.size > 1 and (self.books.pending or time.monotonic() - self._last_send >= ctx.t.tick):
                tick = self.books.tick(payload=self._payload())
        if out is not None:
            self._send_step(*out)
        if tick is not None:
            self._send(StageMessage(self.runner.step, tick.meta()))
        if not ran:
            ctx.wake.wait(ctx.t.tick / 4 if ctx.size > 1 else 0.05)
            ctx.wake.clear()

    def _apply_control(self) -> None:
        ctx = self.ctx
        with self.lock:
            while self._control:
                ev = self._control.popleft()
                job = ctx.jobs.get(ev.rid)
                if job is None:
                    continue
                if isinstance(ev, StageReleased) and job.transferring:
                    job.pending.discard(ev.stage)
                    if not job.pending:
                        self._free(job)
                elif isinstance(ev, AbortJob) and not job.transferring:
                    self._drop(job, f"prefill {ctx.name}: {ev.why}")
            now = ctx.jobs.now()
            for job in ctx.jobs.expired():
                if not job.transferring:
                    self._drop(
                        job,
                        f"prefill {ctx.name}: request {job.rid} was not prefilled before its KV deadline "
                        f"({job.prompt_len} prompt tokens; queue or pipeline too slow)",
                    )
                elif now >= job.deadline + self._release_hold():  # every held page has a deadline: a lost
                    log.warning(  # release cannot keep them, and no transfer can still read them by then
                        "prefill %s: %s: stage(s) %s did not release its pages by the KV deadline + %.1fs: freed",
                        ctx.name, job.rid, sorted(job.pending), self._release_hold(),
                    )  # fmt: skip
                    self._free(job)

    def _release_hold(self) -> float:
        """How long past a job's KV deadline its pages wait for the stages' releases: every transfer has ended by
        then (its deadline, plus the backend's quarantine for one that timed out), plus an RPC's time to say so."""
        return self.ctx.sender.backend.quarantine_s + self.ctx.t.rpc

    def _drop(self, job: StageJob, why: str) -> None:
        """A request still computing leaves: the engine frees its pages, later stages drop it, decode is told."""
        self.engine.abort(job.rid)
        self._dropped(job.rid)
        self.ctx.fail(job, why)

    def _free(self, job: StageJob) -> None:
        """Every stage is done with the request's pages."""
        self.ctx.jobs.move(job, Phase.DONE)
        self.engine.release(job.rid)

    def _on_schedule(self, sched: SchedulerOutput) -> None:
        for r in sched.preempted:  # later stages drop their books of these
            self._dropped(r.request_id)

    def _dropped(self, rid: str) -> None:
        if self.ctx.size > 1:  # (one stage: no later stage keeps books)
            self.books.dropped(rid)

    def _send_step(self, msg: StageMessage, step: PipeStep[PrefillStep]) -> None:
        """Send a step on; if the pipeline broke, the requests whose prompt completed in it never reach the later
        stages: their decode is told now (what still computes fails in on_break)."""
        try:
            self._send(msg)
        except StageLinkError as e:
            why = f"prefill {self.ctx.name}: the pipeline broke during its step ({e})"
            assert step.payload is not None
            with self.lock:
                for row in step.payload.rows:
                    job = self.ctx.jobs.get(row.rid)
                    if row.last and job is not None and job.transferring:
                        self.ctx.sender.fail(job, why)
            raise

    def _settle(self, outs: list[RequestOutput]) -> None:
        ctx = self.ctx
        for o in outs:
            job = ctx.jobs.get(o.request_id)
            if job is None or job.transferring or not o.finished or o.finish_reason is FinishReason.ABORT:
                continue
            if o.finish_reason is FinishReason.ERROR:
                ctx.fail(job, f"prefill {ctx.name}: {o.error or 'prefill step failed'}")
                continue
            ctx.jobs.move(job, Phase.TRANSFERRING)
            job.pending = set(range(ctx.size))
            src = page_list(self.engine.pages_of(job.rid))[: ceil_div(job.prompt_len, ctx.page_size)]
            if ctx.last and o.new_token_ids:  # the first token, its logprobs and the prompt's travel with the KV
                lps = o.new_logprobs[0] if o.new_logprobs else None
                drafted = self.runner.draft_out.pop(job.rid, None)
                ctx.sender.queue(
                    Transfer(job, src, o.new_token_ids[0], lps, o.prompt_logprobs, o.num_cached_tokens, drafted)
                )
            else:
                ctx.sender.queue(Transfer(job, src, None, cached_tokens=o.num_cached_tokens))

    def _step_msg(self, chunks: Sequence[ScheduledChunk], batch: Any) -> PipeStep[PrefillStep]:
        """Called by the runner (engine lock held): what stage 1 needs to run this step (each row's pages are the
        step's hold)."""
        rows, new_jobs = [], {}
        now = self.ctx.jobs.now()
        for c in chunks:
            rid = c.request.request_id
            last = c.end == c.request.num_prompt_tokens
            after = None if last else c.request.token_ids(c.end, c.end + 1)[0]  # the last stage's draft entry
            rows.append(PrefillRow(rid, c.start, c.num_tokens, last, after))
            job = self.ctx.jobs.get(rid)
            if job is not None and c.start == c.request.num_cached_tokens:  # its first chunk since admission
                new_jobs[rid] = job_spec(job, now)
        return self.books.step(chunks, batch, self._payload(rows, new_jobs))

    def _payload(self, rows: list[PrefillRow] | None = None, jobs: dict[str, JobSpec] | None = None) -> PrefillStep:
        """The prefill payload of a step (or, without rows, a tick): with the host-tier copies to replay and, when
        the prefix cache's page set changed since the last message (always in the first message of an epoch),
        the set (packed int32 page ids)."""
        host_ops, cache = None, None
        if self.cache is not None:
            host_ops = self.copy_log.drain() or None if self.copy_log is not None else None
            now = tuple(self.cached_pages())
            if now != self._cache_sent:
                self._cache_sent = now
                cache = np.asarray(now, dtype=np.int32).tobytes()
        return PrefillStep(rows or [], jobs or {}, cache, host_ops)

    def _send(self, msg: StageMessage) -> None:
        self.ctx.group.send_next(msg)
        self._last_send = time.monotonic()

    def send_books(self, kind: str = IDLE) -> None:
        """DP attention x PP (prefill/dp_pp.py): IDLE (this DP rank ran no forward in a round: every later stage
        runs its MoE layers with 0 rows) or STOP (the instance stops), with the books. StageLinkError if it broke."""
        self._send(StageMessage(self.runner.step, self.books.tick(kind, payload=self._payload()).meta()))

    def on_break(self, why: str) -> None:
        """The pipeline broke: fail what is still computing (every stage that computed its part still transfers
        and reports it); free every page at once (nothing is scheduled before the group re-forms, and every
        stage drains its transfers before it joins a new epoch); a restarted stage lost its KV, so the prefix
        cache is cleared and the next epoch starts with the full set."""
        ctx = self.ctx
        with self.lock:
            for job in ctx.jobs.values():
                if not job.transferring:
                    self.engine.abort(job.rid)
                    ctx.fail(job, why)
                else:
                    self._free(job)
            self.books.clear()
            if self.cache is not None:
                self.cache.clear()
            self._cache_sent = None
            if self.copy_log is not None:
                self.copy_log.drain()
