"""A prefill stage with tensor-parallel ranks (`dsakv serve --role prefill --tp-size T`, one pipeline stage).

    rank 0 (the PrefillStage, RPC):  its PipelineLeader's engine is a RankedEngine (engine/ranks.py): every add
                                     (keep_pages), abort and release is logged and replayed on every rank before
                                     its next step, with the request's job (JobOp: decode, pages, grant, deadline)
                                     and every decode link rank 0 handshook (LinkOp: the decode's HelloReply)
    rank r (a child process, no RPC): its shard of the model (all-reduce after o_proj and the MLP/MoE), its own
                                     pool with every key of the stage (latent KV and index-K are replicated), its
                                     own transfer backend with that pool registered, the same links (built from the
                                     relayed reply through its own backend) and a KvSender of its own
    sending:                         every rank sends, for each request whose prompt finished, the keys the sender
                                     rule gives it (rank_routes.part_routes with tp_rank r of T: each decode rank
                                     gets each key once, spread over the T ranks, no rank sends a dummy)
    reporting:                       each rank's part (error, bytes per decode rank) reaches rank 0 (a follower's
                                     through a gather after each step; rank 0 steps while parts are missing);
                                     once all T parts of a request are in, rank 0 sends one STAGE_DONE with
                                     sender_parts (bytes per (prefill rank, decode rank)) and routes (the pairs
                                     the rule gave the request); the decode accepts it only when every route
                                     landed, and rank 0 releases the request's pages only then (ReleaseOp: every
                                     rank frees them after its own write ended)

The ranks run the same scheduler on the same requests and so the same batches (bitwise-equal all-reduced hidden
states): the first token rank 0 samples is the single-rank engine's. A dead rank (the ranks' watcher) makes the
next step raise RankDown: the stage fails the requests it holds, says down in its health and refuses
submissions (the router places them elsewhere); the group is not re-formed: restart the prefill.
Imports torch, dsakv.engine, dsakv.model and dsakv.disagg.{protocol, transfer}; never serve or cli.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsakv.config import PrefillConfig
from dsakv.disagg.prefill.kv_sender import KvSender, SentPart, Transfer
from dsakv.disagg.prefill.stage_context import StageContext, job_of, job_spec
from dsakv.disagg.protocol.lifecycle import StageJob
from dsakv.disagg.protocol.messages import Hello, HelloReply, JobSpec
from dsakv.disagg.protocol.wire import page_list
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.backends.base import TransferBackend
from dsakv.disagg.transfer.bootstrap import DecodeLinks
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.staging import StagingBuffer
from dsakv.engine.ranks import RankedEngine, Ranks
from dsakv.engine.request import FinishReason
from dsakv.pipeline.stage_comm import StageGroup
from dsakv.util import ceil_div

log = logging.getLogger(__name__)
JOB_KEEP_S = 60.0  # a follower forgets a job that never finished this long after its deadline (aborted)


@dataclass(frozen=True)
class JobOp:
    """Rank 0 took request `spec.rid` (its decode, pages, grant and seconds left): logged with its AddOp."""

    spec: JobSpec


@dataclass(frozen=True)
class LinkOp:
    """Rank 0 handshook decode `addr`: every rank builds the same link from the reply through its own backend."""

    addr: str
    reply: HelloReply


@dataclass(frozen=True)
class RankReport:
    """What one follower rank sent for one request (gathered by rank 0 after a step)."""

    rid: str
    grant: bytes
    tp_rank: int
    err: str | None
    quarantine: float
    parts: dict[int, int]
    slot: int
    ranks: dict[int, int]


@dataclass(frozen=True)
class RankRow:
    """What a follower rank hands rank 0 after each step / round: its parts and its pool's pages in use."""

    reports: list[RankReport]
    pages_used: int


def tp_model(cfg: PrefillConfig) -> tuple[Ranks, tuple[Any, Any]]:
    """(ranks, (spec, this rank's shard)): joins (rank 0: starts) the stage's TP group of cfg.tp_size ranks."""
    import torch

    from dsakv.engine.ranks import start_ranks
    from dsakv.model.loader import load_config
    from dsakv.model.parallel import load_tp_model, shard_config

    shard_config(load_config(Path(cfg.model)), cfg.tp_size)  # a TP size the checkpoint cannot split fails here
    label = f"stage {cfg.pp_rank} TP" if cfg.pp_size > 1 else "TP"  # 'stage 1 tp rank 1 (pid N) was killed ...'
    ranks = start_ranks(cfg.tp_size, cfg.rank_argv, label=label)
    try:
        return ranks, load_tp_model(cfg.model, ranks.group, dtype=getattr(torch, cfg.engine.dtype))
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise


