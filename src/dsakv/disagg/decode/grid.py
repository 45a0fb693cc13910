"""A decode instance with tensor-parallel pipeline stages (`dsakv serve --role decode --pp-size P --tp-size T`): the
rank grid (stage s, TP rank r), each (s, r) a process with its shard of stage s's layers, its own pool of those
layers (the full keys: latent KV and index-K are replicated over TP), its own transfer backend and manifest.

    stage 0:      rank 0 is the DecodeWorker (RPC, scheduler, sampling) whose engine is a RankedDecode (as a TP
                  decode's, decode/ranks.py: preallocs, starts and aborts replayed on every rank before its step);
                  ranks 1..T-1 follow that log (`follow_stage0`), each running the same Engine over layers [0, a)
                  through a MemberGroup (pipeline/tp_stage.py): rank 0 alone sends the step to stage 1 and relays
                  the last stage's logits to them, so every rank samples the same tokens
    stage s > 0:  rank 0 is the DecodeStageWorker (RPC, health) whose group is the pipeline's relay
                  (pipeline/relay.py, shared with the prefill grid): each message from stage s-1, a beat per
                  formation try and a break are broadcast to ranks 1..T-1 (`follow_stage`), which run the same
                  StageFollower on their shard and pool and send nothing
    handshake:    every stage's rank 0 gathers its ranks' manifests at start-up (stage s publishes them when the
                  pipeline forms); stage 0's HelloReply lists them in `ranks` as (stage, rank) so a prefill of any
                  shape writes every (stage, rank) pool it shares layers with, each key once per receiving rank
                  (rank_routes: the sender rule over the parts); STAGE_DONE's rank_parts / sender_parts are keyed
                  by cell = stage x T + rank, and stage 0 starts a request only when every cell landed (its
                  check_parts: decode/ranks.check_cells)

A dead rank (s, r): stage s's rank 0 names it ('stage s tp rank r (pid N) was killed by signal 9 (SIGKILL)'), notes
it in stage 0's rendezvous store and leaves the pipeline for good (s = 0: the ranks' watcher); stage 0 fails every
request it holds naming it, says down in its health (refusing preallocs: the router places elsewhere) and never
re-forms: restart the instance. A broken link without a dead rank re-forms as a one-rank pipeline does (stage 0's
ranks step, idle, meanwhile; a stage started again brings new ranks, whose pools the next handshake lists).
Imports torch, dsakv.{engine, pipeline} and dsakv.disagg.{protocol, transfer, decode}; never serve or cli.
"""

from __future__ import annotations

import logging
import signal
from typing import Any

from dsakv.cache.device_pool import DevicePool
from dsakv.config import DecodeConfig
from dsakv.disagg.decode.ranks import DecodeTP, RankedDecode
from dsakv.disagg.decode.stage import DecodePipeline, stage_pool_shape, tp_stage_model
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.ranks import Ranks, follow
from dsakv.pipeline.follower import StageFollower
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.relay import RelayMember, Stopped

log = logging.getLogger(__name__)


def cell_name(cfg: DecodeConfig, rank: int) -> str:
    """'<worker>/stage<s>.tp<r>': the manifest's worker name of one (stage, rank) pool."""
    assert cfg.pipeline is not None
    return f"{cfg.name or f'decode@{cfg.host}:{cfg.port}'}/stage{cfg.pipeline.rank}.tp{rank}"


def stage0(cfg: DecodeConfig, model: tuple[Any, Any] | None) -> tuple[DecodePipeline, Any, DecodeTP]:
    """Stage 0's rank 0 of a decode pipeline: (its pipeline, the engine the worker runs, its TP view). With TP
    ranks: starts them, its engine a RankedDecode, the ranks' manifests gathered for the handshake."""
    if cfg.tp_size <= 1 or model is not None:
        pipe, engine = DecodePipeline.build(cfg, model)
        return pipe, engine, DecodeTP()
    ranks, shard = tp_stage_model(cfg)
    pipe, engine = DecodePipeline.build(cfg, shard, ranks)
    pipe.rank_manifests = [bytes(m) for m in ranks.gather(b"")[1:]]
    log.info("decode %s: %d TP ranks, each its own pool registered", cell_name(cfg, 0), ranks.size)
    return pipe, RankedDecode(engine, ranks), DecodeTP(ranks)


def follow_stage0(cfg: DecodeConfig) -> int:
    """Rank r > 0 of decode stage 0: its shard, its Engine over stage 0's layers (the logits from rank 0), its pool
    registered; then rank 0's log and every step until it says stop."""
    ranks, shard = tp_stage_model(cfg)
    pipe, engine = DecodePipeline.build(cfg, shard, ranks)
    backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
    try:
        backend.register(engine.pool.regions())
        ranks.gather(Manifest.from_pool(engine.pool, backend.meta(), cell_name(cfg, ranks.rank)).to_bytes())
        log.info("decode stage 0 TP rank %d/%d: pool registered, following rank 0", ranks.rank, ranks.size)
        return follow(engine, ranks)
    finally:
        pipe.group.close()
        backend.close()


class StageMember(RelayMember):
    """Rank r > 0 of decode stage s > 0: the relay's member; a break empties its mirror (stage 0 failed what it
    held)."""

    follower: StageFollower[Any] | None = None

    def on_break(self) -> None:
        if self.follower is not None:
            self.follower.forget()


def follow_stage(cfg: DecodeConfig) -> int:
    """Rank r > 0 of decode stage s > 0: its shard, its pool of stage s's layers (registered, manifest to rank 0),
    then the stage's StageFollower on what rank 0 relays, until it says stop (SIGTERM / Ctrl-C are rank 0's)."""
    assert cfg.pipeline is not None
    s = cfg.pipeline.rank
    ranks, (spec, model) = tp_stage_model(cfg)
    model.eval()
    _, layouts, pages = stage_pool_shape(cfg, spec)
    pool = DevicePool(layouts[s], pages, device=model.device)
    backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
    try:
        backend.register(pool.regions())
        ranks.gather(Manifest.from_pool(pool, backend.meta(), cell_name(cfg, ranks.rank)).to_bytes())
        group = StageMember(s, cfg.pipeline.pp_size, ranks, model.dtype)
        mirror = PageMirror(pages, name=f"{cell_name(cfg, ranks.rank)} pool")
        follower: StageFollower[Any] = StageFollower(group, model, pool, mirror, cfg.pipeline.stage_timeout)
        group.follower = follower
        log.info("decode stage %d TP rank %d/%d: pool registered, following rank 0", s, ranks.rank, ranks.size)
        return _follow(follower, ranks)
    finally:
        backend.close()


def _follow(follower: StageFollower[Any], ranks: Ranks) -> int:
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        try:
            follower.iteration()
        except Stopped:
            ranks.close()
            return 0


__all__ = ["cell_name", "follow_stage", "follow_stage0", "stage0"]
