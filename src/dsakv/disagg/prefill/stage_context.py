"""What every stage of a prefill worker shares: its config (dsakv.config.PrefillConfig), its layer range, the
pipeline group, the books it keeps for its requests, and the wire form of a stage's job (job_spec / job_of).

    cfg = PrefillConfig(model, config=Config(engine=..., pipeline=PipelineConfig(pp_size=2, pp_rank=k)), port=9200)
    ctx = StageContext.build(cfg, spec, model)          layer ranges, layouts, page count, StageGroup, notifier
    role = make_role(ctx)                               prefill_worker: PipelineLeader (k = 0) or PrefillFollower

Imports torch, dsakv.{spec, config, model, pipeline} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from dsakv.config import CacheConfig, PrefillConfig, Timeouts
from dsakv.disagg.prefill.stats import PrefillStats
from dsakv.disagg.protocol.lifecycle import PREFILL_STAGE, Ledger, Phase, StageJob
from dsakv.disagg.protocol.messages import JobSpec
from dsakv.disagg.protocol.worker_service import Notifier
from dsakv.model.dsa_model import DSAModel
from dsakv.model.mtp import MTPDraft
from dsakv.pipeline.stage_comm import StageGroup, stage_group
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec

if TYPE_CHECKING:
    from dsakv.disagg.prefill.kv_sender import KvSender


def job_spec(job: StageJob, now: float) -> JobSpec:
    """The wire form of a stage's job (the deadline as seconds left from `now`)."""
    return JobSpec(
        rid=job.rid,
        prompt_len=job.prompt_len,
        decode=job.decode,
        decode_boot=job.decode_boot,
        dst_pages=job.dst_pages,
        left=max(0.0, job.deadline - now),
        params=job.params,
        seed=job.seed,
        prompt_ids=job.prompt_ids,
        grant=job.grant,
    )


def job_of(d: JobSpec) -> StageJob:
    return StageJob(
        rid=d.rid,
        prompt_len=d.prompt_len,
        decode=d.decode,
        decode_boot=d.decode_boot,
        dst_pages=list(d.dst_pages),
        params=d.params,
        seed=d.seed,
        prompt_ids=list(d.prompt_ids) if d.prompt_ids is not None else None,
        grant=d.grant,
    )


@dataclass
class StageContext:
    """One stage's shared parts. `sender` is attached once the pool is registered with the backend."""

    cfg: PrefillConfig
    spec: ModelSpec
    model: DSAModel
    ranges: list[tuple[int, int]]
    layouts: list[KVLayout]  # every stage's (stage 0's sizes the host tier of all)
    num_pages: int
    group: StageGroup
    notifier: Notifier
    jobs: Ledger[StageJob]
    stats: PrefillStats = field(default_factory=PrefillStats)  # its health's counters
    wake: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)
    down_reason: str | None = None
    sender_: KvSender | None = None
    draft: MTPDraft | None = None  # the last stage with MTP: the draft layer (its keys are in `layout`)

    def draft_hidden(self, hidden: torch.Tensor) -> bytes:
        """The wire form of one draft hidden state [H] (StageDone.draft_hidden): float32 bytes."""
        return bytes(hidden.detach().float().cpu().contiguous().numpy().tobytes())

    @classmethod
    def build(
        cls,
        cfg: PrefillConfig,
        spec: ModelSpec,
        model: DSAModel,
        clock: Callable[[], float] = time.monotonic,
        draft: MTPDraft | None = None,
        group_cls: type[StageGroup] = StageGroup,
        group: StageGroup | None = None,
    ) -> StageContext:
        """`draft`: the MTP layer for the last stage with the tree's speculative_num_steps (default: load_draft);
        `group_cls` / `group`: a TP stage's group (disagg/prefill/grid.py: rank 0 relays, ranks 1.. follow it)."""
        ranges, layouts = cfg.ranges(spec), cfg.layouts(spec)
        drafts = layouts[cfg.pp_rank].draft_layers
        if drafts and draft is None:
            from dsakv.model.loader import load_draft

            draft = load_draft(Path(cfg.model), dtype=model.dtype)
        if draft is not None:
            draft.to(model.device)
        pipe, t = cfg.pipeline, cfg.timeouts
        group = group or stage_group(
            cfg.pp_rank,
            cfg.pp_size,
            host=cfg.host,
            port=cfg.port,
            stage0_host=pipe.stage0_host,
            dist_port=pipe.dist_port,
            timeout_s=t.stage,
            hidden_dtype=model.dtype,
            hidden_size=spec.hidden_size,
            cls=group_cls,
        )
        return cls(
            cfg=cfg,
            spec=spec,
            model=model,
            ranges=ranges,
            layouts=layouts,
            num_pages=cfg.engine.pool.pages(layouts),
            group=group,
            notifier=Notifier(t.rpc, t.connect),
            jobs=Ledger(PREFILL_STAGE, clock),
            down_reason="pipeline not formed yet" if cfg.pp_size > 1 else None,
            draft=draft if drafts else None,
        )

    @property
    def rank(self) -> int:
        return self.cfg.pp_rank

    @property
    def size(self) -> int:
        return self.cfg.pp_size

    @property
    def last(self) -> bool:
        return self.rank == self.size - 1

    @property
    def name(self) -> str:
        return self.cfg.worker_name

    @property
    def layout(self) -> KVLayout:
        return self.layouts[self.rank]

    @property
    def cache(self) -> CacheConfig:
        return self.cfg.engine.cache

    @property
    def page_size(self) -> int:
        return self.cfg.engine.layout.page_size

    @property
    def t(self) -> Timeouts:
        return self.cfg.timeouts

    @property
    def sender(self) -> KvSender:
        assert self.sender_ is not None, "the KV sender is attached when the stage is built"
        return self.sender_

    def fail(self, job: StageJob, why: str) -> None:
        """Drop `job` from this stage's books and tell its decode (the one failure path of every stage)."""
        if job.rid in self.jobs:
            self.jobs.move(job, Phase.DONE, why)
        self.stats.dropped += 1
        self.sender.fail(job, why)
