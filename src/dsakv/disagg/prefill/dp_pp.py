"""A prefill instance with DP attention x PP (`dsakv serve --role prefill --pp-size P --tp-size D --dp-size D
--enable-dp-attention --ep-size D`): D DP ranks, each a prefill pipeline of P stages of its own; D x P processes.

    process (d, s)   a PrefillStage (worker.py) of DP rank d's pipeline: stage s's layers, its own pool, transfer
                     engine and decode links; (d, 0) is that pipeline's leader (scheduler, prefix cache, requests of
                     DP rank d only), RPC '<name>.dp<d>' on --port + d (P + 1); stage s on that + s, the pipeline's
                     rendezvous on that + P (so DP rank d's ports are [--port + d (P + 1), --port + (d + 1) (P + 1)))
    EP group of s    (0, s) .. (D-1, s): an elastic group of its own per stage (engine/elastic.py, as the PP-1 DP
                     prefill's: (0, s) is the stage process `--pp-size` starts and starts (d, s), d >= 1), over which
                     every MoE layer of stage s runs its all-to-alls (the whole checkpoint, experts [d E/D, (d+1) E/D))
    rounds           every (d, 0) steps in lockstep (engine/dp.LockstepEngine, stage 0's EP group): a round in
                     which it ran no forward runs stage 0's MoE layers with 0 rows and sends IDLE down its pipeline
                     (PipelineLeader.send_idle), on which every (d, s) runs its MoE layers with 0 rows
                     (pipeline/follower.py); a pipeline is one-way (each stage sends its own KV), so the k-th
                     STEP / IDLE message of every (d, s) is round k's: stage s's all-to-alls are matched
    routing          as with PP 1 (prefill/dp.py): rank 0's health names the ranks' stage-0 addresses (dp_addrs)
                     and rows (a rank out of the group: down, with why); the router routes per (instance, DP rank)
                     by prefix affinity and load
    sending          every (d, s) sends its stage's keys of DP rank d's requests to the decode they name, as a
                     pipelined prefill does; each stage tells (d, 0) RELEASED

A dead cell (d, s), d >= 1: its pipeline breaks and is never re-formed (its stages would miss rounds of their EP
groups): every other cell of DP rank d fails what it holds, naming the dead stage process ('DP rank down: dp rank d
pipeline stage s (pid N) died'), and exits (status 3); each stage's EP group re-forms without DP rank d at its next
collective (a round's all_gather on stage 0; on a later stage the all-to-all of the message in flight, which every
survivor failed alike: the layer runs again over the new group, model/parallel.EPReformed), its experts re-placed
from the checkpoint (ElasticRanks.place). DP rank d is not restarted (`respawn` off; rank 0's health row says why):
restart the instance to get it back. The other ranks go on with their requests and KV. A dead cell of DP rank 0,
or a stage's rank 0 process, is the instance's death (its ranks die with it): restart it.
Stop: the user's process (`_launch_stages`) SIGTERMs its stages; only (0, 0) acts on it (every other cell ignores
SIGTERM / SIGINT): it runs the stop round (every (d, 0) stops after it) and each (d, 0) sends STOP down its pipeline,
after every round's STEP / IDLE, so each (d, s) stops having run the same rounds as its EP group (a later stage
stopped by the signal itself could leave an all-to-all its peers still run: the group hung); every EP group closes
with a barrier and each rank 0 sees its ranks exit 0.
Refused (config/roles.py): MTP, the host or storage tier.
Imports torch.distributed (through engine), dsakv.engine, dsakv.model and dsakv.pipeline; never serve or cli.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from dsakv.config import PrefillConfig
from dsakv.disagg.prefill.dp import PrefillDPEngine
from dsakv.disagg.protocol.dp_view import dp_health
from dsakv.engine.dp import DEATH_WAIT_S, pid_gone
from dsakv.engine.elastic import ElasticRanks
from dsakv.model.parallel import idle_forward
from dsakv.pipeline.dp_stage import EXIT_BROKEN, elastic_stage, guard_reform
from dsakv.pipeline.stage_comm import StageLinkError
from dsakv.pipeline.step import IDLE, STOP
from dsakv.util.procs import exit_now

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


def dp_pp_model(cfg: PrefillConfig) -> tuple[ElasticRanks, tuple[Any, Any]]:
    """(the EP group of this process's stage, (spec, model)): pipeline/dp_stage.elastic_stage."""
    return elastic_stage(cfg.model, cfg.dp_size, cfg.rank_argv, cfg.engine.dtype, cfg.pp_rank)


class PipelineDPEngine(PrefillDPEngine):
    """A DP rank's stage 0 in lockstep: a broken all-to-all re-forms the group and runs the layer again."""

    rerun_layer = True


class PrefillDPPP:
    """Process (d, s)'s part: its stage's EP group, the lockstep engine on stage 0, the broken pipeline."""

    def __init__(self, cfg: PrefillConfig, ranks: ElasticRanks, stage: Any) -> None:
        self.cfg, self.ranks, self.stage = cfg, ranks, stage
        self.rank, self.size, self.pp_rank = ranks.rank, ranks.size, cfg.pp_rank
        self.addrs = dp_pp_addrs(cfg)
        self.broken: str | None = None  # the pipeline broke: this DP rank leaves
        self._lock = threading.Lock()
        role, ctx = stage.role, stage.ctx
        self.engine: PipelineDPEngine | None = None
        if self.pp_rank == 0:
            self.engine = PipelineDPEngine(role.engine, ranks, forwarded=lambda: bool(role.runner.ran), idle=self._idle)
            self.engine.wake = ctx.wake.set
            role.engine = self.engine
        else:
            role.on_stop = stage.request_stop  # (d, 0) sends STOP when the instance stops
            guard_reform(ctx.model, ranks, self.pp_rank)
        log.info("prefill DP rank %d/%d pipeline stage %d: its experts, its pool", self.rank, self.size, self.pp_rank)

    def attach(self) -> None:
        """Stage 0: a group that cannot re-form fails every request this rank holds (naming why) and refuses
        submissions; rank 0's stop round stops a DP rank >= 1."""
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
                self.stage.role.send_books(IDLE)
            except StageLinkError as e:  # the loop leaves at once (hold); not the EP group's failure
                self.broke(self.explain(str(e)))

    # ---- a broken pipeline ---------------------------------------------------------------------------------

    def explain(self, why: str) -> str:
        """What broke the pipeline, best named: a stage process of it that is gone (polled up to DEATH_WAIT_S: its
        sockets close before it is reaped), else `why`."""
        group = self.stage.ctx.group
        pids = {k: int(info.get("pid", 0)) for k, info in group.peer_info.items() if k != self.pp_rank}
        end = time.monotonic() + DEATH_WAIT_S
        while True:
            dead = [k for k, pid in sorted(pids.items()) if pid and pid_gone(pid)]
            if dead:
                k = dead[0]
                return f"DP rank down: dp rank {self.rank} pipeline stage {k} (pid {pids[k]}) died ({why})"
            if time.monotonic() >= end:
                return f"DP rank down: dp rank {self.rank}: its pipeline broke ({why})"
            time.sleep(0.05)

    def broke(self, why: str) -> None:
        """The pipeline broke: this DP rank leaves (the stage loop's next turn, hold)."""
        with self._lock:
            if self.broken is None:
                self.broken = why
                log.error("prefill %s stage %d: %s: this DP rank leaves the instance", self.stage.name, self.pp_rank,
                          why)  # fmt: skip

    def hold(self) -> bool:
        """The stage loop's turn once broken: fail what this stage holds naming why (its decodes told), then leave
        (exit EXIT_BROKEN, from the loop between rounds: the EP groups re-form without this rank)."""
        if self.broken is None:
            return False
        stage, ctx = self.stage, self.stage.ctx
        with stage.role.lock:
            ctx.down_reason = self.broken
            stage.role.on_break(f"prefill {stage.name}: {self.broken}")
        ctx.notifier.drain(ctx.t.rpc * 2)
        self.ranks.note_left(self.broken)  # rank 0's row of this DP rank names why, with the exit status
        exit_now(EXIT_BROKEN)

    # ---- views, stop ---------------------------------------------------------------------------------------

    def health_fields(self) -> dict[str, Any]:
        """The DP rows (a later stage: only the ranks out of its EP group, with why: 'dp rank 1 pipeline stage 1
        (pid N) was killed by signal 9 (SIGKILL): not restarted')."""
        return dp_health(self.engine or SimpleNamespace(rows=[], ranks=self.ranks), self.rank, self.addrs)

    def quiesce(self) -> None:
        """(0, 0), stopping: the stop round (every (d, 0) stops after it)."""
        if self.engine is not None and self.rank == 0:
            self.engine.quiesce()

    def close(self) -> None:
        """Leave the EP group: (d, 0) first sends STOP down its pipeline (a later stage stops on it); rank 0 waits
        for its ranks' exit."""
        ctx = self.stage.ctx
        if self.engine is not None:
            if self.broken is None and ctx.group.formed:  # the pipeline's stages stop on it (their EP groups too)
                try:
                    self.stage.role.send_books(STOP)
                except StageLinkError as e:
                    log.info("prefill %s: STOP down the pipeline: %s", self.stage.name, e)
            self.engine.close()
            return
        ctx.group.close()  # its stage 0's STOP came after every round's message: every (d, s) ran the same rounds
        self.ranks.close()


__all__ = ["EXIT_BROKEN", "PipelineDPEngine", "PrefillDPPP", "dp_pp_addrs", "dp_pp_config", "dp_pp_model"]
