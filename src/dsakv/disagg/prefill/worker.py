"""PrefillStage: one pipeline-parallel stage of a prefill worker (one process per stage), built from parts.

    router ──SUBMIT Submit(rid, prompt, decode addr, decode pages, kv_timeout)──► stage 0
    stage 0 (PipelineLeader: an engine.Engine over its layers, a PipelineRunner injected) ─ step ─► stage 1 ─►
        ... ─► stage N-1 (PrefillFollower: the prefill's hooks on the pipeline's StageFollower; the last one
        samples the first token)
        PipeStep (batch, each row's pages, drops) + its PrefillStep payload (rows, new jobs, prefix-cache set,
        host-tier copies) + hidden [T, H] + top-k over gloo
    every stage, when a request's last prompt chunk ran: KvSender -- TransferPlan(its own layers' paired keys,
        its pages -> the decode's pages) on its TransferBackend, bounded by the request's deadline, then
        STAGE_DONE StageDone(rid, stage, ok, error, first token + MTP draft hidden (last stage)) to the decode.
    every stage k > 0 then tells stage 0 RELEASED(rid); stage 0 frees the request's pages once all N stages
        released them, so a page is never reused while a stage still reads it.

The parts: WorkerService (RPC, ping/health/integrity, threads; shared with the decode worker), the role
(chosen once, by `make_role`: PipelineLeader on rank 0, PrefillFollower on rank > 0), the KvSender (every
stage), and the StageContext they share (config, layer range, StageGroup, the request ledger, counters).

Stage 0's Engine decides page ids for every stage (all stage pools have the same page count); later stages
mirror the books (PageMirror). Prefix cache (the tree's cache branch, cfg.engine.cache: device only, or with a
host tier: hicache_ratio / hicache_size; with pp_size 1 also the shared storage tier, storage): stage 0's
Engine runs a HiCache; a hit reuses page ids every stage wrote
in an earlier step (steps reach every stage in order, and a cached page is never reallocated while cached),
so each stage computes only the rest and still transfers every prompt page. Stage 0 sends the cache's page
set with a step/tick whenever it changes, and every host-tier copy its HiCache made (an observer), which
later stages replay on their own pools before computing. A broken pipeline clears the cache.
Failure handling:
- a send/receive between stages that fails or times out (Timeouts.stage) breaks the pipeline: every stage
  fails the requests it has not finished computing (decode is told KV_FAILED), lets running transfers
  finish (bounded by their deadlines), and the stages re-form a new epoch; a restarted stage joins it.
  While broken, stage 0 refuses submissions (Unavailable: the router routes elsewhere) and frees every page.
- a request whose deadline passes while queued or computing is dropped and decode told.
- transfers fail at the deadline (TransferTimeout); decode is told with the backend's quarantine.
Every stage process loads the whole checkpoint and runs only its layers (fine for the tiny model; a
large model would load only its layer range).

Imports torch, dsakv.{spec, cache, model, engine} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from dsakv.config import PrefillConfig
from dsakv.disagg.prefill.follower import PrefillFollower
from dsakv.disagg.prefill.kv_sender import KvSender
from dsakv.disagg.prefill.leader import PipelineLeader
from dsakv.disagg.prefill.stage_context import StageContext
from dsakv.disagg.protocol.errors import Unavailable
from dsakv.disagg.protocol.messages import (
    CONNECT,
    PREFILL_FOLLOWER_SERVICE,
    PREFILL_LEADER_SERVICE,
    REVOKE,
    Connect,
    Connected,
    Hello,
    PingReply,
    PrefillHealth,
    TransferHealth,
)
from dsakv.disagg.protocol.rpc import RpcClient
from dsakv.disagg.protocol.worker_service import WorkerService, connect_at_startup
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.bootstrap import DecodeLinks, grid_check
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.rank_assign import RoleGrid
from dsakv.disagg.transfer.staging import StagingBuffer
from dsakv.engine.ranks import RankDown
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError

if TYPE_CHECKING:
    from dsakv.disagg.prefill.dp import PrefillDP
    from dsakv.disagg.prefill.dp_pp import PrefillDPPP
    from dsakv.disagg.prefill.grid import StageTP
    from dsakv.disagg.prefill.ranks import PrefillTP

log = logging.getLogger(__name__)

StageRole = PipelineLeader | PrefillFollower


def make_role(ctx: StageContext) -> StageRole:
    """The one place a stage's role is chosen: the leader (rank 0) or a follower."""
    return PipelineLeader(ctx) if ctx.rank == 0 else PrefillFollower(ctx)


