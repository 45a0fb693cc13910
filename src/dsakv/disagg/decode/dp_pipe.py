"""A decode instance with DP attention x PP (`dsakv serve --role decode --pp-size P --tp-size D --dp-size D
--enable-dp-attention --ep-size D`): D DP ranks, each a decode pipeline of P stages (decode/stage.py), one process
per cell (DP rank d, stage s), as the colocated version lays them out (pipeline/dp_stage.py).

    cell (d, s)      stage s's layers, its own pool of them (producers' index-K only: the planner's layout) holding DP
                     rank d's requests only, its own transfer backend and manifest; the whole checkpoint with every
                     MoE layer an EPMoE (experts [d E/D, (d+1) E/D))
    EP group of s    (0, s) .. (D-1, s): an elastic gloo group of its own (pipeline/dp_stage.elastic_stage, as the
                     prefill's DP x PP: 'dp rank d pipeline stage s'): the supervisor starts (0, s) with --pp-rank s,
                     which starts (d, s) for d = 1..D-1
    pipeline of d    (d, 0) .. (d, P-1): a decode pipeline of its own: RPC of (d, s) on --port + d P + s, its
                     rendezvous on --dist-port + d (default --port + D P + d); name '<name>.dp<d>'. (d, 0) is a
                     DecodeWorker the prefill handshakes as a decode of its own: its HelloReply lists DP rank d's
                     stages only, so a request routed to DP rank d lands in DP rank d's pools only, each stage the
                     keys it shares with the prefill, each key once (the sender rule, disagg/transfer)
    rounds           every (d, 0) steps as a LockstepEngine (engine/dp.py) over its pipeline's Engine: a round in
                     which it runs no forward runs stage 0's MoE layers with 0 rows and sends IDLE down its pipeline,
                     on which every (d, s) does the same (pipeline/follower.py), so every all-to-all of every stage's
                     EP group is matched per round (an idle DP rank runs 0 rows); ticks carry the books only
    routing          each (d, 0)'s health carries the DP rows (dp_addrs, dp_ranks, decode/dp.py): the router routes
                     to each DP rank by load
    a dead cell      (d, s), d >= 1: DP rank d only. (0, s), its parent, names it with its exit status in DP rank d's
                     pipeline store (ElasticRanks.on_dead); (d, 0), its link broken, waits (bounded) for that name,
                     fails what it holds naming it, waits (bounded) until the router read that and exits EXIT_BROKEN,
                     as does every other cell of DP rank d whose link broke; each stage's EP group re-forms without
                     DP rank d (stage 0 at a round's all_gather, a later stage in the all-to-all in flight: the layer
                     runs again, EPReformed), experts re-placed from the checkpoint; rank 0's health row says DP rank
                     d is down (not restarted). A dead cell of DP rank 0 (or (0, s): its children die with it) is the
                     instance's death: (0, 0)'s row says down, every DP rank fails what it holds, health down,
                     preallocs refused.
    stop             SIGTERM reaches (0, 0) (the other cells ignore it): the stop round, then every (d, 0) sends
                     STOP down its pipeline; each (d, s) leaves its EP group and exits 0
Refused (cli/validate): MTP, HiSparse (decode/stage.stage_pool_shape).
Imports torch, dsakv.{engine, pipeline} and dsakv.disagg.{protocol, transfer, decode}; never serve or cli.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
from typing import Any

import torch.distributed as dist

from dsakv.config import DecodeConfig
from dsakv.disagg.decode.dp import DecodeDP, DPDecodeEngine
from dsakv.disagg.decode.stage import DecodePipeline, DecodeWorker
from dsakv.disagg.decode.stage_worker import DecodeStageWorker
from dsakv.engine.elastic import ElasticRanks
from dsakv.engine.ranks import RankDown
from dsakv.model.parallel import idle_forward
from dsakv.pipeline.dp_stage import EXIT_BROKEN, elastic_stage, guard_reform
from dsakv.pipeline.stage_comm import StageLinkError, StageMessage, default_dist_port
from dsakv.pipeline.step import IDLE, STOP
from dsakv.util.procs import exit_now

log = logging.getLogger(__name__)
NOTE_WAIT_S = 10.0  # a broken link of (d, 0): how long it waits for the dead cell's name (its parent notes it)
NOTE_POLL_S = 0.2  # how often (d, 0) looks for a note in its store while serving
LEAVE_READ_S = 10.0  # a leaving DP rank d >= 1: how long it waits for the router to read its failures


def cell_config(cfg: DecodeConfig, d: int) -> DecodeConfig:
    """Cell (d, s)'s config from the instance's: its pipeline's base port --port + d P, its rendezvous --dist-port +
    d (default --port + D P + d), name '<name>.dp<d>', DP rank d."""
    pipe = cfg.config.pipeline
    p, n = pipe.pp_size, cfg.dp_size
    dist_port = pipe.dist_port + d if pipe.dist_port else default_dist_port(cfg.port, p * n) + d
    tree = dataclasses.replace(cfg.config, pipeline=dataclasses.replace(pipe, dist_port=dist_port))
    name = f"{cfg.name}.dp{d}" if cfg.name else None
    return dataclasses.replace(cfg, config=tree, port=cfg.port + d * p, name=name, dp_rank=d)


def stage_ep(cfg: DecodeConfig) -> tuple[ElasticRanks, tuple[Any, Any]]:
    """(stage s's elastic EP group, the whole checkpoint with this DP rank's experts): (0, s) starts (d, s), d >= 1
    (pipeline/dp_stage.elastic_stage, as the prefill's DP x PP)."""
    assert cfg.pipeline is not None
    return elastic_stage(cfg.model, cfg.dp_size, cfg.rank_argv, cfg.config.engine.dtype, cfg.pipeline.rank)


def note_dp_rank(cfg: DecodeConfig, d: int, stage: int, why: str) -> None:
    """Leave `why` in DP rank d's pipeline store as stage `stage`'s note (best effort, bounded): (d, 0) names it
    (StageGroup.noted_down) when its pipeline breaks."""
    assert cfg.pipeline is not None
    p = cell_config(cfg, d).config.pipeline
    try:
        wait = datetime.timedelta(seconds=2)
        host, port = p.stage0_host or cfg.host, int(p.dist_port or 0)
        store = dist.TCPStore(host, port, cfg.pipeline.pp_size, False, timeout=wait)
        store.set(f"down/{stage}", why)
    except Exception as e:  # noqa: BLE001 (that DP rank's stage 0 is gone: nobody to tell)
        log.warning("decode stage %d: could not note %r in dp rank %d's store: %s", stage, why, d, e)


class DPDecodePipeline(DecodePipeline):
    """(d, 0)'s pipeline: formed once (a break is final: its stages would miss rounds of their EP groups), IDLE down
    it in a round it runs no forward, STOP down it when the instance stops. A break of DP rank 0's fails the
    instance (the next round's row says down); of DP rank d >= 1's: DP rank d leaves (`leave`)."""

    formed_once = False
    stop_sent = False
    broken: str | None = None
    leaving: str | None = None  # DP rank d >= 1 whose pipeline broke: it fails what it holds and exits
    worker: DecodeWorker | None = None
    dp_rank = 0
    lock: Any = None  # the LockstepEngine's: every send of this pipeline (the runner's, IDLE, ticks, STOP) under it
    _polled = 0.0

    def ready(self, worker: DecodeWorker) -> bool:
        self.worker = worker
        if self.formed_once:
            return True
        self.formed_once = super().ready(worker)
        return self.formed_once

    def after_step(self, worker: DecodeWorker, outs: Any) -> None:
        with self.lock:
            if self.stop_sent or self.broken is not None:
                return
            super().after_step(worker, outs)

    def on_break(self, worker: DecodeWorker, why: str) -> None:
        """Kept: DP rank 0's next round's row says down and every DP rank fails what it holds (decode/dp.py's
        attach); DP rank d >= 1 leaves at its next step (DPPipeEngine.step)."""
        self.books.clear()
        self.broken = self.broken or why
        if self.dp_rank > 0:
            self.leaving = self.leaving or why

    def dp_down(self) -> str | None:
        """Why this DP rank cannot step: its pipeline broke, or a later stage of it died (noted in its store by
        that stage's parent (0, s))."""
        if not self.formed_once or self.broken is not None:
            return self.broken
        now = time.monotonic()
        if now - self._polled >= NOTE_POLL_S:
            self._polled = now
            noted = self.group.noted_down()
            if noted is not None:
                self.broken = self.down_reason = f"pipeline {noted}"
                if self.dp_rank > 0:
                    self.leaving = self.broken
        return self.broken

    def leave(self, ranks: ElasticRanks) -> None:
        """DP rank d >= 1, its pipeline broken: fail every request it holds naming why, wait (bounded) until the
        router read those failures, exit EXIT_BROKEN: stage 0's EP group re-forms without it at the next round.
        Why it left goes to stage 0's EP group store first: rank 0's health row of DP rank d names the cause with
        the exit status (a router that missed the failures reads it there)."""
        why, worker = self.leaving, self.worker
        assert why is not None and worker is not None
        self.down_reason = f"DP rank down: dp rank {self.dp_rank}: its pipeline broke ({why})"
        ranks.note_left(f"its pipeline broke ({why})")
        log.error("decode %s: %s: this DP rank fails what it holds and leaves the instance", worker.name, why)
        worker.on_pipeline_break(f"decode {worker.name}: {self.down_reason}")
        worker.events.wait_read(LEAVE_READ_S)  # type: ignore[attr-defined]
        exit_now(EXIT_BROKEN)

    def _send(self, kind: str) -> None:
        runner = self.runner
        if not self.formed_once or self.broken is not None or self.stop_sent or runner is None:
            return
        try:
            self.group.send_next(StageMessage(runner.step, self.books.tick(kind).meta()))
            self.sent()
        except StageLinkError as e:
            runner.broken = self.named(str(e))  # after_step keeps it (on_break)

    def idle(self, model: Any) -> None:
        """A round this DP rank ran no forward in: stage 0's MoE layers with 0 rows, IDLE (and the books) down."""
        idle_forward(model, self.layouts[0].main_layers)
        self._send(IDLE)

    def send_stop(self) -> None:
        with self.lock:
            self._send(STOP)
            self.stop_sent = True

    def health_fields(self, worker: DecodeWorker) -> dict[str, Any]:
        """The pipeline's fields, the DP rows (routing) and either's down."""
        out = super().health_fields(worker)
        dp = worker.tp.health_fields()  # type: ignore[attr-defined]
        out.update({k: v for k, v in dp.items() if k.startswith("dp_")})
        out["down"] = down = out.get("down") or dp.get("down")
        if down:  # the instance fails whole: no DP rank of it serves (the next round says so on every rank)
            out["dp_ranks"] = [dataclasses.replace(r, up=False, down=down) for r in out.get("dp_ranks") or []]
        return out


class DPPipeEngine(DPDecodeEngine):
    """(d, 0)'s engine: lockstep rounds over its pipeline's Engine (did it forward: the runner ran; idle: stage 0's
    MoE with 0 rows and IDLE down) over stage 0's elastic EP group: a broken all-to-all re-forms it and runs the
    layer again; DP rank 0's row says down once its pipeline broke; DP rank d >= 1 leaves instead."""

    rerun_layer = True

    def __init__(self, engine: Any, ranks: ElasticRanks, pipe: DPDecodePipeline) -> None:
        self.pipe, self.ep_ranks = pipe, ranks  # (LockstepEngine types its ranks as either kind)
        super().__init__(engine, ranks, forwarded=self._ran, idle=lambda: pipe.idle(engine.model))
        pipe.lock = self._lock
        pipe.dp_rank = ranks.rank

    def _ran(self) -> bool:
        return bool(self.pipe.runner is not None and self.pipe.runner.ran)

    def _engine_down(self) -> str | None:
        return self.pipe.dp_down() if self.rank == 0 else None

    def step(self) -> list[Any]:
        """A round; DP rank d >= 1 whose pipeline broke joins no more rounds: it leaves (the stop does not wait)."""
        if self.rank > 0 and not self.stopped:
            self.pipe.dp_down()
            if self.pipe.leaving is not None:
                self.pipe.leave(self.ep_ranks)
        return super().step()

    def find_down(self, wait: float = 5.0) -> str | None:
        """A failed step names its cause itself (the broken pipeline, noted): no dead DP rank to look for (the
        elastic group re-forms around one)."""
        return None


class DecodeDPPipe(DecodeDP):
    """(d, 0)'s DP view (the worker's `tp`): DP rank d's address is --port + d P; the stop sends STOP down."""

    def __init__(self, cfg: DecodeConfig, engine: DPPipeEngine) -> None:
        super().__init__(cfg, engine)
        assert cfg.pipeline is not None
        p = cfg.pipeline.pp_size
        base = cfg.port - cfg.dp_rank * p
        self.addrs = [f"{cfg.host}:{base + d * p}" for d in range(self.dp_size)]
        self.pipe = engine.pipe

    def quiesce(self) -> None:
        """(0, 0): the stop round; every (d, 0): STOP down its pipeline (its cells leave their groups, exit 0)."""
        super().quiesce()
        self.pipe.send_stop()


def stage0(cfg: DecodeConfig) -> tuple[DPDecodePipeline, DPPipeEngine, DecodeDPPipe]:
    """(d, 0) (cfg: cell_config's): stage 0's EP group joined ((0, 0) starts (d, 0)), its pipeline, its engine."""
    ranks, model = stage_ep(cfg)
    try:
        pipe, engine = DPDecodePipeline.build(cfg, model)
        assert isinstance(pipe, DPDecodePipeline)
        pipe.note_wait = NOTE_WAIT_S
        dp = DPPipeEngine(engine, ranks, pipe)
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise
    log.info("decode DP rank %d/%d stage 0: experts %d/%d, own pipeline and pool", ranks.rank, ranks.size,
             ranks.rank, ranks.size)  # fmt: skip
    return pipe, dp, DecodeDPPipe(cfg, dp)


class DPStageWorker(DecodeStageWorker):
    """Cell (d, s), s > 0: a decode stage of DP rank d's pipeline whose MoE layers run over stage s's elastic EP
    group (a dead member: re-formed without it, the layer run again); a break is final (d >= 1: it exits, so its
    stage's EP group re-forms without it); STOP stops it; (0, s) notes a dead (d, s) in DP rank d's store."""

    reform = False

    def __init__(self, instance: DecodeConfig) -> None:
        assert instance.pipeline is not None
        self.ep, model = stage_ep(instance)
        self.instance = instance
        try:
            super().__init__(cell_config(instance, self.ep.rank), model)
            guard_reform(self.model, self.ep, self.rank)
        except BaseException:
            for p in self.ep.children:
                p.kill()
            raise
        self.ep.on_dead = self._cell_down

    def _cell_down(self, d: int, why: str) -> None:
        """(0, s)'s watcher: (d, s) died (its exit status): named in DP rank d's store ((d, 0) fails with it)."""
        note_dp_rank(self.instance, d, self.rank, why)

    def iteration(self) -> None:
        try:
            kind = self.follower.iteration()
        except RankDown as e:  # this stage's EP group could not re-form (its rank 0 is gone)
            self.group.note_down(str(e))
            self.group.break_(str(e))
            raise StageLinkError(str(e)) from e
        if kind == STOP:
            log.info("decode %s stage %d: STOP from stage %d", self.name, self.rank, self.rank - 1)
            self.request_stop()

    def _on_break(self, why: str) -> None:
        super()._on_break(why)
        if self.ep.rank > 0 and not self.service.stopping.is_set():
            log.error("decode %s stage %d: its pipeline broke (%s): DP rank %d leaves the instance", self.name,
                      self.rank, why, self.ep.rank)  # fmt: skip
            self.ep.note_left(f"its pipeline broke ({why})")
            exit_now(EXIT_BROKEN)

    def stop(self) -> None:
        super().stop()
        try:
            self.ep.close()
        except Exception as e:  # noqa: BLE001 (a stop never raises: a dead peer is named)
            log.warning("decode %s stage %d: leaving the EP group: %s", self.name, self.rank, e)


__all__ = ["DPDecodePipeline", "DPPipeEngine", "DPStageWorker", "DecodeDPPipe", "cell_config", "stage0"]
