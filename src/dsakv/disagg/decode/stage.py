"""Decode pipeline stages: `dsakv serve --role decode --pp-size N --pp-partition a,b,...`, one process per stage.

    stage k holds the layers of its range only: KV for each, INDEX_K for its producers (its own pool, manifest and
    transfer engine); every stage pool has the same page count, and stage 0's Engine decides every page id.

    prefill stage i ── HANDSHAKE ──► decode stage 0 ◄── HelloReply(its manifest, boot, every stage's manifest)
    prefill stage i ── KV of the keys it shares with decode stage j (pair by key over the common layers) ──► stage j
    prefill stage i ── STAGE_DONE(parts = {j: bytes landed on stage j}) ──► decode stage 0
    stage 0 starts a request only when every (prefill stage, decode stage) pair it expects has landed; any pair
    failing fails only that request, and its pages are freed on every stage (stage 0's books; the others
    mirror them).

A decode step is the round-trip pipeline of dsakv.pipeline, the one the colocated `--pp-size` runs: stage 0's
Engine schedules, its RoundTripRunner runs layers [0, a) and sends a PipeStep (ForwardBatch, page holds and drops,
pipeline/step.py) + hidden + the last producer's top-k to stage 1 ... stage N-1 (pipeline/follower.py) computes
the logits and sends them back to stage 0, where the Engine samples (the same sampling, stop rules and seeded
streams as a colocated engine). A stage with no producer
reuses the carried top-k in its shared layers, as a prefill stage does. Idle, stage 0 sends a tick every
Timeouts.tick (holds and drops of the books too), so a later stage's receive never times out.

A send/receive that fails or times out breaks the pipeline: stage 0 fails every request it holds (inbound and
running; pages freed once no prefill stage can still write them), and the stages re-form a new epoch; stage 0's
boot becomes "<process boot>.<formation>", so routers and prefill stages see a new decode and handshake again
(a restarted stage has a new manifest).

The parts: DecodePipeline (stage 0's side, inside DecodeWorker: group, runner, books' holds/drops, handshake with
every stage's manifest, per-pair bytes) and DecodeStageWorker (stage k > 0: a process of its own; stage_worker.py).
With --tp-size T every stage is T rank processes (decode/grid.py): the handshake lists every (stage, rank) pool, the
bytes are checked per (stage, rank) cell, and a dead rank keeps the instance down.
Imports torch, dsakv.{spec, cache, model, engine} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol, cast

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.config import DecodeConfig, EngineConfig, PoolConfig, split_layers
from dsakv.disagg.decode.ranks import check_cells
from dsakv.disagg.protocol.errors import Unavailable
from dsakv.disagg.protocol.messages import (
    DecodeStageRef,
    Hello,
    HelloReply,
    StageDone,
    StageInfo,
    fetch_health,
)
from dsakv.disagg.protocol.rpc import RpcError
from dsakv.disagg.protocol.worker_service import WorkerService
from dsakv.disagg.transfer.bootstrap import StageRegistry
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.engine import Engine
from dsakv.engine.ranks import Ranks
from dsakv.engine.scheduler import SchedulerOutput
from dsakv.errors import ConfigError
from dsakv.model.dsa_model import DSAModel
from dsakv.pipeline.runner import RoundTripRunner, Stage0
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError, StageMessage, stage_group
from dsakv.pipeline.step import PipeStep, StepBooks
from dsakv.pipeline.tp_stage import LeadGroup, MemberGroup
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec


class DecodeWorker(Protocol):
    """What the pipeline reads of the decode worker that owns it (decode_worker.DecodeWorker; a Protocol, so
    this module does not import that one)."""

    boot: str
    engine: Engine
    grant_key: bytes
    manifest: Manifest
    name: str
    registry: StageRegistry
    service: WorkerService

    @property
    def address(self) -> str: ...

    def integrity(self) -> str: ...

    def on_pipeline_break(self, why: str) -> None: ...


log = logging.getLogger(__name__)
NOTE_WAIT_S = 2.0  # a broken round trip of a TP x PP decode: how long stage 0 waits for a later stage's note


def stage_pool_shape(cfg: DecodeConfig, spec: ModelSpec) -> tuple[EngineConfig, list[KVLayout], int]:
    """The engine tree, every stage's layout and the one page count all stage pools share (the minimum over the
    stages' planner figures with --kv-budget)."""
    assert cfg.pipeline is not None
    ec = cfg.config.engine
    if ec.speculative_num_steps:
        raise ConfigError("--speculative-num-steps with a decode pipeline (--pp-size > 1) is not supported yet")
    if ec.hisparse.enabled:
        raise ConfigError("--hisparse with a decode pipeline (--pp-size > 1) is not supported yet: use --pp-size 1")
    layouts = [
        ec.layout.layout(spec, a, b)
        for a, b in split_layers(spec.num_layers, cfg.pipeline.pp_size, cfg.pipeline.partition)
    ]
    return ec, layouts, ec.pool.pages(layouts)


