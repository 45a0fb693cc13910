"""DP attention x PP, colocated (`dsakv generate` / `serve --pp-size P --tp-size D --dp-size D --enable-dp-attention
--ep-size D`): D DP ranks, each a pipeline of P stages, D x P processes.

    process (d, s)   DP rank d, stage s: layers of stage s (--pp-partition) with every MoE layer an EPMoE
                     (experts [d E/D, (d+1) E/D), model/parallel.attach_ep), its own pool of those layers holding
                     DP rank d's requests only
    pipeline of d    (d, 0) .. (d, P-1): a colocated pipeline (pipeline/colocated.py) of its own, its own
                     rendezvous port and StageGroup; (d, 0) is its PipelinedEngine (scheduler, allocator, sampling)
    EP group of s    (0, s) .. (D-1, s): a torch.distributed group (gloo) of its own per stage, the default group
                     of those processes, over which stage s's MoE layers run their all-to-alls

Start-up: the command the user starts is (0, 0). It reserves one port per later stage's EP group (STAGE_PORTS_ENV,
inherited by every process it starts), starts (d, 0) for d = 1..D-1 (engine/ranks.start_ranks, label "DP": the EP
group of stage 0); every (d, 0) then starts its stages (d, s) with DSAKV_TP_RANK = d and the port of stage s's group,
so (d, s) joins that group as rank d (start_ranks again) and its pipeline as stage s.

Rounds: every (d, 0) is a LockstepEngine (engine/dp.py) over its PipelinedEngine: each round all_gathers the D rows
(stage 0's EP group); if any rank is active every (d, 0) either steps (its forward runs stage 0's layers and the
round trip: STEP to (d, 1), .. the last stage's logits back) or, with nothing to run, runs `idle_step`: stage 0's MoE
layers with 0 rows and an IDLE message down its pipeline, on which every (d, s) runs its MoE layers with 0 rows
(pipeline/follower.py). So per round every (d, s) calls each of its MoE layers' all-to-alls exactly once, in the
same order: the all-to-alls of every stage's EP group are matched. A round in which no rank is active sends
nothing down any pipeline (the stages wait without a bound: stage 0's death closes their link).

Liveness (the instance is not re-formed: it fails whole, restart it): a dead (d, s), s > 0, is seen by its parent
(d, 0) (the pipeline's watcher: 'dp rank d pipeline stage s (pid N) was killed by signal 9'), and by the other
(d', s) when their next all-to-all of stage s breaks (`guard_stage`: the dead peer by pid, noted in their own stage
0's store, exit 1). The next round's row of (d, 0) says `down`; every DP rank gathers the texts and is down naming
DP rank d and its dead stage; under `serve` rank 0 fails what it holds with that text and /health answers 503.
A dead (d, 0) is a dead DP rank (engine/dp.py, as without PP). Every wait is bounded (gloo timeouts, the stage
timeout, the groups' collective timeout).
Refused with this shape (by name): MTP, HiSparse, the prefix cache (pipeline/colocated.refusal). The decode role's
and prefill DP x PP (disagg/decode/dp_pipe.py, disagg/prefill/dp_pp.py) share elastic_stage, reform and
guard_reform: their EP groups re-form without a dead DP rank.
Imports torch, dsakv.engine.{ranks, dp}, dsakv.model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from dsakv.engine import ranks as ranks_mod
from dsakv.engine.dp import DEATH_WAIT_S, LockstepEngine, ep_model, pid_gone
from dsakv.engine.elastic import ElasticRanks
from dsakv.engine.ranks import RankDown, Ranks
from dsakv.errors import ConfigError
from dsakv.model.parallel import EPMoE, EPReformed
from dsakv.util.procs import PP_RANK_ENV, TP_RANK_ENV, free_ports

log = logging.getLogger(__name__)

EXIT_BROKEN = 3  # a disaggregated DP x PP cell whose pipeline broke leaves with this status (its EP groups re-form)
STAGE_PORTS_ENV = "DSAKV_DP_STAGE_PORTS"  # the rendezvous port of each later stage's EP group: "p1,p2,.."


def reserve_stage_ports(pp_size: int) -> None:
    """In the command the user started ((0, 0)): one port per later stage's EP group, in the environment every DP
    rank and stage process inherits; a process dsakv started (a DP rank or a stage) has them already."""
    if os.environ.get(TP_RANK_ENV) is None and os.environ.get(PP_RANK_ENV) is None:
        first = free_ports(pp_size - 1)
        os.environ[STAGE_PORTS_ENV] = ",".join(str(first + k) for k in range(pp_size - 1))


def stage_env(stage: int, ranks: Ranks) -> dict[str, str]:
    """What (d, stage) needs in its environment to join stage `stage`'s EP group as rank d = ranks.rank."""
    ports = [p for p in os.environ.get(STAGE_PORTS_ENV, "").split(",") if p]
    if len(ports) < stage:
        raise ConfigError(
            f"{STAGE_PORTS_ENV}={os.environ.get(STAGE_PORTS_ENV, '')!r} names no port for stage {stage}'s EP group: "
            "start the command itself (not a DP rank of it)"
        )
    return {TP_RANK_ENV: str(ranks.rank), ranks_mod.PORT_ENV: ports[stage - 1], ranks_mod.SIZE_ENV: str(ranks.size)}


