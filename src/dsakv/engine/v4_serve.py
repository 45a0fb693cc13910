"""V4ServingEngine: the serving API of Engine (what serve.EngineBackend calls) over a V4Engine.

    eng = V4ServingEngine(load_v4(model_dir), EngineConfig(...), eos_token_ids=(1,))
    eng.add_request([5, 6, 7], SamplingParams(max_new_tokens=8, temperature=0.0), request_id="cmpl-1")
    outs = eng.step()          # RequestOutput per request that got a token, finished or was aborted

Greedy, or temperature / top-k / top-p draws seeded per token (SamplingParams.seed, else one the engine draws;
v4_engine.draw), one choice, no logprobs / penalties / logit bias / min_tokens (`features` is empty: the HTTP layer
answers 400 for them; `check_v4_params` refuses them naming the parameter for other callers). The config's pool,
scheduler and cache options map onto the V4Engine: pages (num_pages / max_tokens, at the layout's page size), max
running requests (default 8), max batch tokens (also the prefill chunk), the prefix cache, a host tier of
hicache_ratio x the device pages, and L3 (the mooncake storage, or the disk tier of hicache_disk_dir). Every method
takes the lock, so HTTP threads interleave with the stepping thread. Imports torch-free dsakv.engine pieces and
dsakv.engine.v4_engine; must not import serve, disagg or cli.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from typing import Any

from dsakv.config import DEFAULT_MAX_TOKENS, EngineConfig, StorageConfig
from dsakv.engine.engine import EngineStats
from dsakv.engine.request import FinishReason, RequestOutput, SamplingParams
from dsakv.engine.v4_engine import V4Engine, V4Request
from dsakv.errors import ConfigError
from dsakv.model.deepseek_v4 import DeepseekV4

DEFAULT_V4_RUNNING = 8


def _refuse_options(cfg: EngineConfig) -> None:
    what = []
    if cfg.hisparse.enabled:
        what.append("--hisparse")
    if cfg.speculative_num_steps:
        what.append(f"--speculative-num-steps {cfg.speculative_num_steps}")
    if cfg.dtype != "float32" or cfg.weight_dtype != "model":
        what.append(f"--dtype {cfg.dtype} / --weight-dtype {cfg.weight_dtype}")
    if cfg.pool.kv_budget is not None:
        what.append("--kv-budget (give --num-pages or --max-tokens)")
    if what:
        raise ConfigError(f"DeepSeek-V4 serving does not take {', '.join(what)} yet: drop it (fp32, greedy)")


def check_v4_params(p: SamplingParams) -> None:
    """ConfigError naming what a DeepSeek-V4 request may not ask for yet (the V4 engine samples plain logits)."""
    what = [
        name for name, used in (
            (f"n {p.n}", p.n != 1), (f"logprobs {p.logprobs}", p.logprobs is not None),
            (f"prompt_logprobs {p.prompt_logprobs}", p.prompt_logprobs is not None),
            ("penalties, logit_bias or min_tokens", p.penalised),
        ) if used
    ]  # fmt: skip
    if what:
        raise ConfigError(f"DeepSeek-V4 serving does not take {', '.join(what)} yet: drop it")


def v4_storage_config(cfg: EngineConfig) -> StorageConfig | None:
    """The L3 tier of the cache options: the mooncake storage, else the disk tier's directory, else none."""
    return cfg.cache.storage_config


