"""What every stage of a prefill worker shares: its config, its layer range, the pipeline group, the books
it keeps for its requests, and how a step's batch travels (encode_batch / decode_batch).

    cfg = PrefillConfig(model, pp_size=2, pp_rank=k, port=9200, ...)
    ctx = StageContext.build(cfg, (spec, model))        layer range, layout, page count, StageGroup, notifier
    role = make_role(ctx)                               prefill_worker: PipelineLeader (k = 0) or PipelineFollower

Imports torch, dsakv.{spec, plan, cache, model} and dsakv.disagg; never engine, serve or cli.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from dsakv.cache.hicache import HiCacheConfig
from dsakv.cache.storage.base import StorageConfig
from dsakv.disagg.lifecycle import PREFILL_STAGE, Ledger, Phase, StageJob
from dsakv.disagg.messages import JobSpec
from dsakv.disagg.stage_comm import StageGroup, default_dist_port
from dsakv.disagg.timeouts import Timeouts
from dsakv.disagg.wire import pages_for
from dsakv.disagg.worker_service import Notifier
from dsakv.errors import ConfigError
from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import DSAModel
from dsakv.model.mtp import MTPDraft
from dsakv.plan.capacity import even_partition
from dsakv.spec.layout import DEFAULT_PAGE_SIZE, KVLayout
from dsakv.spec.model import ModelSpec

if TYPE_CHECKING:
    from dsakv.disagg.kv_sender import KvSender

DEFAULT_MAX_TOKENS = 16384


def split_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage: `partition` (layers per stage) or an even split, earlier stages larger."""
    if pp_size < 1:
        raise ConfigError(f"--pp-size {pp_size} must be >= 1")
    if partition is None:
        partition = even_partition(num_layers, pp_size)
    if len(partition) != pp_size:
        raise ConfigError(f"--pp-partition {list(partition)} has {len(partition)} stages but --pp-size is {pp_size}")
    if any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ConfigError(
            f"--pp-partition {','.join(map(str, partition))} must give every stage >= 1 layer and sum to the "
            f"model's {num_layers} layers (sums to {sum(partition)})"
        )
    out, start = [], 0
    for n in partition:
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class PrefillConfig:
    """One stage of a prefill worker. Stage k listens for control RPC on port + k."""

    model: str
    pp_size: int = 1
    pp_rank: int = 0
    partition: tuple[int, ...] | None = None
    host: str = "127.0.0.1"
    port: int = 0  # base port (stage k: port + k); 0 = any free port (pp_size 1 only)
    stage0_host: str | None = None  # where stage 0 runs (the gloo rendezvous); default host
    dist_port: int | None = None  # gloo rendezvous (TCPStore) on stage 0; default port + pp_size
    name: str | None = None  # worker name; default prefill@<stage0 host>:<port>
    elide: bool = True
    kv_format: str = "fp32"
    index_format: str = "fp32"
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None
    max_batch_tokens: int = 512
    max_running_requests: int | None = None
    dtype: str = "float32"
    backend: str = "mooncake"
    backend_options: dict[str, Any] = field(default_factory=dict, hash=False)
    stage_timeout: float = 10.0
    rpc_timeout: float = 5.0
    decode: tuple[str, ...] = ()  # decode workers to handshake with at startup (fail loudly if refused)
    debug_transfer_delay: float = 0.0  # testing: hold each transfer this long before submitting it
    prefix_cache: bool = False  # device-only prefix cache on stage 0's books (every stage keeps the pages)
    hicache_ratio: float | None = None  # host tier (turns the prefix cache on): ratio x stage 0's pool bytes
    hicache_size: int | None = None  # or stage 0's host tier bytes (every stage gets the same page count)
    hicache_layout: str = "layer_first"
    hicache_write_policy: str = "write_through"
    hicache_selective_threshold: int = 2
    # storage (L3) tier: a shared Mooncake Store on stage 0's HiCache (pp_size 1 only; needs the host tier)
    hicache_storage: StorageConfig | None = field(default=None, hash=False)
    # MTP (the decode speculates with K steps): the last stage loads the draft layer, computes its KV / INDEX_K
    # for the prompt and sends it with its other keys, plus the draft's last hidden state; K itself is the decode's
    speculative_num_steps: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"--pp-rank {self.pp_rank} must be in 0..{self.pp_size - 1} (--pp-size {self.pp_size})")
        if self.port == 0 and self.pp_size > 1:
            raise ConfigError("a pipeline of more than one stage needs an explicit --port (stage k uses port + k)")
        if self.stage_timeout <= 0 or self.rpc_timeout <= 0:
            raise ConfigError(
                f"--stage-timeout {self.stage_timeout} and --rpc-timeout {self.rpc_timeout} must be > 0 seconds"
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"--num-pages {self.num_pages} must be >= 1")
        if isinstance(self.speculative_num_steps, bool) or self.speculative_num_steps < 0:
            raise ConfigError(f"--speculative-num-steps {self.speculative_num_steps!r} must be an integer >= 0")
        if self.hicache_storage is not None and self.pp_size > 1:
            raise ConfigError(
                f"hicache_storage ({self.hicache_storage.backend}) with pp_size {self.pp_size}: only a single-stage "
                "prefill has a storage tier (later stages would need their own L3 loads); use pp_size 1"
            )

    @property
    def draft_layers(self) -> int:
        """Draft (MTP) layers on the last stage: 1 with speculation (the decode reuses one layer K times)."""
        return 1 if self.speculative_num_steps else 0

    @property
    def cache_enabled(self) -> bool:
        return self.prefix_cache or self.host_tier or self.hicache_storage is not None

    @property
    def host_tier(self) -> bool:
        return self.hicache_ratio is not None or self.hicache_size is not None

    def hicache_config(self) -> HiCacheConfig:
        return HiCacheConfig(
            hicache_ratio=self.hicache_ratio,
            hicache_size=self.hicache_size,
            layout=self.hicache_layout,
            write_policy=self.hicache_write_policy,
            selective_threshold=self.hicache_selective_threshold,
        )

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        return Timeouts(rpc=self.rpc_timeout, connect=min(2.0, self.rpc_timeout), stage=self.stage_timeout)

    @property
    def worker_name(self) -> str:
        return self.name or f"prefill@{self.stage0_host or self.host}:{self.port}"