class TPReports:
    """Rank 0: the parts of each request from every rank of the stage; once all are in, one STAGE_DONE (sent by a
    thread of its own: never under the engine's lock) names them."""

    def __init__(self, sender: KvSender, size: int) -> None:
        self.sender, self.size = sender, size
        self.failed: str | None = None  # a rank died: every report from now on fails naming it
        self.pages = [0] * size  # pages in use on each rank (rank 0's own, the others' as last gathered)
        self._parts: dict[str, dict[int, SentPart | RankReport]] = {}
        self._lock = threading.Lock()
        self._q: queue.Queue[list[SentPart | RankReport] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="prefill-tp-report", daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """Some request waits for a rank's part (rank 0 keeps stepping: each step gathers the followers' parts)."""
        with self._lock:
            return bool(self._parts)

    def mine(self, part: SentPart) -> None:
        self._add(part.x.job.rid, part)

    def theirs(self, gathered: list[RankRow]) -> None:
        for r, row in enumerate(gathered, 1):
            self.pages[r] = row.pages_used
            for rep in row.reports:
                self._add(rep.rid, rep)

    def fail_all(self, why: str) -> None:
        """A rank died: the requests waiting for its part are reported failed (naming it) once rank 0's own part is
        in (its write ended: the pages are free to go), and so is every later one."""
        with self._lock:
            self.failed = why
            done = [rid for rid, got in self._parts.items() if 0 in got]
            flush = [self._parts.pop(rid) for rid in done]
        for got in flush:
            self._q.put([got[0]])

    def _add(self, rid: str, part: SentPart | RankReport) -> None:
        with self._lock:
            got = self._parts.setdefault(rid, {})
            got[part.tp_rank] = part
            if len(got) < self.size and not (self.failed is not None and 0 in got):
                return
            del self._parts[rid]
        self._q.put([got[r] for r in sorted(got)])

    def _loop(self) -> None:
        while True:
            parts = self._q.get()
            if parts is None:
                return
            try:
                self._report(parts)
            except Exception:  # noqa: BLE001 (a report that cannot be sent is logged; the deadline frees the pages)
                log.exception("prefill TP: reporting %s", getattr(parts[0], "x", None))

    def _report(self, parts: list[SentPart | RankReport]) -> None:
        mine = parts[0]
        assert isinstance(mine, SentPart), "rank 0's part comes from its own sender"
        err = next((f"tp rank {p.tp_rank}: {p.err}" for p in parts if p.err is not None), None)
        if self.failed is not None and len(parts) < self.size:
            err = f"prefill stage {self.sender.stage}: {self.failed}"
        if err is None and any(isinstance(p, RankReport) and p.grant != mine.x.job.grant for p in parts):
            err = "the TP ranks wrote different grants"  # never: every rank got the job from rank 0's log
        per_stage: dict[int, int] = {}
        per_rank: dict[int, int] = {}
        for p in parts:
            for j, n in p.parts.items():
                per_stage[j] = per_stage.get(j, 0) + n
            for r, n in p.ranks.items():
                per_rank[r] = per_rank.get(r, 0) + n
        self.sender._report(
            mine.x,
            err,
            max(p.quarantine for p in parts),
            per_stage,
            max(p.slot for p in parts),
            per_rank,
            {p.tp_rank: dict(p.ranks) for p in parts if p.ranks},
            mine.routes,
        )

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=5.0)