class V4ServingEngine:
    """Engine's serving API over a V4Engine (see module docstring)."""

    features: frozenset[str] = frozenset()

    def __init__(
        self, model: DeepseekV4, cfg: EngineConfig, eos_token_ids: Sequence[int] = (), model_hash: str | None = None
    ) -> None:
        _refuse_options(cfg)
        page = cfg.layout.page_size
        layout = model.layout(page)  # ConfigError unless a multiple of the HCA ratio
        pool = cfg.pool
        num_pages = pool.num_pages or pool.pages_for_tokens(pool.max_tokens or DEFAULT_MAX_TOKENS, layout.page)
        ratio = cfg.cache.hicache_ratio or 0.0
        storage = v4_storage_config(cfg)
        self.engine = V4Engine(
            model,
            num_pages=num_pages,
            max_running=cfg.scheduler.max_running_requests or DEFAULT_V4_RUNNING,
            page_size=page,
            chunk_size=cfg.scheduler.max_batch_tokens,
            max_batch_tokens=cfg.scheduler.max_batch_tokens,
            prefix_cache=cfg.cache.enabled,
            host_pages=int(num_pages * ratio),
            storage=storage,
            model_hash=model_hash,
        )
        self.spec = model.spec
        self.layout = self.engine.layout
        self.prefix_cache = True if cfg.cache.enabled else None
        max_pos = model.spec.raw.get("max_position_embeddings")
        self.max_seq_len = int(max_pos) if isinstance(max_pos, int) and max_pos > 1 else None
        self.eos = tuple(int(e) for e in eos_token_ids)
        self._rng = random.Random(cfg.seed)  # seeds of sampled requests that name none
        self._lock = threading.RLock()
        self._rid: dict[str, int] = {}  # request id -> V4 rid
        self._name: dict[int, str] = {}
        self._sent: dict[int, int] = {}  # tokens reported so far
        self._pending: list[RequestOutput] = []  # aborts, reported by the next step
        self._generated = self._prefill = self._count = self._lookup_tokens = 0

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        p = params or SamplingParams()
        with self._lock:
            self._check_params(len(prompt_ids), p)
            self._count += 1
            rid_name = request_id or f"v4-{self._count}"
            if rid_name in self._rid:
                raise ConfigError(f"request id {rid_name!r} is already in flight: give each request a unique id")
            eos = tuple(p.stop_token_ids) + (() if p.ignore_eos else self.eos)
            seed = p.seed if p.seed is not None else self._rng.getrandbits(63)
            rid = self.engine.add_request(list(prompt_ids), p.max_new_tokens, eos, sampling=p, seed=seed)
            self._lookup_tokens += len(prompt_ids)
            self._rid[rid_name], self._name[rid], self._sent[rid] = rid, rid_name, 0
            return rid_name

    def _check_params(self, prompt_len: int, p: SamplingParams) -> None:
        check_v4_params(p)
        total = prompt_len + p.max_new_tokens
        if self.max_seq_len is not None and total > self.max_seq_len:
            raise ConfigError(
                f"prompt {prompt_len} + max_new_tokens {p.max_new_tokens} = {total} tokens exceeds the "
                f"model's {self.max_seq_len} positions: shorten the prompt or lower max_tokens"
            )

    # ---- disaggregated decode: a request whose pages and state slot a prefill fills -------------------

    def accept(
        self, request_id: str, prompt_ids: Sequence[int], first_token: int, params: SamplingParams
    ) -> tuple[list[int], int]:
        """Reserve pages (prompt + max_new_tokens, nothing grows later) and a state slot for a request a prefill
        computes: (page ids, state slot). Parked until `start`; CapacityError with nothing held if no room."""
        with self._lock:
            self._check_params(len(prompt_ids), params)
            if request_id in self._rid:
                raise ConfigError(f"request id {request_id!r} is already in flight: give each request a unique id")
            eos = tuple(params.stop_token_ids) + (() if params.ignore_eos else self.eos)
            req = self.engine.accept_request(  # the router seeds a sampled request (prefill and decode alike)
                list(prompt_ids), first_token, params.max_new_tokens, eos, sampling=params, seed=int(params.seed or 0)
            )
            self._rid[request_id], self._name[req.rid], self._sent[req.rid] = req.rid, request_id, 0
            return [int(p) for p in req.page_ids], int(req.slot)

    def start(self, request_id: str, first_token: int, cached_tokens: int = 0) -> None:
        """The prefill filled the request's pages and slot: decode it from `first_token` (the prefill's sample)."""
        with self._lock:
            rid = self._rid[request_id]
            req = self.engine.parked[rid]
            req.output[:] = [int(first_token)]
            req.cached_tokens = cached_tokens
            self.engine.start_request(rid)
            if rid in self.engine.finished:  # done at its first token (eos, or max_new_tokens 1)
                req = self.engine.finished.pop(rid)
                self._generated += len(req.output)
                self._rid.pop(request_id, None)
                self._forget(rid)
                self._pending.append(self._output(request_id, req, len(req.output), FinishReason(req.finish_reason)))

    def drop_inbound(self, request_id: str) -> bool:
        """Free the pages and slot of an accepted request that will not start (its KV failed or it was aborted)."""
        with self._lock:
            rid = self._rid.get(request_id)
            if rid is None or rid not in self.engine.parked:
                return False
            self._rid.pop(request_id)
            self._forget(rid)
            self.engine.abort_parked(rid)
            return True

    def abort(self, request_id: str) -> RequestOutput | None:
        with self._lock:
            rid = self._rid.get(request_id)
            req = self.engine.abort(rid) if rid is not None else None
            if rid is None or req is None:  # unknown, finished, or inbound (parked: drop_inbound frees it)
                return None
            self._rid.pop(request_id)
            self._forget(rid)
            out = self._output(request_id, req, 0, FinishReason.ABORT)
            self._pending.append(out)
            return out

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.engine.has_unfinished()

    def step(self) -> list[RequestOutput]:
        with self._lock:
            outs, self._pending = self._pending, []
            if not self.engine.has_unfinished():
                return outs
            before = {r.rid: r.num_computed for r in self.engine.running}
            self.engine.step()
            live = {r.rid: r for r in self.engine.running}
            for r in live.values():
                self._prefill += max(0, min(r.num_computed, len(r.prompt)) - before.get(r.rid, r.cached_tokens))
            for rid in list(self._sent):
                req = self.engine.finished.pop(rid) if rid in self.engine.finished else live.get(rid)
                if req is None:
                    continue
                new = len(req.output) - self._sent[rid]
                if not new and not req.done:
                    continue
                self._sent[rid] = len(req.output)
                self._generated += new
                name = self._name[rid]
                if req.done:
                    self._rid.pop(name, None)
                    self._forget(rid)
                reason = FinishReason(req.finish_reason) if req.done else None
                outs.append(self._output(name, req, new, reason))
            return outs

    def _forget(self, rid: int) -> None:
        self._name.pop(rid, None)
        self._sent.pop(rid, None)

    @staticmethod
    def _output(name: str, req: V4Request, new: int, reason: FinishReason | None) -> RequestOutput:
        out = tuple(req.output)
        return RequestOutput(
            request_id=name,
            new_token_ids=out[len(out) - new :] if new else (),
            output_ids=out,
            finished=reason is not None,
            finish_reason=reason,
            num_prompt_tokens=len(req.prompt),
            num_cached_tokens=req.cached_tokens,
        )

    # ---- state -----------------------------------------------------------------------

    def stats(self) -> EngineStats:
        with self._lock:
            e, lay = self.engine, self.engine.layout
            return EngineStats(
                page_size=lay.page,
                pages_total=e.pages.num_pages,
                pages_used=e.pages.num_pages - e.pages.num_free,
                pages_free=e.pages.num_free,
                capacity_tokens=e.pages.num_pages * lay.page,
                bytes_per_token=int(lay.bytes_per_token),
                pool_bytes=e.pool.nbytes,
                num_running=len(e.running),
                num_waiting=len(e.waiting),
                num_preemptions=0,
                steps=e.steps,
                prefill_tokens=self._prefill,
                decode_tokens=max(0, self._generated - len(self._name)),
                generated_tokens=self._generated,
            )

    def cache_stats(self) -> dict[str, Any] | None:
        with self._lock:
            if not self.engine.prefix_cache:
                return None
            st: dict[str, Any] = {**self.engine.stats.as_dict(), "device_hit_tokens": self.engine.stats.hit_tokens}
            st["lookup_tokens"] = self._lookup_tokens
            if self.engine.l3 is not None:
                st.update(self.engine.l3.stats.as_dict(), disk_hit_tokens=self.engine.l3.stats.l3_hit_tokens)
            return st

    def hisparse_stats(self) -> None:
        return None

    def spec_stats(self) -> None:
        return None

    def close(self) -> None:
        self.engine.close()
