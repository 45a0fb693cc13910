"""A prefill instance with DP attention x PP (`dsakv serve --role prefill --pp-size P --tp-size D --dp-size D
--enable-dp-attention --ep-size D`): D DP ranks, each a prefill pipeline of P stages of its own; D x P processes.

    process (d, s)   a PrefillStage (worker.py) of DP rank d's pipeline: stage s's layers, its own pool, transfer
                     engine and decode links; (d, 0) is that pipeline's leader (scheduler, prefix cache, requests of
                     DP rank d only), RPC '<name>.dp<d>' on --port + d (P + 1); stage s on that + s, the pipeline's
                     rendezvous on that + P (so DP rank d's ports are [--port + d (P + 1), --port + (d + 1) (P + 1)))
    EP group of s    (0, s) .. (D-1, s): a gloo group of its own per stage (engine/ranks.start_ranks, label DP:
                     (0, s) is the stage process `--pp-size` starts and starts (d, s), d >= 1, as its children),
                     over which every MoE layer of stage s runs its all-to-alls (pipeline/dp_stage.load_dp_model:
                     the whole checkpoint, experts [d E/D, (d+1) E/D))
    rounds           every (d, 0) steps in lockstep (engine/dp.LockstepEngine, stage 0's EP group): a round in
                     which it ran no forward runs stage 0's MoE layers with 0 rows and sends IDLE down its pipeline
                     (PipelineLeader.send_idle), on which every (d, s) runs its MoE layers with 0 rows
                     (pipeline/follower.py); a pipeline is one-way (each stage sends its own KV), so the k-th
                     STEP / IDLE message of every (d, s) is round k's: stage s's all-to-alls are matched
    routing          as with PP 1 (prefill/dp.py): rank 0's health names the ranks' stage-0 addresses (dp_addrs)
                     and rows; the router routes per (instance, DP rank) by prefix affinity and load
    sending          every (d, s) sends its stage's keys of DP rank d's requests to the decode they name, as a
                     pipelined prefill does; each stage tells (d, 0) RELEASED

Liveness (not re-formed: the instance fails whole, restart it, as the colocated DP x PP does): a dead (d, s) is
named by the rank 0 of its stage's EP group (its watcher: 'dp rank d pipeline stage s (pid N) was killed by signal
9 (SIGKILL)'), which notes it in its pipeline's stage 0 store and breaks that pipeline; DP rank d's own stage 0
names the stage process whose pid is gone. A broken pipeline is never re-formed (its stages would miss rounds of
their EP group): its stage 0's next round row says `down`, every DP rank gathers the texts and is down naming the
first (LockstepEngine), fails what it holds with that text, refuses submissions and reports it in its health.
Stop: the user's process (`_launch_stages`) SIGTERMs its stages; (0, 0) runs the stop round (every (d, 0) stops
after it), (0, s) SIGTERMs its (d, s); every EP group closes with a barrier and each rank 0 sees its ranks exit 0.
Refused (config/roles.py): MTP, the host or storage tier, --pp-rank with a process of its own per DP rank.
Imports torch.distributed (through engine.ranks), dsakv.engine and dsakv.pipeline; never serve or cli.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from pathlib import Path
from signal import SIGTERM
from typing import Any

import torch

from dsakv.config import PrefillConfig
from dsakv.disagg.prefill.dp import PrefillDPEngine
from dsakv.disagg.protocol.dp_view import dp_health
from dsakv.engine.dp import DEATH_WAIT_S, check_experts, pid_gone
from dsakv.engine.ranks import RankDown, Ranks, start_ranks
from dsakv.model.parallel import idle_forward
from dsakv.pipeline.dp_stage import guard_stage, load_dp_model
from dsakv.pipeline.stage_comm import StageLinkError

log = logging.getLogger(__name__)


def dp_pp_config(cfg: PrefillConfig, rank: int) -> PrefillConfig:
    """DP rank `rank`'s config: its pipeline's ports from --port + rank (pp_size + 1) (stage s on that + s, the
    rendezvous on that + pp_size; an explicit --dist-port: + rank), its name '<name>.dp<rank>'."""
    stride = cfg.pp_size + 1
    pipe = cfg.config.pipeline
    if pipe.dist_port:
        cfg = replace(cfg, config=replace(cfg.config, pipeline=replace(pipe, dist_port=pipe.dist_port + rank)))
    name = f"{cfg.name}.dp{rank}" if cfg.name else None
    return replace(cfg, port=cfg.port + rank * stride, name=name, dp_rank=rank)


def dp_pp_addrs(cfg: PrefillConfig) -> list[str]:
    """Every DP rank's stage-0 RPC address (cfg: any rank's dp_pp_config)."""
    stride = cfg.pp_size + 1
    base = cfg.port - cfg.dp_rank * stride
    return [f"{cfg.host}:{base + r * stride}" for r in range(cfg.dp_size)]


def dp_pp_model(cfg: PrefillConfig) -> tuple[Ranks, tuple[Any, Any]]:
    """(the EP group of this process's stage, (spec, model)): (0, s) starts (d, s) for d >= 1 (named 'dp rank d
    pipeline stage s') and all join; the whole checkpoint with this DP rank's experts."""
    check_experts(cfg.model, cfg.dp_size)
    ranks = start_ranks(cfg.dp_size, cfg.rank_argv, label="DP")
    for r, p in enumerate(ranks.children, start=1):
        p.name = f"dp rank {r} pipeline stage {cfg.pp_rank}"
    try:
        return ranks, load_dp_model(Path(cfg.model), getattr(torch, cfg.engine.dtype), ranks)
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise


class PipelineDPEngine(PrefillDPEngine):
    """A DP rank's stage 0 in lockstep: its row says `down` once its pipeline broke (never re-formed)."""

    broken: str | None = None

    def _engine_down(self) -> str | None:
        return self.broken


class PrefillDPPP:
    """Process (d, s)'s part: its stage's EP group, the lockstep engine on stage 0, the broken pipeline's text."""

    def __init__(self, cfg: PrefillConfig, ranks: Ranks, stage: Any) -> None:
        self.cfg, self.ranks, self.stage = cfg, ranks, stage
        self.rank, self.size, self.pp_rank = ranks.rank, ranks.size, cfg.pp_rank
        self.addrs = dp_pp_addrs(cfg)
        self.broken: str | None = None  # the pipeline broke (or a rank of the stage died): never re-formed
        self._handled = False
        self._lock = threading.Lock()
        role, ctx = stage.role, stage.ctx
        self.engine: PipelineDPEngine | None = None
        if self.pp_rank == 0:
            self.engine = PipelineDPEngine(role.engine, ranks, forwarded=lambda: bool(role.runner.ran), idle=self._idle)
            self.engine.wake = ctx.wake.set
            role.engine = self.engine
        else:
            guard_stage(ctx.model, ranks, self.pp_rank)  # a broken all-to-all names the dead peer (a collective)
        ranks.on_down(self.broke)  # (0, s): its watcher names a dead (d, s) with its exit status
        log.info("prefill DP rank %d/%d pipeline stage %d: its experts, its pool", self.rank, self.size, self.pp_rank)

    def attach(self) -> None:
        """Stage 0: the group down fails every request this rank holds (naming why) and refuses submissions;
        rank 0's stop round stops a DP rank >= 1."""
        if self.engine is None:
            return
        leader = self.stage.role
        ctx = self.stage.ctx
        self.engine.integrity = lambda: leader.integrity() == "ok"

        def down(why: str) -> None:  # a thread of its own: the caller may hold the step's locks
            def fail() -> None:
                with leader.lock:
                    ctx.down_reason = f"prefill {ctx.name}: {why}"
                    leader.on_break(ctx.down_reason)

            threading.Thread(target=fail, name="prefill-dp-pp-down", daemon=True).start()

        self.engine.on_down(down)
        if self.rank > 0:
            self.engine.on_stop = self.stage.request_stop

    def _idle(self) -> None:
        """Stage 0's share of a round it ran no forward in: its MoE layers with 0 rows, IDLE down the pipeline."""
        ctx = self.stage.ctx
        idle_forward(ctx.model, ctx.layout.main_layers)
        if self.broken is None and ctx.group.formed:
            try:
                self.stage.role.send_idle()
            except StageLinkError as e:  # the next round's row says down (named); not the EP group's failure
                self.broke(self.explain(str(e)))

    # ---- a broken pipeline ---------------------------------------------------------------------------------

    def explain(self, why: str) -> str:
        """Stage 0: what broke the pipeline, best named: a stage's note (the rank 0 of a stage's EP group names a
        dead rank with its exit status), else a stage process of this pipeline that is gone (polled up to
        DEATH_WAIT_S: its sockets close before it is reaped), else `why`."""
        group = self.stage.ctx.group
        if self.pp_rank != 0:
            return why
        pids = {k: int(info.get("pid", 0)) for k, info in group.peer_info.items() if k > 0}
        end = time.monotonic() + DEATH_WAIT_S
        while True:
            note = group.noted_down()
            if note is not None:
                return f"pipeline stage {note}"
            dead = [k for k, pid in sorted(pids.items()) if pid and pid_gone(pid)]
            if dead:
                k = dead[0]
                return f"DP rank down: dp rank {self.rank} pipeline stage {k} (pid {pids[k]}) died ({why})"
            if time.monotonic() >= end:
                return why
            time.sleep(0.05)

    def broke(self, why: str) -> None:
        """The pipeline broke or a rank of this stage's EP group died: down for good (the stage loop breaks the
        pipeline; a later stage notes why in its stage 0's store first)."""
        with self._lock:
            if self.broken is not None:
                return
            self.broken = why
        if self.engine is not None:
            self.engine.broken = why
        elif self.stage.ctx.group.formed:
            self.stage.ctx.group.note_down(why)
        log.error("prefill %s stage %d: %s: this DP x PP prefill is not re-formed; restart it", self.stage.name,
                  self.pp_rank, why)  # fmt: skip

    def hold(self) -> bool:
        """The stage loop's turn once broken (True: the loop does nothing else): break the pipeline and fail what
        this stage holds (once); stage 0 keeps taking part in the rounds (its row says down), a later stage
        waits for the stop."""
        if self.broken is None:
            return False
        stage, ctx = self.stage, self.stage.ctx
        if not self._handled:
            self._handled = True
            if ctx.group.formed:
                ctx.group.break_(self.broken)
            with stage.role.lock:
                ctx.down_reason = ctx.down_reason or self.broken
                stage.role.on_break(f"prefill {stage.name}: {self.broken}")
        if self.engine is not None and not self.engine.stopped and self.engine.down is None:
            with stage.role.lock:
                self.engine.step()
        else:
            ctx.stop.wait(0.2)
        return True

    # ---- views, stop ---------------------------------------------------------------------------------------

    def health_fields(self) -> dict[str, Any]:
        if self.engine is None:
            return {"dp_rank": self.rank, "dp_size": self.size, "dp_addrs": list(self.addrs)}
        return dp_health(self.engine, self.rank, self.addrs)

    def quiesce(self) -> None:
        """(0, 0), stopping: the stop round (every (d, 0) stops after it)."""
        if self.engine is not None and self.rank == 0:
            self.engine.quiesce()

    def close(self) -> None:
        """Leave the EP group: (0, s), s > 0, first stops its (d, s); rank 0 waits for its ranks' exit (RankDown
        naming a dead one)."""
        if self.engine is not None:
            self.engine.close()
            return
        if self.rank == 0 and self.ranks.down is None:
            for p in self.ranks.children:
                p.signal(SIGTERM)
        self.ranks.close()


__all__ = ["PipelineDPEngine", "PrefillDPPP", "RankDown", "dp_pp_addrs", "dp_pp_config", "dp_pp_model"]
