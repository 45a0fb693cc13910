"""Engine: the reference DSA engine, a checkpoint on a paged, ownership-aware KV pool.

    engine = Engine("ckpt_dir", EngineConfig(layout=LayoutConfig(page_size=16), pool=PoolConfig(max_tokens=4096)))
    engine = dsakv.LLM("ckpt_dir", page_size=16, max_tokens=4096)  # the public API: the CLI's flag names
    rid = engine.add_request([1, 2, 3], SamplingParams(max_new_tokens=32))
    while engine.has_unfinished():
        for out in engine.step():        # RequestOutput: new_token_ids, output_ids, finished, finish_reason
            ...
    engine.generate([[1, 2, 3], [4, 5]], SamplingParams(max_new_tokens=8))   # -> [[...], [...]]

The pool is DevicePool(layout, num_pages) with layout = config.layout.layout(spec) (a KVLayout): the
very object the capacity planner sizes; num_pages = config.pool.pages([layout]). All public methods
take one lock (`engine.lock`), so a server may call add_request/abort from other threads while one
thread loops on step().

Injection hooks (a pipeline-parallel prefill stage 0 is an Engine over its own layers):
`layout=` a KVLayout of a layer range instead of the whole model; `runner=` a factory
pool -> StepRunner whose run(chunks) returns the logits, or None when a later pipeline stage
samples (the sampled rows then get a placeholder token 0); `engine.on_schedule` is called
with every SchedulerOutput (preempted requests included) before the step runs.
Imports torch, dsakv.{spec,cache,model} and dsakv.engine; must not import disagg, serve or cli.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hisparse import HiSparsePool
from dsakv.config import EngineConfig
from dsakv.engine.build import StepRunner, build_parts
from dsakv.engine.engine_requests import EngineRequests
from dsakv.engine.engine_stats import EngineBooks, EngineStats
from dsakv.engine.engine_step import EngineStep
from dsakv.engine.request import FinishReason, RequestOutput, SamplingParams
from dsakv.engine.scheduler import (
    NoFreePages,
    PrefixCache,
    SchedulerOutput,
)
from dsakv.errors import CapacityError, ConfigError, DsakvError
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)


class GenerationError(DsakvError):
    """A request of Engine.generate() finished with an error."""


def _eos_from(cfg: dict[str, Any]) -> tuple[int, ...] | None:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return None
    if isinstance(eos, int) and not isinstance(eos, bool):
        return (eos,)
    if isinstance(eos, list) and all(isinstance(e, int) and not isinstance(e, bool) for e in eos):
        return tuple(eos)
    raise ConfigError(f"eos_token_id = {eos!r} must be a token id or a list of token ids")


def read_eos_token_ids(spec: ModelSpec, model_dir: Path | None) -> tuple[int, ...]:
    """eos ids as transformers' generate() uses them: generation_config.json, else config.json."""
    if model_dir is not None and (model_dir / "generation_config.json").is_file():
        gen = json.loads((model_dir / "generation_config.json").read_text())
        found = _eos_from(gen) if isinstance(gen, dict) else None
        if found is not None:
            return found
    return _eos_from(spec.raw) or ()