def _load(cfg: DecodeConfig, model: tuple[Any, Any] | None) -> tuple[ModelSpec, DSAModel]:
    if model is not None:
        return model
    from dsakv.model.loader import load_model

    dtype = cfg.config.engine.dtype
    return load_model(Path(cfg.model), dtype=getattr(torch, dtype))


def tp_stage_model(cfg: DecodeConfig) -> tuple[Ranks, tuple[ModelSpec, DSAModel]]:
    """(ranks, this rank's shard) of decode stage cfg.pipeline.rank's TP group of cfg.tp_size ranks (rank 0 starts
    the others: 'stage s tp rank r (pid N) ...' names them)."""
    from dsakv.engine.ranks import start_ranks
    from dsakv.model.loader import load_config
    from dsakv.model.parallel import shard_config
    from dsakv.pipeline.tp_stage import load_stage_model

    assert cfg.pipeline is not None
    shard_config(load_config(Path(cfg.model)), cfg.tp_size)  # a TP size the checkpoint cannot split fails here
    ranks = start_ranks(cfg.tp_size, cfg.rank_argv, label=f"stage {cfg.pipeline.rank} TP")
    try:
        return ranks, load_stage_model(Path(cfg.model), getattr(torch, cfg.config.engine.dtype), ranks)
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise


def _group(cfg: DecodeConfig, model: DSAModel, spec: ModelSpec, cls: type[StageGroup] = StageGroup) -> StageGroup:
    p = cfg.pipeline
    assert p is not None
    if cfg.port == 0:
        raise ConfigError("a decode pipeline of more than one stage needs an explicit --port (stage k uses port + k)")
    return stage_group(
        p.rank,
        p.pp_size,
        host=cfg.host,
        port=cfg.port,
        stage0_host=p.stage0_host,
        dist_port=p.dist_port,
        timeout_s=p.stage_timeout,
        hidden_dtype=model.dtype,
        hidden_size=spec.hidden_size,
        cls=cls,
    )