def load_dp_model(model_dir: Path, dtype: torch.dtype, ranks: Ranks) -> tuple[Any, Any]:
    """The whole checkpoint with every MoE layer this DP rank's EPMoE (its group: this process's default group)."""
    from dsakv.model.loader import load_model
    from dsakv.model.parallel import attach_ep

    spec, model = load_model(model_dir, dtype=dtype)
    model.eval()
    return spec, attach_ep(model, ranks.rank, ranks.size)


def guard_stage(model: Any, ranks: Ranks, stage: int) -> None:
    """(d, stage), stage > 0: a broken all-to-all of the stage's EP group raises RankDown naming the dead peer (by
    its pid, polled up to DEATH_WAIT_S) and its stage. A collective: every process of the stage calls it at start."""
    pids = [int(p) for p in ranks.gather(os.getpid())]

    def guard(e: Exception) -> BaseException:
        end = time.monotonic() + DEATH_WAIT_S
        while True:
            dead = [r for r, pid in enumerate(pids) if r != ranks.rank and pid_gone(pid)]
            if dead or time.monotonic() >= end:
                break
            time.sleep(0.05)
        what = f"{type(e).__name__} in the EP all-to-all of pipeline stage {stage}"
        if dead:
            return RankDown(
                f"DP rank down: dp rank {dead[0]} pipeline stage {stage} (pid {pids[dead[0]]}) died ({what})"
            )
        return RankDown(f"DP rank down: {what} of dp rank {ranks.rank}: {str(e).splitlines()[0][:200]}")

    for m in model.modules():
        if isinstance(m, EPMoE):
            m.on_error = guard


def elastic_stage(
    model_dir: str | Path, dp_size: int, argv: Sequence[str], dtype: str, stage: int
) -> tuple[ElasticRanks, tuple[Any, Any]]:
    """(the EP group of stage `stage`, (spec, model)) of a disaggregated DP x PP cell (d, stage): (0, stage) starts
    (d, stage) for d >= 1 (named 'dp rank d pipeline stage s'; not restarted: its pipeline is gone) and all join;
    the whole checkpoint with this DP rank's experts. The prefill's (prefill/dp_pp.py) and the decode's
    (decode/dp_pipe.py)."""
    ranks, model = ep_model(model_dir, dp_size, argv, dtype)
    ranks.respawn = False
    for r, p in ranks.procs.items():
        p.name = f"dp rank {r} pipeline stage {stage}"
    return ranks, model


def reform(ranks: ElasticRanks, model: Any, failure: BaseException) -> None:
    """Re-form `ranks` without its dead members (rank 0 names them; the others join its next generation) and
    re-place the experts; RankDown if it cannot (no rank died, or rank 0 is gone)."""
    log.warning("dp rank %d: an all-to-all failed (%s): re-forming the EP group", ranks.rank, failure)
    if ranks.rank == 0:
        dead = ranks.wait_dead(DEATH_WAIT_S)
        if not dead:
            raise RankDown(f"an all-to-all failed ({type(failure).__name__}: {failure}) but no rank died")
        ranks.lead_reform(drop=sorted(dead))
    else:
        ranks.follow_reform()
    ranks.place(model)


def guard_reform(model: Any, ranks: ElasticRanks, stage: int) -> None:
    """(d, stage), stage > 0, of a disaggregated DP x PP: its experts placed; a broken all-to-all of the stage's
    EP group re-forms it without the dead cell and runs the layer again (EPReformed); RankDown if it cannot."""
    ranks.place(model)

    def guard(e: Exception) -> BaseException:
        try:
            reform(ranks, model, e)
        except Exception as why:  # noqa: BLE001 (the group cannot re-form: this stage is down)
            return RankDown(f"DP rank down: the EP group of pipeline stage {stage} could not re-form: {why}")
        return EPReformed(str(e))

    for m in model.modules():
        if isinstance(m, EPMoE):
            m.on_error = guard


def pipeline_lockstep(piped: Any, ranks: Ranks) -> LockstepEngine:
    """DP rank d's stage 0 (a PipelinedEngine) stepping in lockstep with the other DP ranks' stage 0."""
    return LockstepEngine(
        piped, ranks, forwarded=lambda: bool(piped.last_ran), idle=piped.idle_step, on_close=piped.close
    )


__all__ = [
    "EXIT_BROKEN",
    "STAGE_PORTS_ENV",
    "elastic_stage",
    "guard_reform",
    "guard_stage",
    "load_dp_model",
    "pipeline_lockstep",
    "reform",
    "reserve_stage_ports",
    "stage_env",
]