class Engine(EngineRequests, EngineStep, EngineBooks):
    """The request API (engine_requests.py), the step loop (engine_step.py), the books (engine_stats.py)."""

    def __init__(
        self,
        model: str | Path | tuple[ModelSpec, Any],
        config: EngineConfig | None = None,
        *,
        eos_token_ids: Sequence[int] | None = None,
        prefix_cache: PrefixCache | None = None,
        check_every_step: bool = False,
        layout: KVLayout | None = None,
        runner: Callable[[DevicePool], StepRunner] | None = None,
        speculative_num_steps: int | None = None,
        draft: Any = None,
        spec_poison_rejected: bool = False,
        model_dir: str | Path | None = None,
    ) -> None:
        """`config` is the engine branch of the configuration tree (None: `EngineConfig()`, every default).

        `speculative_num_steps` K > 0 (here or in the tree) turns on MTP speculative decoding: `draft` is the MTP
        layer (default: load_draft from the checkpoint), the pool holds one draft layer's KV / index-K, and
        `spec_poison_rejected` (testing) writes NaN into rejected positions after each step. `model_dir` names the
        checkpoint of an already loaded `(spec, model)` (its generation_config, its cached weights fingerprint)."""
        cfg = config if config is not None else EngineConfig()
        if speculative_num_steps is not None:  # the keyword wins over the tree's (validated there)
            cfg = replace(cfg, speculative_num_steps=speculative_num_steps)
        self.config = cfg
        self.model_dir: Path | None = Path(model_dir) if model_dir is not None else None
        if isinstance(model, tuple):
            self.spec, self.model = model
        else:
            from dsakv.model.loader import load_model

            self.model_dir = Path(model)
            self.spec, self.model = load_model(
                self.model_dir, dtype=getattr(torch, cfg.dtype), weight_dtype=cfg.weight_dtype
            )
        self.model.eval()
        if cfg.int8_gemv:  # process-wide: every int8-packed model's small matmuls (model/quant.py)
            from dsakv.model.quant import use_int8_gemv

            use_int8_gemv(True)
        if cfg.compile_decode:  # process-wide too: every float model's few-row matmuls (model/gemv.py)
            from dsakv.model.gemv import use_compiled_gemv

            use_compiled_gemv(True)
        self.speculative_num_steps = speculative_num_steps = cfg.speculative_num_steps
        if speculative_num_steps and draft is None:
            if self.model_dir is None:
                raise ConfigError("speculative decoding needs the MTP draft: pass draft= (load_draft) with the model")
            from dsakv.model.loader import load_draft

            draft = load_draft(self.model_dir, dtype=getattr(torch, cfg.dtype), weight_dtype=cfg.weight_dtype)
        self.draft = draft if speculative_num_steps else None
        if layout is not None and self.draft is not None:
            raise ConfigError(
                "speculative decoding with an injected layout is not supported (a PD prefill stage runs the draft "
                "with engine.speculative.draft_prefill; a decode builds its own layout)"
            )
        self.layout = layout or cfg.layout.layout(self.spec, draft_layers=cfg.draft_layers)
        page_size = self.layout.page_size
        parts = build_parts(
            cfg,
            self.spec,
            self.model,
            self.layout,
            self.draft,
            prefix_cache=prefix_cache,
            runner=runner,
            spec_poison_rejected=spec_poison_rejected,
            model_dir=self.model_dir,
        )
        self.pool: Any = parts.pool
        self.hisparse: HiSparsePool | None = parts.hisparse
        self.allocator = parts.allocator
        num_pages = parts.num_pages
        self.prefix_cache: PrefixCache | None = parts.prefix_cache
        self.max_seq_len: int | None = parts.max_seq_len
        self.scheduler = parts.scheduler
        self.runner: StepRunner = parts.runner
        self.on_schedule: Callable[[SchedulerOutput], None] | None = None
        self.speculator: Any = parts.speculator
        self.eos_token_ids = (
            tuple(int(e) for e in eos_token_ids)
            if eos_token_ids is not None
            else read_eos_token_ids(self.spec, self.model_dir)
        )
        self.check_every_step = check_every_step
        self._rng = random.Random(cfg.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self._lock = threading.RLock()
        self._pending: list[RequestOutput] = []  # aborted requests, reported by the next step()
        self._held: SchedulerOutput | None = None  # a step whose group re-forms (StepRetry): run again next
        self._steps = self._prefill_tokens = self._decode_tokens = self._generated = 0
        log.info(
            "engine: %s, %d pages x %d tokens (%d tokens, %.1f MiB, %d B/token, elide=%s, kv=%s, index=%s)",
            self.spec.name,
            num_pages,
            page_size,
            num_pages * page_size,
            self.pool.nbytes / 2**20,
            self.layout.bytes_per_token,
            self.layout.elide,
            self.layout.kv_format,
            self.layout.index_format,
        )

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method takes (reentrant): hold it to make several calls one atomic step."""
        return self._lock

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        progress: bool = False,
    ) -> list[list[int]]:
        """Run `prompts` to completion (continuous batching); the output ids of each, in order.

        `params` is one SamplingParams for all prompts or one per prompt. Raises CapacityError (queuing
        nothing) if a prompt can never fit, GenerationError if a request fails.
        """
        if params is None or isinstance(params, SamplingParams):
            plist = [params or SamplingParams()] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ConfigError(f"generate: {len(plist)} SamplingParams for {len(prompts)} prompts")
        if any(sp.n != 1 for sp in plist):
            raise ConfigError("generate: n > 1 is for add_request (one output per prompt here)")
        with self._lock:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                self.scheduler.check_fits(f"#{i}", len(p), sp.max_new_tokens)
            rids = [self.add_request(p, sp) for p, sp in zip(prompts, plist, strict=True)]
        wanted = set(rids)
        done: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=sum(sp.max_new_tokens for sp in plist), desc="generate", unit="tok")
        try:
            while len(done) < len(rids):
                for out in self.step():
                    if out.request_id in wanted:
                        if bar is not None:
                            bar.update(len(out.new_token_ids))
                        if out.finished:
                            done[out.request_id] = out
        except BaseException:
            for rid in wanted - done.keys():
                self.abort(rid)
            raise
        finally:
            if bar is not None:
                bar.close()
        errors = [o for o in done.values() if o.finish_reason in (FinishReason.ERROR, FinishReason.ABORT)]
        if errors:
            e = errors[0]
            raise GenerationError(f"request {e.request_id} ended with {e.finish_reason}: {e.error or 'aborted'}")
        return [list(done[r].output_ids) for r in rids]


__all__ = ["CapacityError", "Engine", "EngineStats", "GenerationError", "NoFreePages", "read_eos_token_ids"]