class DecodePipeline:
    """Stage 0's side of a decode pipeline, owned by the DecodeWorker (see the module docstring)."""

    def __init__(
        self, cfg: DecodeConfig, spec: ModelSpec, model: DSAModel, layouts: list[KVLayout], ranks: Ranks | None = None
    ) -> None:
        assert cfg.pipeline is not None
        self.cfg = cfg.pipeline
        self.size = cfg.pipeline.pp_size
        self.spec = spec
        self.layouts = layouts
        self.ranks = ranks if ranks is not None and ranks.size > 1 else None  # stage 0's TP group (decode/grid.py)
        self.tp = 1 if self.ranks is None else self.ranks.size
        self.rank_manifests: list[bytes] = []  # stage 0's ranks 1.. (their pools), gathered at start-up
        self.rank_refs: list[DecodeStageRef] = []  # every stage's ranks 1.. (HelloReply.ranks)
        if self.ranks is None:
            self.group = _group(cfg, model, spec)
        elif self.ranks.lead:  # rank 0 relays the last stage's logits to the others
            self.group = _group(cfg, model, spec, LeadGroup)
            cast(LeadGroup, self.group).ranks = self.ranks
        else:  # rank r > 0 of stage 0: runs every step, sends nothing, gets the logits from rank 0
            self.group = MemberGroup(0, self.size, self.ranks, model.dtype, self.cfg.stage_timeout)
        self.ctx = Stage0(model, layouts[0].page_size, self.size, self.group, self.cfg.stage_timeout)
        self.tick_s = min(1.0, self.cfg.stage_timeout / 4)
        self.health_timeout = min(1.0, cfg.config.transfer.rpc_timeout)
        self.runner: RoundTripRunner | None = None
        self.down_reason: str | None = "pipeline not formed yet"
        self.generation = 0
        self.refs: list[DecodeStageRef] = []
        self.manifests: list[tuple[int, Manifest]] = []
        self.pair_bytes: dict[str, int] = {}
        self._lock = threading.Lock()
        self.books = StepBooks()
        self._last_send = 0.0
        self.note_wait = NOTE_WAIT_S if self.tp > 1 else 0.0  # how long a broken link waits for a stage's note

    @classmethod
    def build(
        cls, cfg: DecodeConfig, model: tuple[Any, Any] | None, ranks: Ranks | None = None
    ) -> tuple[DecodePipeline, Engine]:
        """Stage 0's pipeline and its Engine over layers [0, a) with the pipeline's runner injected (`ranks`, with
        `model` this rank's shard: one rank of stage 0's TP group, decode/grid.py)."""
        spec, mdl = _load(cfg, model)
        mdl.eval()
        ec, layouts, pages = stage_pool_shape(cfg, spec)
        pipe = cls(cfg, spec, mdl, layouts, ranks)
        tree = dataclasses.replace(ec, pool=PoolConfig(num_pages=pages))  # every stage: the one shared page count
        engine = Engine((spec, mdl), tree, model_dir=cfg.model, layout=layouts[0], runner=pipe._make_runner)
        engine.on_schedule = pipe.on_schedule
        return pipe, engine

    def _make_runner(self, pool: DevicePool) -> RoundTripRunner:
        """Stage 0's StepRunner: its layers, the step on at once, the last stage's logits back (pipeline/runner.py),
        so the Engine samples as a colocated one does."""
        self.runner = RoundTripRunner(self.ctx, pool, self.books.step, PipeStep.meta, self.sent, self._link_error)
        return self.runner

    def _link_error(self, e: StageLinkError) -> Exception:
        """What a broken round trip fails the step with: the stage TP rank that died when a later stage noted one
        (its rank 0 notes it before it leaves); stage 0's other ranks, waiting for the logits, get it too."""
        why = self.named(str(e))
        if isinstance(self.group, LeadGroup):
            self.group.fail_members(why)
        return StageLinkError(why)

    def named(self, why: str) -> str:
        """`why`, with the dead TP rank a later stage noted in stage 0's rendezvous store (polled up to NOTE_WAIT_S
        with TP ranks: the note may trail the broken link), if any."""
        end = time.monotonic() + self.note_wait
        while True:
            noted = self.group.noted_down()
            if noted is not None:
                return f"{why} ({noted})"
            if time.monotonic() >= end:
                return why
            time.sleep(0.05)

    # ---- the books later stages mirror (any thread; never under the worker's lock order) ------------------

    def held(self, rid: str, pages: Sequence[int]) -> None:
        self.books.held(rid, pages)

    def dropped(self, rid: str) -> None:
        self.books.dropped(rid)

    def on_schedule(self, sched: SchedulerOutput) -> None:
        for r in sched.preempted:
            self.dropped(r.request_id)

    def sent(self) -> None:
        self._last_send = time.monotonic()

    # ---- the step loop's hooks (the decode step thread) ----------------------------------------------------

    def ready(self, worker: DecodeWorker) -> bool:
        """Form the group if it is not (bounded); True when steps may run. With TP ranks: a dead rank keeps the
        pipeline down (no re-forming: restart the instance), and stage 0's ranks step (idle) while it forms."""
        if self.ranks is not None and self.ranks.down is not None:
            self.down_reason = self.ranks.down
            if self.group.formed:
                self.group.break_(self.ranks.down)
            time.sleep(0.05)
            return False
        if self.group.formed:
            return True
        if self.ranks is not None:
            try:  # an idle round of stage 0's ranks (their receive stays inside the group timeout)
                worker.engine.step()
            except Exception as e:  # noqa: BLE001 (a dead rank: the ranks' watcher names it, the next turn sees it)
                log.warning("decode %s: an idle step of stage 0's TP ranks failed: %s", worker.name, e)
                return False
            noted = self.group.noted_down()
            if noted is not None and self.down_reason is not None and noted not in self.down_reason:
                self.down_reason = f"{self.down_reason} ({noted})"
        info = {"rpc": worker.address, "pid": os.getpid(), "boot": worker.service.boot}
        if not self.group.form(info):
            return False
        manifests = [(0, worker.manifest)]
        refs = [DecodeStageRef(0, worker.address, worker.manifest.to_bytes(), worker.service.boot)]
        rank_refs = [DecodeStageRef(0, "", m, rank=t) for t, m in enumerate(self.rank_manifests, 1)]
        for r in range(1, self.size):
            i = self.group.peer_info[r]
            raw = i.get("manifest")
            theirs = i.get("ranks") or []
            if not isinstance(raw, bytes) or len(theirs) != self.tp - 1:
                self.group.break_(f"decode stage {r} published no manifest or {len(theirs)} of {self.tp - 1} ranks")
                return False
            manifests.append((r, Manifest.from_bytes(raw)))
            refs.append(DecodeStageRef(r, str(i["rpc"]), raw, str(i.get("boot", ""))))
            rank_refs += [DecodeStageRef(r, "", bytes(m), rank=t) for t, m in enumerate(theirs, 1)]
        self.group.clear_down()
        self.books.clear()
        self.generation += 1
        self.manifests, self.refs, self.rank_refs = manifests, refs, rank_refs
        worker.boot = f"{worker.service.boot}.{self.generation}"
        self.down_reason = None
        self._last_send = 0.0
        log.info(
            "decode %s: pipeline of %d stages formed (epoch %s, boot %s): %s",
            worker.name,
            self.size,
            self.group.epoch,
            worker.boot,
            ", ".join(
                f"stage {j} layers {m.describe_layers()} at {r.rpc}" for (j, m), r in zip(manifests, refs, strict=True)
            ),
        )
        return True

    def after_step(self, worker: DecodeWorker, outs: Sequence[Any]) -> None:
        """Drops of finished requests, an idle tick when due; a broken pipeline fails what stage 0 holds."""
        for o in outs:
            if o.finished:
                self.dropped(o.request_id)
        runner = self.runner
        assert runner is not None
        ran, runner.ran = runner.ran, False
        why, runner.broken = runner.broken, None
        if why is None and not ran:
            if self.books.pending or time.monotonic() - self._last_send >= self.tick_s:
                try:
                    self.group.send_next(StageMessage(runner.step, self.books.tick().meta()))
                    self.sent()
                except StageLinkError as e:
                    why = self.named(str(e))
        if why is not None:
            self.down_reason = why
            self.on_break(worker, why)

    def on_break(self, worker: DecodeWorker, why: str) -> None:
        """The pipeline broke: stage 0 fails every request it holds (DP attention x PP: decode/dp_pipe.py)."""
        self.books.clear()
        worker.on_pipeline_break(f"decode {worker.name}: pipeline broke ({why})")

    # ---- RPC hooks --------------------------------------------------------------------------------------------

    def check_up(self) -> None:
        if self.down_reason is not None or not self.group.formed:
            raise Unavailable(f"decode pipeline is not serving: {self.down_reason or 'not formed'}")

    def handshake(self, worker: DecodeWorker, hello: Hello) -> HelloReply:
        """Check the prefill stage against every decode stage it shares layers with; reply with all manifests."""
        self.check_up()
        worker.registry.accept(hello, self.manifests)
        return HelloReply(
            manifest=worker.manifest.to_bytes(),
            boot=worker.boot,
            name=worker.name,
            stages=self.refs,
            ranks=self.rank_refs,
            grant_key=worker.grant_key,
        )

    def check_parts(self, worker: DecodeWorker, p: StageDone) -> str | None:
        """Record the bytes of each (prefill stage, decode stage) pair; an error if an ok report does not cover
        exactly the decode stages that prefill stage shares layers with."""
        entry = worker.registry.entry(p.prefill, p.stage)
        stages = sorted(entry.decode_stages) if entry is not None else sorted(p.parts)
        wrong = None
        if self.tp > 1:  # a TP x PP decode: bytes and routes per (decode stage, rank) cell (LinkPart.cell)
            t = self.tp
            what = f"it shares layers with decode stage(s) {stages}, each of {t} TP ranks with its own pool"
            cells = [j * t + r for j in stages for r in range(t)]
            wrong = check_cells(p, self.pair_bytes, self._lock, cells, lambda c: f"{c // t}.tp{c % t}", what)
        else:
            with self._lock:
                for j, n in p.parts.items():
                    key = f"{p.prefill}:{p.stage}->{j}"
                    self.pair_bytes[key] = self.pair_bytes.get(key, 0) + n
        if not p.ok or entry is None:
            return None
        if sorted(p.parts) != stages:
            return (
                f"prefill {p.prefill} stage {p.stage} reported its KV on decode stage(s) {sorted(p.parts)}, but it "
                f"shares layers with decode stage(s) {stages}"
            )
        return wrong

    def stage_rows(self, worker: DecodeWorker) -> list[StageInfo]:
        """Every stage as it reports itself: stage 0 from its engine, stage k from its own HEALTH (bounded)."""
        if not self.group.formed:
            return []
        st = worker.engine.stats()
        rows = []
        for (r, i), lay in zip(sorted(self.group.peer_info.items()), self.layouts, strict=True):
            row = StageInfo(stage=r, rpc=str(i.get("rpc")), pid=i.get("pid"), boot=i.get("boot"), layers=_span(lay))
            if r == 0:
                h_ok, used, integrity, err = True, st.pages_used, worker.integrity(), None
            else:
                try:
                    h = fetch_health(row.rpc, timeout=self.health_timeout)
                    h_ok, used, integrity, err = h.ok, h.pages_used, h.integrity, h.down
                except RpcError as e:
                    h_ok, used, integrity, err = False, None, None, str(e)
            rows.append(
                replace(
                    row,
                    ok=h_ok,
                    pages_total=st.pages_total,
                    pages_used=used,
                    bytes_per_token=lay.bytes_per_token,
                    integrity=integrity,
                    error=err,
                )
            )
        return rows

    def health_fields(self, worker: DecodeWorker) -> dict[str, Any]:
        a, b = self.layouts[0].layer_start, self.layouts[0].end
        with self._lock:
            pairs = dict(self.pair_bytes)
        down = self.down_reason
        if self.ranks is not None and self.ranks.down is not None and self.ranks.down not in (down or ""):
            down = self.ranks.down
        return {
            "stage": 0,
            "num_stages": self.size,
            "epoch": self.group.epoch,
            "down": down,
            "layers": [a, b - 1],
            "pipeline": self.stage_rows(worker),
            "kv_bytes_pairs": pairs,
        }


def _span(layout: KVLayout) -> list[int]:
    return [layout.layer_start, layout.end - 1]


__all__ = ["DecodePipeline", "stage_pool_shape"]
