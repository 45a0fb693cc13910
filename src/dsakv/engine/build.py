"""The variants an Engine is built from, chosen once (Engine.__init__ calls build_parts):

    pool        DevicePool, or HiSparsePool with --hisparse (device: index-K + hot KV rows; host: every token's KV)
    cache       the HiCache prefix cache when any cache option is on, else the injected one (or none)
    runner      the injected StepRunner (a PD pipeline stage), HiSparseRunner, or ModelRunner
    speculator  the MTP Speculator when speculative_num_steps > 0, else none

plus the page allocator and the scheduler over them. Imports cache, model and the engine's own modules; the
Engine itself (engine.py) holds the request API and the step loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hisparse import HiSparsePool
from dsakv.config import EngineConfig
from dsakv.engine.model_runner import HiSparseRunner, ModelRunner
from dsakv.engine.scheduler import DEFAULT_MAX_RUNNING, PrefixCache, ScheduledChunk, Scheduler
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)


class StepRunner(Protocol):
    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor | None: ...


@dataclass
class EngineParts:
    """What build_parts chose for one Engine."""

    pool: Any  # DevicePool | HiSparsePool
    hisparse: HiSparsePool | None
    allocator: PageAllocator
    num_pages: int
    prefix_cache: PrefixCache | None
    max_seq_len: int | None
    scheduler: Scheduler
    runner: StepRunner
    speculator: Any  # engine.speculative.Speculator | None


def build_parts(
    cfg: EngineConfig,
    spec: ModelSpec,
    model: Any,
    layout: KVLayout,
    draft: Any,
    *,
    prefix_cache: PrefixCache | None,
    runner: Callable[[DevicePool], StepRunner] | None,
    spec_poison_rejected: bool,
    model_dir: Path | None,
) -> EngineParts:
    """The pool, allocator, prefix cache, scheduler, runner and speculator of an Engine over `model` (loaded, in
    eval mode) with `layout` and the MTP `draft` (None without speculative decoding)."""
    hisparse: HiSparsePool | None = None
    max_running = cfg.scheduler.max_running_requests
    pool: Any
    if cfg.hisparse.enabled:  # device: index-K + hot KV rows; host: every token's KV (cache/hisparse)
        hisparse, num_pages, max_running = _hisparse_pool(cfg, spec, model, layout, draft, max_running)
        pool = hisparse
    else:
        num_pages = cfg.pool.pages([layout])
        pool = DevicePool(layout, num_pages, device=model.device)
    allocator = PageAllocator(num_pages, name="hisparse logical pool" if hisparse else "device pool")
    # prefix cache (dsakv.cache.hicache): any host-tier or disk option turns it on
    if cfg.cache.disk_size is not None and not cfg.cache.disk_dir:
        raise ConfigError(f"hicache_disk_size = {cfg.cache.disk_size} B needs hicache_disk_dir (the disk tier)")
    if cfg.cache.enabled:
        if prefix_cache is not None:
            raise ConfigError("give prefix_cache or enable_prefix_cache / hicache_* options, not both")
        from dsakv.cache.hicache import HiCache, HiCacheConfig, model_fingerprint

        stored = cfg.cache.disk_dir or cfg.cache.storage is not None
        model_hash = model_fingerprint(model, model_dir) if stored else None
        prefix_cache = HiCache(pool, allocator, HiCacheConfig.of(cfg.cache, model_hash))
    max_pos = spec.raw.get("max_position_embeddings")
    max_seq_len = int(max_pos) if isinstance(max_pos, int) and max_pos > 1 else None
    scheduler = Scheduler(
        allocator,
        layout.page_size,
        max_batch_tokens=cfg.scheduler.max_batch_tokens,
        max_running_requests=max_running,
        max_seq_len=max_seq_len,
        prefix_cache=prefix_cache,
    )
    step_runner: StepRunner
    if runner is not None:
        step_runner = runner(pool)
    elif hisparse is not None:
        running = scheduler.running
        step_runner = HiSparseRunner(model, hisparse, lambda: [r.request_id for r in running])
    else:
        step_runner = ModelRunner(model, pool)
    speculator: Any = None
    if draft is not None:
        from dsakv.engine.speculative import Speculator

        draft.to(model.device)
        speculator = Speculator(
            model,
            draft,
            pool,
            cfg.speculative_num_steps,
            max_seq_len=max_seq_len,
            poison_rejected=spec_poison_rejected,
        )
        scheduler.draft_lookahead = speculator.lookahead
    return EngineParts(
        pool, hisparse, allocator, num_pages, prefix_cache, max_seq_len, scheduler, step_runner, speculator
    )


def _hisparse_pool(
    cfg: EngineConfig, spec: ModelSpec, model: Any, lay: KVLayout, draft: Any, max_running: int | None
) -> tuple[HiSparsePool, int, int]:
    """The HiSparse pool (the pool config sizes its logical pool, see HiSparseConfig.sizing), its logical pages
    and the max running requests (at most one per hot buffer)."""
    if draft is not None or cfg.cache.enabled:
        what = "speculative decoding (MTP)" if draft is not None else "the prefix cache / host tier"
        raise ConfigError(f"--hisparse does not combine with {what} yet: turn one of them off")
    if lay.layer_start != 0 or lay.end != spec.num_layers:
        raise ConfigError(f"--hisparse needs every layer on one decode (not PP stage {lay.describe_range()})")
    pages, hot, buf = cfg.hisparse.sizing(lay, cfg.pool)
    h = HiSparsePool(lay, pages, buf, hot, device=model.device, pin_memory=True)
    limit = max_running or min(DEFAULT_MAX_RUNNING, cfg.scheduler.max_batch_tokens)
    if limit > hot:
        log.info("hisparse: %d hot buffers cap max_running_requests (%d asked)", hot, limit)
    log.info(
        "hisparse: %d logical tokens (index-K on device, KV on host, %.1f MiB), %d hot buffers x %d rows "
        "+ 1 page per layer; device %.1f MiB, top-k %d",
        pages * lay.page_size, h.host_bytes / 2**20, hot, buf, h.device_bytes / 2**20, spec.index_topk,
    )  # fmt: skip
    return h, pages, min(limit, hot)
