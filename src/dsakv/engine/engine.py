"""Engine: the reference DSA engine, a checkpoint on a paged, ownership-aware KV pool.

    engine = Engine("ckpt_dir", EngineConfig(layout=LayoutConfig(page_size=16), pool=PoolConfig(max_tokens=4096)))
    engine = Engine("ckpt_dir", page_size=16, max_tokens=4096)     # the same, flat (EngineConfig.OPTIONS)
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.allocator import IntegrityError
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hisparse import HiSparsePool
from dsakv.engine.build import StepRunner, build_parts
from dsakv.engine.config import EngineConfig
from dsakv.engine.request import FinishReason, Request, RequestOutput, SamplingParams, TokenLogprobs
from dsakv.engine.sampling import prompt_token_logprobs, sample_batch, validate_sampling
from dsakv.engine.scheduler import (
    NoFreePages,
    PrefixCache,
    ScheduledChunk,
    SchedulerOutput,
)
from dsakv.errors import CapacityError, ConfigError, DsakvError
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)


class GenerationError(DsakvError):
    """A request of Engine.generate() finished with an error."""


@dataclass(frozen=True)
class EngineStats:
    page_size: int
    pages_total: int
    pages_used: int
    pages_free: int
    capacity_tokens: int
    bytes_per_token: int
    pool_bytes: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    steps: int
    prefill_tokens: int  # tokens computed in prefill chunks (prompts, and recomputation after preemption)
    decode_tokens: int  # tokens computed one at a time after the prompt
    generated_tokens: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


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


class Engine:
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
        **options: Any,
    ) -> None:
        """`config` is the engine branch of the configuration tree; or give its flat options instead
        (`EngineConfig.OPTIONS`: elide, kv_format, index_format, page_size, num_pages, max_tokens, kv_budget,
        max_batch_tokens, max_running_requests, dtype, seed, speculative_num_steps, enable_prefix_cache, hicache_*).

        `speculative_num_steps` K > 0 (here or in the tree) turns on MTP speculative decoding: `draft` is the MTP
        layer (default: load_draft from the checkpoint), the pool holds one draft layer's KV / index-K, and
        `spec_poison_rejected` (testing) writes NaN into rejected positions after each step. `model_dir` names the
        checkpoint of an already loaded `(spec, model)` (its generation_config, its cached weights fingerprint)."""
        if config is not None and options:
            raise ConfigError(f"give config or engine options ({', '.join(sorted(options))}), not both")
        cfg = config if config is not None else EngineConfig.from_options(**options)
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

    def hisparse_stats(self) -> dict[str, Any] | None:
        """HiSparse hot-buffer counters and sizes (HiSparsePool.stats_dict()), None without --hisparse."""
        with self._lock:
            return self.hisparse.stats_dict() if self.hisparse is not None else None

    @property
    def lock(self) -> threading.RLock:
        """The lock every public method takes (reentrant): hold it to make several calls one atomic step."""
        return self._lock

    # ---- requests ----------------------------------------------------------------------

    def _new_request(
        self, request_id: str | None, prompt_ids: Sequence[int], params: SamplingParams | None, keep_pages: bool
    ) -> Request:
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        vocab = self.spec.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, int) and not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"request {rid}: prompt token id(s) {bad[:8]} are outside the vocabulary 0..{vocab - 1}")
        try:
            validate_sampling(params, vocab, self.eos_token_ids)
        except ConfigError as e:
            raise ConfigError(f"request {rid}: {e}") from None
        if self.hisparse is not None and params.n > self.scheduler.max_running_requests:
            raise ConfigError(
                f"request {rid}: n = {params.n} sequences need a HiSparse hot buffer each, but this engine runs at "
                f"most {self.scheduler.max_running_requests} requests (one hot buffer each): lower n to at most "
                f"{self.scheduler.max_running_requests}, or give HiSparse more device memory"
            )
        return Request(
            request_id=rid,
            prompt_ids=tuple(prompt_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            arrival=next(self._arrivals),
            sampling_seed=params.seed if params.seed is not None else self._rng.getrandbits(63),
            keep_pages=keep_pages,
        )

    def _with_forks(self, req: Request) -> Request:
        """params.n > 1: the other n - 1 sequences as req.forks, ids '<id>/<i>', seed + i, no prompt logprobs."""
        p = req.params
        if p.n > 1:
            if req.keep_pages:
                raise ConfigError(f"request {req.request_id}: n = {p.n} > 1 is not supported with keep_pages")
            child = replace(p, prompt_logprobs=None)
            for i in range(1, p.n):
                req.forks.append(
                    Request(
                        request_id=f"{req.request_id}/{i}",
                        prompt_ids=req.prompt_ids,
                        params=child,
                        eos_token_ids=req.eos_token_ids,
                        arrival=req.arrival,
                        sampling_seed=(req.sampling_seed + i) % 2**63,
                        choice_index=i,
                    )
                )
        return req

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        keep_pages: bool = False,
    ) -> str:
        """Queue a request; returns its id. Raises CapacityError (queuing nothing) if it can never fit.

        keep_pages=True (a prefill worker): when it finishes (stop/length) its pages stay held until
        release(request_id), so its KV can be read (pages_of) and transferred first.

        params.n > 1: n sequences; the returned id is sequence 0, sequence i is '<id>/<i>' (sampling seed + i,
        RequestOutput.choice_index i). They share the prompt's whole pages: sequence 0 prefills the prompt and
        the others start from its pages (refcounted), recomputing only the prompt's last partial page."""
        with self._lock:
            req = self._with_forks(self._new_request(request_id, prompt_ids, params, keep_pages))
            self.scheduler.add(req)
            log.debug("queued %s", req)
            return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (waiting, running, or waiting for its KV) and free its pages; its final output (reason
        'abort') is returned and also reported by the next step(). None if the id is unknown or finished (a
        finished request's kept pages are released)."""
        with self._lock:
            if request_id in self.scheduler.kept:
                self.scheduler.release(request_id)
                return None
            req = self.scheduler.abort(request_id)
            if req is None:
                return None
            out = RequestOutput.of(req, 0)
            self._pending.append(out)
            return out

    # ---- disaggregated serving --------------------------------------------------------------

    def prealloc(
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams | None = None
    ) -> npt.NDArray[np.int64]:
        """Decode worker: reserve the pages of a request whose prompt is prefilled elsewhere (prompt + its first
        token), held under request_id; returns their ids, in token order, for the prefill worker to write the KV
        to (token t at slot page_ids[t // page_size] * page_size + t % page_size). Then start_decode() it, or
        abort() it if the transfer fails. Raises CapacityError if it can never fit, NoFreePages if not now."""
        with self._lock:
            req = self._with_forks(self._new_request(request_id, prompt_ids, params, False))
            return self.scheduler.prealloc(req)

    def start_decode(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: Sequence[TokenLogprobs] = (),
        cached_tokens: int = 0,
        draft_hidden: torch.Tensor | None = None,
    ) -> RequestOutput:
        """Decode worker: the prompt's KV is in the prealloc'd pages and the prefill sampled `first_token` (with
        its logprobs and the prompt's, when the params ask; `cached_tokens`: the prefill's prefix-cache hit, for
        usage); the request now decodes, and with params.n > 1 its other choices start on its prompt pages as
        add_request's do. The returned output (first token; finished if that token stops it) is also reported
        by the next step(). With speculation, `draft_hidden` [H] (the prefill's draft output at the prompt's last
        entry, engine.speculative.draft_prefill) lets the first decode step verify a draft."""
        with self._lock:
            req = self.scheduler.start_decode(request_id, first_token)
            if first_logprobs is not None:
                req.output_logprobs = [first_logprobs]
            req.prompt_logprobs = list(prompt_logprobs)
            req.num_cached_tokens = int(cached_tokens)
            if self.speculator is not None and draft_hidden is not None and not req.is_finished:
                self.speculator.seed(req, draft_hidden)
            out = RequestOutput.of(req, 1)
            self._pending.append(out)
            return out

    def pages_of(self, request_id: str) -> npt.NDArray[np.int64]:
        """Page ids a request holds, in token order (running, waiting for KV, or finished with keep_pages)."""
        with self._lock:
            return self.scheduler.pages_of(request_id)

    def release(self, request_id: str) -> bool:
        """Prefill worker: free the pages a finished keep_pages request holds. False if it holds none."""
        with self._lock:
            return self.scheduler.release(request_id) is not None

    def get_request(self, request_id: str) -> Request | None:
        with self._lock:
            return self.scheduler.requests.get(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()

    # ---- stepping ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; outputs of every request that got a token, finished, failed or was aborted."""
        with self._lock:
            outputs, self._pending = self._pending, []
            sched = self.scheduler.schedule()
            if self.on_schedule is not None:
                self.on_schedule(sched)
            if sched.is_empty:
                sch = self.scheduler
                # requests waiting on pages that only an outside event frees (a KV transfer, a release) are not
                # stalled; anything else that cannot run with nothing running is a bug: fail loudly, never spin
                if sch.has_unfinished() and not (sched.preempted or sch.awaiting_kv or sch.kept):
                    raise IntegrityError(
                        f"scheduler stalled: {self.scheduler.num_waiting} waiting and {self.scheduler.num_running} "
                        f"running requests but nothing could be scheduled ({self.allocator.num_free} pages free)"
                    )
                return outputs
            self._steps += 1
            if self.speculator is not None:
                return self._spec_step(sched, outputs)
            chunks = sched.chunks
            errors: dict[int, str] = {}  # chunk index -> its request's own error: that request fails alone
            try:
                next_tokens = self._run_rows(chunks, errors)
            except Exception as e:  # the step failed: its requests finish with the error, pages come back
                sched = self._fail_rows(sched, outputs, errors)
                return self._fail_step(sched, outputs, e, "model")
            if errors:
                next_tokens = [t for i, t in enumerate(next_tokens) if i not in errors]
                sched = self._fail_rows(sched, outputs, errors)
                chunks = sched.chunks
            for c in chunks:
                if c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens:
                    self._decode_tokens += 1
                else:
                    self._prefill_tokens += c.num_tokens
            got = self.scheduler.update(sched, next_tokens)
            self._generated += len(got)
            outputs.extend(RequestOutput.of(r, 1) for r in got)
            if self.check_every_step:
                self.check_integrity()
            return outputs

    def _run_rows(self, chunks: Sequence[ScheduledChunk], errors: dict[int, str]) -> list[int | None]:
        """The step's forward and sampling; a row whose admission (HiSparse), prompt logprobs, logits or sampling
        fails gets errors[i] (the others go on without it). The token of each chunk (None: it did not sample)."""
        prepare = getattr(self.runner, "prepare_rows", None)  # HiSparse: rows the pool cannot take fail alone
        if prepare is not None:
            errors.update(prepare(chunks))
        idx = [i for i in range(len(chunks)) if i not in errors]
        run = [chunks[i] for i in idx]
        next_tokens: list[int | None] = [None] * len(chunks)
        if not run:
            return next_tokens
        positions = [self._prompt_logprob_positions(c) for c in run]
        with_prompt = getattr(self.runner, "run_with_prompt_logits", None)  # ModelRunner (all layers)
        if any(positions) and with_prompt is not None:
            logits, extra = with_prompt(run, positions)
            for j, err in self._add_prompt_logprobs(run, positions, extra).items():
                errors[idx[j]] = err
        else:
            logits = self.runner.run(run)
        rows = [j for j, c in enumerate(run) if c.samples and idx[j] not in errors]
        if rows and logits is None:  # a later pipeline stage samples: placeholder tokens here
            for j in rows:
                next_tokens[idx[j]] = 0
        elif rows:
            assert logits is not None
            picked = logits if len(rows) == len(run) else logits[rows]  # decode: every row samples
            got = sample_batch(picked, [run[j].request for j in rows])
            for j, t, lp, bad in zip(rows, got.tokens, got.logprobs, got.errors, strict=True):
                if bad is not None:
                    errors[idx[j]] = bad
                    continue
                next_tokens[idx[j]] = t
                if lp is not None:
                    run[j].request.output_logprobs.append(lp)
        return next_tokens

    def _fail_rows(
        self, sched: SchedulerOutput, outputs: list[RequestOutput], errors: dict[int, str]
    ) -> SchedulerOutput:
        """Fail the requests of the rows in `errors` alone (pages freed); the step without them."""
        if not errors:
            return sched
        for i, err in sorted(errors.items()):
            log.warning("request %s failed alone in its step: %s", sched.chunks[i].request.request_id, err)
        rest, failed = self.scheduler.fail_rows(sched, errors)
        if self.speculator is not None:
            for r in failed:
                self.speculator.forget(r.request_id)
        outputs.extend(RequestOutput.of(r, 0) for r in failed)
        return rest

    def _fail_step(self, sched: Any, outputs: list[RequestOutput], e: Exception, what: str) -> list[RequestOutput]:
        """A step raised: its requests finish with the error and their pages (and draft state) come back."""
        say = log.error if isinstance(e, DsakvError) else log.exception  # a known failure: its message says it all
        say("%s step failed for %d requests: %s: %s", what, len(sched.chunks), type(e).__name__, e)
        failed = self.scheduler.fail(sched, f"model step failed: {type(e).__name__}: {e}")
        if self.speculator is not None:
            for r in failed:
                self.speculator.forget(r.request_id)
        outputs.extend(RequestOutput.of(r, 0) for r in failed)
        if self.check_every_step:
            self.check_integrity()
        return outputs

    def _spec_step(self, sched: Any, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """step() with speculative decoding (engine/speculative.py): draft, verify, accept, roll back."""
        chunks = sched.chunks
        try:
            produced = self.speculator.run(chunks)
        except Exception as e:  # the step failed: its requests finish with the error, pages come back
            return self._fail_step(sched, outputs, e, "speculative")
        errors = dict(self.speculator.errors)
        if errors:
            produced = [t for i, t in enumerate(produced) if i not in errors]
            sched = self._fail_rows(sched, outputs, errors)
            chunks = sched.chunks
        for c in chunks:
            if c.num_tokens == 1 and c.start >= c.request.num_prompt_tokens:
                self._decode_tokens += 1 + c.num_draft
            else:
                self._prefill_tokens += c.num_tokens
        before = {c.request.request_id: c.request.num_output_tokens for c in chunks}
        got = self.scheduler.update_spec(sched, produced)
        for r in got:
            n = r.num_output_tokens - before[r.request_id]
            self._generated += n
            self.speculator.keep_logprobs(r, n)
            outputs.append(RequestOutput.of(r, n))
            if r.is_finished:
                self.speculator.forget(r.request_id)
        self.speculator.prune(self.scheduler.requests)
        if self.check_every_step:
            self.check_integrity()
        return outputs

    def spec_stats(self) -> dict[str, float] | None:
        """Speculative decoding counters (acceptance rate, mean accepted length, ...), None without speculation."""
        with self._lock:
            return self.speculator.stats.to_dict() if self.speculator is not None else None

    @staticmethod
    def _prompt_logprob_positions(c: Any) -> list[int]:
        """Positions of chunk c whose logits give a prompt token's logprob (position t -> prompt token t + 1)."""
        req = c.request
        if req.params.prompt_logprobs is None:
            return []
        return list(range(max(c.start, len(req.prompt_logprobs)), min(c.end, req.num_prompt_tokens - 1)))

    @staticmethod
    def _add_prompt_logprobs(
        chunks: Sequence[Any], positions: list[list[int]], extra: list[torch.Tensor]
    ) -> dict[int, str]:
        """Prompt logprobs of each chunk; a chunk whose logits cannot give them (NaN) is returned by index with its
        error (that request fails alone)."""
        errors: dict[int, str] = {}
        for j, (c, pos, lg) in enumerate(zip(chunks, positions, extra, strict=True)):
            if not pos:
                continue
            req = c.request
            if pos[0] != len(req.prompt_logprobs):
                raise IntegrityError(
                    f"{req.request_id}: prompt logprobs from position {pos[0]}, has {len(req.prompt_logprobs)}"
                )
            k = int(req.params.prompt_logprobs or 0)
            try:
                req.prompt_logprobs.extend(prompt_token_logprobs(lg, req.prompt_ids, pos, k))
            except Exception as e:
                errors[j] = f"prompt logprobs failed: {type(e).__name__}: {e}"
        return errors

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

    # ---- books ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + held pages == total and every request holds exactly its pages."""
        with self._lock:
            self.scheduler.check_integrity()

    def cache_stats(self) -> dict[str, Any] | None:
        """Prefix-cache counters (HiCacheStats.to_dict()), or None without a HiCache prefix cache."""
        with self._lock:
            stats = getattr(self.prefix_cache, "stats", None)
            return stats.to_dict() if stats is not None and hasattr(stats, "to_dict") else None

    def stats(self) -> EngineStats:
        with self._lock:
            a = self.allocator
            return EngineStats(
                page_size=self.layout.page_size,
                pages_total=a.num_pages,
                pages_used=a.num_used,
                pages_free=a.num_free,
                capacity_tokens=a.num_pages * self.layout.page_size,
                bytes_per_token=self.layout.bytes_per_token,
                pool_bytes=self.pool.nbytes,
                num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting,
                num_preemptions=self.scheduler.num_preemptions,
                steps=self._steps,
                prefill_tokens=self._prefill_tokens,
                decode_tokens=self._decode_tokens,
                generated_tokens=self._generated,
            )


__all__ = ["CapacityError", "Engine", "EngineStats", "GenerationError", "NoFreePages", "read_eos_token_ids"]