class PrefillTP:
    """Rank 0's side of a TP prefill stage: the ranked engine (installed on the leader), the relayed jobs and
    links, the followers' parts gathered after each step."""

    def __init__(self, ranks: Ranks, leader: Any) -> None:
        self.ranks = ranks
        self.engine = RankedEngine(leader.engine, ranks)
        leader.engine = self.engine
        ctx = leader.ctx
        leader.on_job = lambda job: self.engine.log(JobOp(job_spec(job, ctx.jobs.now())))
        self.engine.after_step = self._after_step
        self.reports: TPReports | None = None

    def attach(self, sender: KvSender) -> None:
        self.reports = reports = TPReports(sender, self.ranks.size)
        sender.combine = reports.mine
        self.engine.busy = reports.busy
        self.ranks.on_down(reports.fail_all)

    def rank_pages(self, own: int) -> list[int]:
        """Pages in use on every rank of the stage (rank 0's `own` now, the others' as last gathered)."""
        return [own, *(self.reports.pages[1:] if self.reports is not None else [])]

    def on_link(self, addr: str, reply: HelloReply) -> None:
        self.engine.log(LinkOp(addr, reply))

    def idle(self) -> None:
        """The pipeline is not formed: the ranks still step (every release reaches them; no wait outlasts the
        group's timeout)."""
        self.engine.step()

    def _after_step(self) -> None:
        got = self.ranks.gather(None)
        if self.reports is not None:
            self.reports.theirs(got[1:])

    @property
    def down(self) -> str | None:
        return self.ranks.down

    def close(self) -> None:
        """Tell the other ranks to stop and wait for them (with a rank down: kill the rest, the dead one named)."""
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001 (a stop never raises: the rank's error is logged)
            log.warning("prefill: closing the TP group: %s", e)
        if self.reports is not None:
            self.reports.stop()


class PrefillRank:
    """A follower rank r of a TP prefill stage: the leader's engine (no RPC), its own pool, backend, links and
    sender; it replays rank 0's log, steps, sends its share of each finished prompt's keys and hands rank 0 its
    parts after every step."""

    def __init__(self, cfg: PrefillConfig, ranks: Ranks, model: tuple[Any, Any]) -> None:
        from dsakv.disagg.prefill.leader import PipelineLeader

        spec, mdl = model
        mdl.eval()
        self.ranks = ranks
        # a pipelined prefill: stage 0's rendezvous and sends are rank 0's; this rank's group is a one-stage
        # stand-in that sends nothing (its runner's step messages are dropped: rank 0's go to stage 1)
        alone = StageGroup(0, 1, "127.0.0.1", 0) if cfg.pp_size > 1 else None
        self.ctx = ctx = StageContext.build(cfg, spec, mdl, group=alone)
        self.leader = PipelineLeader(ctx)
        self.engine = self.leader.engine
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.backend.register(self.leader.pool.regions())
        name = f"{ctx.name}/stage{ctx.rank}.tp{ranks.rank}"
        self.manifest = Manifest.from_pool(self.leader.pool, self.backend.meta(), worker=name)
        hello = Hello(ctx.name, ctx.rank, ctx.size, "", self.manifest.to_bytes(), tp_size=ranks.size)
        self.links = DecodeLinks(self.backend, self.manifest, hello, rpc_timeout=ctx.t.rpc)
        size = cfg.config.transfer.staging_bytes(self.leader.pool.nbytes)
        self.jobs: dict[str, StageJob] = {}
        self._out: list[RankReport] = []
        self._lock = threading.Lock()
        ctx.sender_ = self.sender = rank_sender(KvSender, ctx, cfg, self.backend, self.links, ranks, size, self._sent)
        self._thread = threading.Thread(target=self.sender.loop, args=(ctx.stop,), daemon=True, name="tp-xfer")
        self._thread.start()

    def _sent(self, p: SentPart) -> None:
        r = RankReport(p.x.job.rid, p.x.job.grant, p.tp_rank, p.err, p.quarantine, p.parts, p.slot, p.ranks)
        with self._lock:
            self._out.append(r)

    def apply(self, op: Any) -> None:
        if isinstance(op, JobOp):
            job = job_of(op.spec)
            job.deadline = time.monotonic() + op.spec.left
            self.jobs[job.rid] = job
        elif isinstance(op, LinkOp):
            self.links.put(op.addr, op.reply)
        else:
            raise TypeError(f"prefill TP rank {self.ranks.rank}: unknown op {type(op).__name__}")

    def after_step(self, outs: list[Any]) -> None:
        now = time.monotonic()
        for o in outs:
            job = self.jobs.get(o.request_id)
            if job is None or not o.finished:
                continue
            del self.jobs[o.request_id]
            if o.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                continue  # rank 0 fails it (its step failed the same way) or dropped it: no part is waited for
            src = page_list(self.engine.pages_of(job.rid))[: ceil_div(job.prompt_len, self.ctx.page_size)]
            self.sender.queue(Transfer(job, src, None))
        for rid in [r for r, j in self.jobs.items() if now > j.deadline + JOB_KEEP_S]:
            del self.jobs[rid]
        with self._lock:
            out, self._out = self._out, []
        self.ranks.gather(RankRow(out, self.leader.pages_used()))

    def close(self) -> None:
        self.ctx.stop.set()
        self._thread.join(timeout=10.0)
        self.backend.close()


def follow_prefill(cfg: PrefillConfig) -> int:
    """A follower rank of a TP prefill stage: load the shard, register the pool, then replay rank 0's log, step
    and send until rank 0 says stop."""
    from dsakv.engine.ranks import follow

    ranks, model = tp_model(cfg)
    rank = PrefillRank(cfg, ranks, model)
    log.info("prefill TP rank %d/%d: pool registered, following rank 0", ranks.rank, ranks.size)
    try:
        return follow(rank.engine, ranks, apply=rank.apply, after_step=rank.after_step)
    finally:
        rank.close()


def rank_sender(
    cls: type[KvSender],
    ctx: StageContext,
    cfg: PrefillConfig,
    backend: TransferBackend,
    links: DecodeLinks,
    ranks: Ranks,
    staging_bytes: int,
    combine: Callable[[SentPart], None],
) -> KvSender:
    """A TP rank's sender (a follower rank's of any stage): its share of the stage's keys (tp_rank of tp_size, the
    sender rule), each part handed to `combine` when its write ended; no per-job callback (rank 0 reports)."""
    return cls(
        backend=backend,
        links=links,
        prefill=ctx.name,
        stage=ctx.rank,
        timeouts=ctx.t,
        notifier=ctx.notifier,
        stats=ctx.stats,
        on_done=lambda job, ok: None,
        debug_delay=cfg.config.transfer.debug_transfer_delay,
        staging=StagingBuffer(backend, staging_bytes) if staging_bytes > 0 else None,
        tp_rank=ranks.rank,
        tp_size=ranks.size,
        combine=combine,
    )


__all__ = [
    "JobOp",
    "LinkOp",
    "PrefillRank",
    "PrefillTP",
    "RankReport",
    "RankRow",
    "TPReports",
    "follow_prefill",
    "rank_sender",
    "tp_model",
]
