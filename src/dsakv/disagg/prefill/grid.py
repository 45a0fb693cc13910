"""A pipelined prefill with tensor-parallel stages (`--pp-size P --tp-size T`): the rank grid (stage s, TP rank r).

    stage 0:      rank 0 is the PipelineLeader under a RankedEngine (prefill/ranks.py, as a TP-only prefill); ranks
                  1..T-1 follow its log (PrefillRank) with a one-stage stand-in group: they compute every step but
                  send nothing to stage 1 (rank 0's hidden states are theirs: the all-reduce made them equal)
    stage s > 0:  rank 0 is the PrefillStage (RPC, the pipeline's StageGroup of the stages' rank-0 processes) whose
                  group is a RelayGroup (pipeline/relay.py, shared with the decode and colocated grids): every message
                  it receives from stage s-1 (steps and ticks), and a beat while it (re)joins the pipeline, is
                  broadcast over the stage's TP group with the decode links it handshook since (LinkOp); ranks
                  1..T-1 (StageMember, no RPC) run the same PrefillFollower on it through a MemberGroup (the
                  relay's member: receive = the broadcast, send = nothing), each with its own shard, pool,
                  transfer backend, links and KvSender
    sending:      every (s, r) sends its share of stage s's keys (rank_routes.part_routes(link, s, r, T)); after
                  each broadcast the stage gathers every rank's parts and pages in use; once all T parts of a
                  request are in, rank 0 sends the stage's one STAGE_DONE (sender_parts, routes) and only then
                  tells stage 0 RELEASED (no rank's write still reads the pages stage 0 may reuse)

Why rank 0 + broadcast, not a pipeline per TP rank: the hidden states are equal on every rank of a stage after its
all-reduce, so one copy crosses between stages (the slow, inter-node link of a real deployment) and T-1 copies
move inside the stage's group; the books every rank applies (pages, drops, jobs) have one source, and the
pipeline's formation, epochs and re-forming are the PP-only code unchanged (the TP ranks are not in it).
A dead rank (s, r): its stage's rank 0 fails what it holds naming it ('stage s tp rank r (pid N) was killed by
signal 9 (SIGKILL)'), breaks the pipeline and never rejoins, after leaving that text in stage 0's rendezvous
store; stage 0 fails what it holds (the broken pipeline), frees every page and refuses submissions naming it.
Imports torch.distributed (through engine.ranks), dsakv.engine, dsakv.pipeline and dsakv.disagg; never serve.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Sequence
from typing import Any

from dsakv.config import PrefillConfig
from dsakv.disagg.prefill.follower import PrefillFollower
from dsakv.disagg.prefill.kv_sender import KvSender, SentPart
from dsakv.disagg.prefill.ranks import LinkOp, RankReport, RankRow, TPReports, rank_sender, tp_model
from dsakv.disagg.prefill.stage_context import StageContext
from dsakv.disagg.protocol.lifecycle import StageJob
from dsakv.disagg.protocol.messages import Hello, HelloReply
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.bootstrap import DecodeLinks
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.ranks import Ranks
from dsakv.pipeline.relay import RelayGroup as BaseRelay
from dsakv.pipeline.relay import RelayMember, Stopped

log = logging.getLogger(__name__)


class RelayGroup(BaseRelay):
    """Rank 0 of stage s > 0 of a TP prefill stage: the pipeline's relay (pipeline/relay.py), the ranks' transfer
    parts gathered each round."""

    reports: TPReports | None = None

    def gathered(self, got: Sequence[Any]) -> None:
        if self.reports is not None:
            self.reports.theirs(list(got))

    def left(self, why: str) -> None:
        if self.reports is not None:
            self.reports.fail_all(why)


class StageTP:
    """Rank 0's side of a TP stage s > 0 (what PrefillStage holds as `tp`): the relaying group, the parts."""

    def __init__(self, ranks: Ranks, group: RelayGroup) -> None:
        self.ranks, self.group = ranks, group
        group.bind(ranks)
        self.reports: TPReports | None = None

    def attach(self, sender: KvSender) -> None:
        self.reports = reports = TPReports(sender, self.ranks.size)
        sender.combine = reports.mine
        self.group.reports = reports
        self.ranks.on_down(reports.fail_all)

    def on_link(self, addr: str, reply: HelloReply) -> None:
        self.group.relay(LinkOp(addr, reply))

    def rank_pages(self, own: int) -> list[int]:
        return [own, *(self.reports.pages[1:] if self.reports is not None else [])]

    def idle(self) -> None:
        """The pipeline is not formed: a round (the ranks' parts of transfers still in flight reach rank 0; each
        formation try runs one too, RelayGroup.form)."""
        if self.group.gone is None:
            self.group.beat()

    @property
    def down(self) -> str | None:
        return self.ranks.down

    def close(self) -> None:
        self.group.stop_ranks()
        if self.reports is not None:
            self.reports.stop()