class PrefillStage:
    """One stage process. start() serves RPC and runs the stage loop; stop() ends both."""

    def __init__(
        self, cfg: PrefillConfig, model: tuple[Any, Any] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        ranks = dp_ranks = pp_ranks = None
        group_cls: type[StageGroup] = StageGroup
        if model is None and cfg.dp_size > 1 and cfg.pp_size > 1:  # DP attention x PP: (d, s) (prefill/dp_pp.py)
            from dsakv.disagg.prefill.dp_pp import dp_pp_model

            pp_ranks, model = dp_pp_model(cfg)
        elif model is None and cfg.dp_size > 1:  # DP attention: this process is one DP rank (prefill/dp.py)
            from dsakv.engine.dp import ep_model

            dp_ranks, model = ep_model(cfg.model, cfg.dp_size, cfg.rank_argv, cfg.engine.dtype)
        elif model is None and cfg.tp_size > 1:  # rank 0 of a TP stage: starts ranks 1..T-1 (prefill/ranks.py)
            from dsakv.disagg.prefill.grid import RelayGroup
            from dsakv.disagg.prefill.ranks import tp_model

            ranks, model = tp_model(cfg)
            if cfg.pp_rank > 0:  # a later stage: its rank 0 relays each message to its ranks (grid.py)
                group_cls = RelayGroup
        if model is None:
            from dsakv.model.loader import load_model

            model = load_model(Path(cfg.model), dtype=getattr(torch, cfg.engine.dtype))
        spec, mdl = model
        mdl.eval()
        self.cfg = cfg
        self.ctx = ctx = StageContext.build(cfg, spec, mdl, clock, group_cls=group_cls)
        self.role: StageRole = make_role(ctx)
        self.dp: PrefillDP | None = None
        if dp_ranks is not None:
            from dsakv.disagg.prefill.dp import PrefillDP

            self.dp = PrefillDP(cfg, dp_ranks, self.role)
        self.tp: PrefillTP | StageTP | None = None
        self.rank_down: str | None = None  # a TP rank of this stage died (the stage stays down: restart it)
        if ranks is not None and ctx.rank == 0:
            from dsakv.disagg.prefill.ranks import PrefillTP

            self.tp = PrefillTP(ranks, self.role)
        elif ranks is not None:
            from dsakv.disagg.prefill.grid import RelayGroup, StageTP

            assert isinstance(ctx.group, RelayGroup)
            self.tp = StageTP(ranks, ctx.group)
        self.name = ctx.name
        self.rank, self.size = ctx.rank, ctx.size
        self.dppp: PrefillDPPP | None = None
        if pp_ranks is not None:
            from dsakv.disagg.prefill.dp_pp import PrefillDPPP

            self.dppp = PrefillDPPP(cfg, pp_ranks, self)
        self.layout = ctx.layout
        self.layer_start, self.layer_end = ctx.ranges[ctx.rank]
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.backend.register(self.role.pool.regions())
        self.manifest = Manifest.from_pool(self.role.pool, self.backend.meta(), worker=f"{self.name}/stage{self.rank}")
        self.service = WorkerService(
            PREFILL_LEADER_SERVICE if self.rank == 0 else PREFILL_FOLLOWER_SERVICE,
            {CONNECT: self._connect, REVOKE: lambda p: self.ctx.sender.revoke(p), **self.role.handlers()},
            cfg.host,
            cfg.port + self.rank if cfg.port else 0,
            f"prefill{self.rank}",
            health=self.health,
            integrity=self.integrity,
            ping=self._ping,
            stopping=ctx.stop,
        )
        self.boot = self.service.boot
        if isinstance(self.role, PipelineLeader):
            self.role.boot = self.boot  # named in its cache events (the router's prefix affinity)
        grid = RoleGrid.from_partition(
            "prefill",
            [b - a for a, b in ctx.ranges],
            attention_tp=cfg.attention_tp,
            draft_layers=ctx.layouts[-1].draft_layers,
        )
        hello = Hello(
            self.name, self.rank, self.size, self.service.address, self.manifest.to_bytes(), self.boot, cfg.attention_tp
        )
        self.links = DecodeLinks(
            self.backend,
            self.manifest,
            hello,
            rpc_timeout=ctx.t.rpc,
            grid=grid_check(grid, lambda s: tuple(ctx.layouts[s].by_key)),
            on_link=self.tp.on_link if self.tp is not None else None,
        )
        size = cfg.config.transfer.staging_bytes(self.role.pool.nbytes)
        self.staging = StagingBuffer(self.backend, size) if size > 0 else None
        ctx.sender_ = KvSender(
            backend=self.backend,
            links=self.links,
            prefill=self.name,
            stage=self.rank,
            timeouts=ctx.t,
            notifier=ctx.notifier,
            stats=ctx.stats,
            on_done=self.role.on_transferred,
            debug_delay=cfg.config.transfer.debug_transfer_delay,
            debug_fail=cfg.debug_fail_transfer,
            clock=ctx.jobs.now,
            staging=self.staging,
            tp_size=cfg.attention_tp,
        )
        if self.tp is not None:
            self.tp.attach(ctx.sender)
        if self.dp is not None:
            self.dp.attach(self)
        if self.dppp is not None:
            self.dppp.attach()
        log.info(
            "prefill %s stage %d/%d: layers %d-%d, %d pages x %d tokens, %d B/token, elide=%s, backend %s, rpc %s",
            self.name,
            self.rank,
            self.size,
            self.layer_start,
            self.layer_end - 1,
            ctx.num_pages,
            ctx.page_size,
            self.layout.bytes_per_token,
            self.layout.elide,
            cfg.config.transfer.backend,
            self.address,
        )

    # ---- parts and read-only views (tests, health) ---------------------------------------------------

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def leader(self) -> PipelineLeader:
        assert isinstance(self.role, PipelineLeader), f"stage {self.rank} is not the pipeline leader"
        return self.role

    @property
    def follower(self) -> PrefillFollower:
        assert isinstance(self.role, PrefillFollower), "stage 0 is the pipeline leader"
        return self.role

    @property
    def counters(self) -> dict[str, int]:
        return self.ctx.stats.as_dict()

    @property
    def num_jobs(self) -> int:
        return len(self.ctx.jobs)

    def pages_used(self) -> int:
        """Pages held by requests or by the prefix cache (stage 0's books, or this stage's mirror of them)."""
        return self.role.pages_used()

    def cached_pages(self) -> list[int]:
        """Sorted page ids the prefix cache holds (stage 0: its radix tree; later stages: the mirrored set)."""
        return self.role.cached_pages()

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """Stage 0's prefix-cache counters (HiCacheStats.to_dict()); None when the cache is off or on stage k."""
        return self.role.prefix_cache_stats()

    def idle(self) -> bool:
        """No request queued, computing, transferring or awaiting releases on this stage."""
        return self.role.idle()

    def integrity(self) -> str:
        return self.role.integrity()

    def health(self) -> PrefillHealth:
        ctx, cfg = self.ctx, self.cfg
        with self.role.lock:
            used = self.role.pages_used()
            t = self.backend.stats.totals()
            return PrefillHealth(
                ok=ctx.group.formed and ctx.down_reason is None and not ctx.stop.is_set(),
                role="prefill",
                name=self.name,
                stage=self.rank,
                num_stages=self.size,
                pid=os.getpid(),
                boot=self.boot,
                epoch=ctx.group.epoch,
                down=ctx.down_reason,
                layers=[self.layer_start, self.layer_end - 1],
                elide=self.layout.elide,
                backend=cfg.config.transfer.backend,
                page_size=ctx.page_size,
                pages_total=ctx.num_pages,
                pages_used=used,
                pages_free=ctx.num_pages - used,
                capacity_tokens=ctx.num_pages * ctx.page_size,
                jobs=len(ctx.jobs),
                transfers_in_flight=ctx.sender.in_flight,
                links=[link.summary() for link in self.links.links()],
                counters=ctx.stats.as_dict(),
                integrity=self.role.integrity(),
                prefix_cache_enabled=ctx.cache.enabled,
                host_tier=ctx.cache.host_tier,
                cache_pages=len(self.role.cached_pages()),
                transfer=TransferHealth(count=t.transfers, failures=t.failures, bytes=t.bytes, seconds=t.seconds),
                rank_pages=self.tp.rank_pages(used) if self.tp is not None else None,
                **self.role.health_fields(),
                **(self.dp.health_fields() if self.dp is not None else {}),
                **(self.dppp.health_fields() if self.dppp is not None else {}),
            )

    # ---- RPC ----------------------------------------------------------------------------------------------

    def _ping(self) -> PingReply:
        return PingReply(pid=os.getpid(), boot=self.boot, stage=self.rank, epoch=self.ctx.group.epoch)

    def _connect(self, p: Connect) -> Connected:
        """Handshake with decode p.decode (stage 0: on every stage). Raises if refused or unreachable."""
        group = self.ctx.group
        timeout = self.ctx.t.rpc if p.timeout is None else p.timeout
        link = self.links.get(p.decode, p.boot, timeout=timeout)
        stages = [link.summary()]
        if self.rank == 0 and self.size > 1:
            if not group.formed:
                raise Unavailable(f"prefill {self.name}: pipeline not formed ({self.ctx.down_reason})")
            for r in range(1, self.size):
                info = group.peer_info.get(r)
                if info is None:
                    raise Unavailable(f"prefill {self.name}: stage {r} is not in the pipeline")
                c = RpcClient(str(info["rpc"]), timeout=timeout)
                try:
                    stages += c.request(CONNECT, Connect(decode=p.decode, boot=link.boot, timeout=timeout)).stages
                finally:
                    c.close()
        return Connected(decode=p.decode, boot=link.boot, epoch=group.epoch, stages=stages)

    # ---- lifetime -----------------------------------------------------------------------------------------

    def start(self, startup_wait: float | None = None) -> PrefillStage:
        """Serve; then handshake with cfg.decode (waiting up to startup_wait for each to come up). An
        incompatible decode raises IncompatiblePeer naming layer, kind and sizes: startup fails loudly."""
        stop = self.ctx.stop
        self.service.start(
            [(self._loop, f"stage-loop{self.rank}"), (lambda: self.ctx.sender.loop(stop), f"stage-xfer{self.rank}")]
        )
        wait = self.ctx.t.startup_wait if startup_wait is None else startup_wait
        connect_at_startup(self.cfg.decode, self.links.get, wait)
        return self

    def request_stop(self) -> None:
        self.ctx.stop.set()

    def stop(self) -> None:
        self.ctx.stop.set()
        self.ctx.wake.set()
        for dp in (self.dp, self.dppp):
            if dp is not None:
                dp.quiesce()  # DP rank 0: the stop round (every rank stops after it)
        self.service.stop(join_timeout=self.ctx.t.stage + 2)
        if self.tp is not None:
            self.tp.close()
        for dp in (self.dp, self.dppp):
            if dp is not None:
                dp.close()
        self.ctx.group.close()
        self.ctx.notifier.stop()
        self.backend.close()

    def serve_forever(self) -> None:
        self.service.serve_forever()

    def _loop(self) -> None:
        ctx = self.ctx
        info = {"rpc": self.address, "pid": os.getpid(), "boot": self.boot}
        while not ctx.stop.is_set():
            try:
                if self.dppp is not None and self.dppp.hold():  # DP x PP: its pipeline broke, the DP rank leaves
                    continue
                if not ctx.group.formed:
                    if self.tp is not None:  # the TP ranks keep following (their parts and releases, the group's
                        with self.role.lock:  # timeout) while the transfers drain
                            self.tp.idle()
                        if ctx.sender.in_flight:
                            ctx.stop.wait(0.05)
                            continue
                    ctx.sender.wait_drained(ctx.stop)
                    if ctx.group.form(info):
                        with self.role.lock:
                            ctx.down_reason = None
                        ctx.group.clear_down()
                        log.info("prefill %s stage %d: serving (epoch %s)", self.name, self.rank, ctx.group.epoch)
                    elif self.rank_down is None and (note := ctx.group.noted_down()) is not None:  # stage 0:
                        # a later stage that cannot rejoin (one of its TP ranks died) left why
                        with self.role.lock:
                            ctx.down_reason = f"prefill {self.name} {note}: restart the prefill"
                    continue
                self.role.iteration()
            except StageLinkError as e:
                self._on_break(str(e))
            except RankDown as e:  # a TP rank died: every request fails naming it; submissions are refused
                if self.dppp is not None:
                    self.dppp.broke(str(e))
                if self.rank_down is None:
                    self.rank_down = str(e)
                    with self.role.lock:
                        ctx.down_reason = str(e)
                        self.role.on_break(f"prefill {self.name}: {e}")
                    if self.size > 1 and ctx.group.formed:  # the other stages fail what they hold at once
                        ctx.group.break_(str(e))
                    log.error("prefill %s: %s: restart the prefill to re-form its TP group", self.name, e)
                ctx.stop.wait(0.5)
            except Exception as e:
                # stage 0 already failed the step's requests; a later stage's failed step leaves the stages
                # after it without that step, so the pipeline re-forms (its requests fail, nothing is kept)
                log.exception("prefill %s stage %d: step failed", self.name, self.rank)
                if self.rank > 0:
                    why = f"prefill stage {self.rank} step failed: {type(e).__name__}: {e}"
                    ctx.group.break_(why)
                    self._on_break(why)

    def _on_break(self, reason: str) -> None:
        if self.dppp is not None and not self.ctx.stop.is_set():
            reason = self.dppp.explain(reason)
            self.dppp.broke(reason)
        why = f"prefill {self.name}: pipeline broke ({reason})"
        with self.role.lock:
            if self.size > 1:
                self.ctx.down_reason = reason
            self.role.on_break(why)
        log.warning("%s", why)


__all__ = ["PrefillStage", "make_role"]