def encode_batch(b: ForwardBatch) -> dict[str, Any]:
    def arr(t: torch.Tensor) -> list[Any]:
        a = t.to(torch.int64).contiguous().numpy()
        return [list(a.shape), a.tobytes()]

    return {
        k: arr(getattr(b, k))
        for k in ("input_ids", "positions", "prefix_lens", "extend_lens", "slot_table", "out_slots")
    }


def decode_batch(d: dict[str, Any]) -> ForwardBatch:
    def t(v: list[Any]) -> torch.Tensor:
        shape, raw = v
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int64).reshape(shape).copy())

    return ForwardBatch(**{k: t(v) for k, v in d.items()})


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
    layout: KVLayout
    num_pages: int
    group: StageGroup
    notifier: Notifier
    jobs: Ledger[StageJob]
    counters: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("submitted", "transferred", "transfer_failed", "dropped", "steps"), 0)
    )
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
    ) -> StageContext:
        """`draft`: the MTP layer for the last stage with cfg.speculative_num_steps (default: load_draft)."""
        ranges = split_layers(spec.num_layers, cfg.pp_size, cfg.partition)
        a, b = ranges[cfg.pp_rank]
        drafts = cfg.draft_layers if cfg.pp_rank == cfg.pp_size - 1 else 0
        if drafts and draft is None:
            from dsakv.model.loader import load_draft

            draft = load_draft(Path(cfg.model), dtype=model.dtype)
        if draft is not None:
            draft.to(model.device)
        t = cfg.timeouts
        group = StageGroup(
            cfg.pp_rank,
            cfg.pp_size,
            cfg.stage0_host or cfg.host,
            cfg.dist_port or default_dist_port(cfg.port, cfg.pp_size),
            t.stage,
            hidden_dtype=model.dtype,
            hidden_size=spec.hidden_size,
            bind_host=cfg.host,
        )
        return cls(
            cfg=cfg,
            spec=spec,
            model=model,
            ranges=ranges,
            layout=cls.layout_of(cfg, model, a, b, drafts),
            num_pages=cfg.num_pages or pages_for(DEFAULT_MAX_TOKENS, cfg.page_size),
            group=group,
            notifier=Notifier(t.rpc, t.connect),
            jobs=Ledger(PREFILL_STAGE, clock),
            down_reason="pipeline not formed yet" if cfg.pp_size > 1 else None,
            draft=draft if drafts else None,
        )

    @staticmethod
    def layout_of(cfg: PrefillConfig, model: DSAModel, start: int, end: int, draft_layers: int = 0) -> KVLayout:
        """The stage's pool layout: layers [start, end), plus the draft layer's keys on the last stage with MTP."""
        lay = model.layout_for(
            elide=cfg.elide,
            kv_format=cfg.kv_format,
            index_format=cfg.index_format,
            page_size=cfg.page_size,
            layer_start=start,
            layer_end=end,
        )
        return dataclasses.replace(lay, draft_layers=draft_layers) if draft_layers else lay

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
    def page_size(self) -> int:
        return self.cfg.page_size

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
        self.counters["dropped"] += 1
        self.sender.fail(job, why)