class MemberGroup(RelayMember):
    """Rank r > 0 of stage s > 0: the relay's member (pipeline/relay.py) with the decode links rank 0 handshook
    applied before each message, this rank's parts and pages in use reported after it."""

    member: StageMember | None = None

    def apply(self, ops: Sequence[Any]) -> None:
        assert self.member is not None
        for op in ops:
            self.member.links.put(op.addr, op.reply)

    def report(self) -> Any:
        m = self.member
        assert m is not None
        with m.lock:
            out, m.out = m.out, []
        return RankRow(out, m.role.pages_used())

    def on_break(self) -> None:
        assert self.member is not None
        self.member.role.on_break("the pipeline broke")


class MemberSender(KvSender):
    """A follower rank's sender: rank 0 of the stage tells the decode about failures (one report per stage)."""

    def fail(self, job: StageJob, why: str) -> None:
        """Rank 0 of the stage reports the request failed (its books are this rank's)."""


class StageMember:
    """Rank r > 0 of a TP stage s > 0: its shard, its pool (every key of the stage), its backend, links and sender;
    the stage's PrefillFollower run on rank 0's broadcast."""

    def __init__(self, cfg: PrefillConfig, ranks: Ranks, model: tuple[Any, Any]) -> None:
        spec, mdl = model
        mdl.eval()
        self.ranks = ranks
        group = MemberGroup(cfg.pp_rank, cfg.pp_size, ranks, mdl.dtype)
        group.member = self
        self.ctx = ctx = StageContext.build(cfg, spec, mdl, group=group)
        ctx.down_reason = None
        self.role = PrefillFollower(ctx)
        self.lock = threading.Lock()
        self.out: list[RankReport] = []
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.backend.register(self.role.pool.regions())
        name = f"{ctx.name}/stage{ctx.rank}.tp{ranks.rank}"
        self.manifest = Manifest.from_pool(self.role.pool, self.backend.meta(), worker=name)
        hello = Hello(ctx.name, ctx.rank, ctx.size, "", self.manifest.to_bytes(), tp_size=ranks.size)
        self.links = DecodeLinks(self.backend, self.manifest, hello, rpc_timeout=ctx.t.rpc)
        size = cfg.config.transfer.staging_bytes(self.role.pool.nbytes)
        ctx.sender_ = rank_sender(MemberSender, ctx, cfg, self.backend, self.links, ranks, size, self._sent)
        self._thread = threading.Thread(target=ctx.sender.loop, args=(ctx.stop,), daemon=True, name="tp-xfer")
        self._thread.start()

    def _sent(self, p: SentPart) -> None:
        """Its write ended: the books release the pages first, then rank 0 may learn the part (and stage 0 reuse
        the pages)."""
        self.role.on_transferred(p.x.job, p.err is None)
        r = RankReport(p.x.job.rid, p.x.job.grant, p.tp_rank, p.err, p.quarantine, p.parts, p.slot, p.ranks)
        with self.lock:
            self.out.append(r)

    def run(self) -> int:
        """Follow rank 0's broadcast until it says stop (the process group's SIGTERM / Ctrl-C are rank 0's)."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
        while True:
            try:
                self.role.iteration()
            except Stopped:
                self.ranks.close()
                return 0

    def close(self) -> None:
        self.ctx.stop.set()
        self._thread.join(timeout=10.0)
        self.backend.close()


def follow_stage(cfg: PrefillConfig) -> int:
    """Rank r > 0 of prefill stage cfg.pp_rank > 0: load the shard, register the pool, follow the stage's rank 0."""
    ranks, model = tp_model(cfg)
    member = StageMember(cfg, ranks, model)
    log.info("prefill stage %d TP rank %d/%d: pool registered, following rank 0", cfg.pp_rank, ranks.rank, ranks.size)
    try:
        return member.run()
    finally:
        member.close()


__all__ = ["MemberGroup", "RelayGroup", "StageMember", "StageTP", "follow_stage"]
