"""EngineBackend: the colocated GenerationBackend, one Engine driven by one background thread.

    backend = EngineBackend(Engine("ckpt", ...))
    backend.start()
    backend.submit("cmpl-1", [5, 6, 7], SamplingParams(max_new_tokens=8))
    for ev in backend.events("cmpl-1", timeout=60):   # TokenEvent(new_token_ids, finished, finish_reason, error)
        ...

The stepping thread sleeps until a request arrives, then loops `engine.step()` while any request is unfinished
and fans each RequestOutput out to that request's queue. Engine methods take the engine's lock, so submit/abort
from HTTP threads interleave safely with stepping. If a step raises (the engine's books are broken), every
request in flight ends with finish_reason "error", health() reports not ok from then on and submit() raises
Unavailable (503). health(), metrics() and max_prompt_tokens() wait at most STATS_WAIT_S for a running step (a long
prefill, a pipeline round trip, a collective) to release the engine; then they answer from the figures read after
the last step, and health() says how long the running step has run (`step_running_s`): a liveness probe gets its
answer while the engine works.
Imports dsakv.engine and dsakv.serve.backend; must not import disagg or cli.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from dsakv.engine.engine import Engine
from dsakv.engine.request import RequestOutput, SamplingParams
from dsakv.errors import ConfigError, DsakvError, Unavailable
from dsakv.serve.backend import FEATURES, TokenEvent

log = logging.getLogger(__name__)

T = TypeVar("T")
STATS_WAIT_S = 0.5  # how long health / metrics wait for the engine's lock before answering from the last figures


def _event(out: RequestOutput) -> TokenEvent:
    reason = str(out.finish_reason) if out.finish_reason is not None else None
    return TokenEvent(
        tuple(out.new_token_ids),
        bool(out.finished),
        reason if out.finished else None,
        out.error,
        tuple(out.new_logprobs),
        out.prompt_logprobs,
        out.choice_index,
        out.num_cached_tokens,
    )


class EngineBackend:
    """GenerationBackend over one in-process Engine (see module docstring)."""

    name = "colocated"
    features = frozenset(FEATURES)

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.features = getattr(engine, "features", self.features)  # a V4ServingEngine does fewer
        self._queues: dict[str, queue.SimpleQueue[TokenEvent]] = {}
        self._choices: dict[str, list[str]] = {}  # request id -> the engine ids of its n choices
        self._qlock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._fatal: str | None = None
        self._step_seconds = 0.0
        self._busy_steps = 0
        self._step_t0: float | None = None  # perf_counter() at the start of the step running now (None: none runs)
        self._last: dict[str, Any] = {}  # what health / metrics / max_prompt_tokens read last under the engine's lock

    # ---- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None and self._thread.is_alive():
            return
        self._read("stats", self.engine.stats)  # the figures a probe gets if the first step is long
        self._read("metrics", self._metrics)
        self._stopping.clear()
        self._thread = threading.Thread(target=self._loop, name="dsakv-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._qlock:
            ids = list(self._queues)
        for rid in ids:
            self.abort(rid)
        self._stopping.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- requests ----------------------------------------------------------------------

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any] | None:
        """Queue a request; the response fields naming where it runs ({"dp_rank": r} on a DP-attention engine)."""
        if self._fatal is not None:
            raise Unavailable(f"the engine is stopped after an internal error ({self._fatal}): restart the server")
        if self._thread is None:
            raise ConfigError("the backend is not started: call start() before submit()")
        with self._qlock:
            if request_id in self._queues:
                raise ConfigError(f"request id {request_id!r} is already in flight: give each request a unique id")
            q: queue.SimpleQueue[TokenEvent] = queue.SimpleQueue()
            ids = [request_id] + [f"{request_id}/{i}" for i in range(1, params.n)]  # Engine's names for choices
            for rid in ids:
                self._queues[rid] = q
            self._choices[request_id] = ids
        try:
            self.engine.add_request(prompt_ids, params, request_id=request_id)
        except BaseException:
            with self._qlock:
                for rid in self._choices.pop(request_id, [request_id]):
                    self._queues.pop(rid, None)
            raise
        self._wake.set()
        where = getattr(self.engine, "placement", None)
        return where(request_id) if where is not None else None

    def events(self, request_id: str, timeout: float) -> Iterator[TokenEvent]:
        with self._qlock:
            q = self._queues.get(request_id)
            ids = self._choices.get(request_id, [request_id])
        if q is None:
            raise KeyError(f"unknown request id {request_id!r}: submit() it first")
        done: set[int] = set()
        try:
            while len(done) < len(ids):
                try:
                    ev = q.get(timeout=timeout)
                except queue.Empty:
                    raise TimeoutError(
                        f"request {request_id}: no token within {timeout:g} s (engine busy or stalled)"
                    ) from None
                if ev.choice in done:
                    continue  # e.g. the engine's copy of an abort already reported
                if ev.finished:
                    done.add(ev.choice)
                yield ev
        finally:
            with self._qlock:
                for rid in ids:
                    self._queues.pop(rid, None)
                self._choices.pop(request_id, None)
            if len(done) < len(ids):  # the reader gave up (timeout, closed iterator): free the request's pages
                for i, rid in enumerate(ids):
                    if i not in done:
                        self.engine.abort(rid)

    def abort(self, request_id: str) -> None:
        """Abort a request (all its choices), or one choice by its engine id '<id>/<i>'."""
        with self._qlock:
            ids = self._choices.get(request_id, [request_id])
        for rid in ids:
            out = self.engine.abort(rid)
            if out is not None:
                self._put(out)  # the final 'abort' event now; the copy step() reports later is skipped
        self._wake.set()

    def release(self, request_id: str) -> None:
        """The reader of `request_id` is gone (the client left, maybe before reading any event): abort it and drop
        its queue now (events() would drop it only once read to the end)."""
        self.abort(request_id)
        with self._qlock:
            for rid in self._choices.pop(request_id, [request_id]):
                self._queues.pop(rid, None)

    def pending(self) -> int:
        """Requests whose events are kept for a reader (0 when idle: nothing leaked)."""
        with self._qlock:
            return len(self._choices)

    def abort_choice(self, request_id: str, index: int) -> None:
        """Abort choice `index` of a request only (its stop string matched); the others go on."""
        with self._qlock:
            ids = self._choices.get(request_id, [request_id])
        if 0 <= index < len(ids):
            out = self.engine.abort(ids[index])
            if out is not None:
                self._put(out)
        self._wake.set()

    # ---- state -----------------------------------------------------------------------

    def _read(self, what: str, read: Callable[[], T]) -> tuple[T, float | None]:
        """`read()` under the engine's lock, and None; or, while a step holds the lock longer than STATS_WAIT_S,
        what `read` returned last time and how long the running step has run (seconds)."""
        lock = getattr(self.engine, "lock", None)
        held = False
        if lock is not None and what in self._last:  # the first read waits: there is nothing to answer from yet
            held = lock.acquire(timeout=STATS_WAIT_S)
            if not held:
                t0 = self._step_t0
                return self._last[what], (time.perf_counter() - t0 if t0 is not None else 0.0)
        try:
            got = read()
        finally:
            if held and lock is not None:
                lock.release()
        self._last[what] = got
        return got, None

    def health(self) -> dict[str, Any]:
        st, running = self._read("stats", self.engine.stats)
        return {
            "ok": self._fatal is None and self._thread is not None and self._thread.is_alive(),
            "backend": self.name,
            "error": self._fatal,
            "model": self.engine.spec.name,
            "elide": getattr(self.engine.layout, "elide", False),
            "pages_total": st.pages_total,
            "pages_used": st.pages_used,
            "pages_free": st.pages_free,
            "capacity_tokens": st.capacity_tokens,
            "running": st.num_running,
            "waiting": st.num_waiting,
            "step_running_s": None if running is None else round(running, 3),  # figures from before that step
        } | self._rank_rows("dp_ranks")

    def _rank_rows(self, key: str) -> dict[str, Any]:
        """{key: one row per DP rank} on a DP-attention engine (engine/dp_serve.py), else {}."""
        rows = getattr(self.engine, "rank_rows", None)
        return {key: rows()} if rows is not None else {}

    def metrics(self) -> dict[str, float]:
        m, running = self._read("metrics", self._metrics)
        # > 0: a step has held the engine that long and the other figures were read before it
        return {**m, "engine_step_running_seconds": running or 0.0}

    def _metrics(self) -> dict[str, float]:
        st = self.engine.stats()
        lay = self.engine.layout
        m: dict[str, float] = {
            "pool_pages_total": st.pages_total,
            "pool_pages_used": st.pages_used,
            "pool_pages_free": st.pages_free,
            "pool_page_size_tokens": st.page_size,
            "pool_bytes": st.pool_bytes,
            "capacity_tokens": st.capacity_tokens,
            "kv_bytes_per_token": st.bytes_per_token,
            "elide": 1.0 if getattr(lay, "elide", False) else 0.0,
            "engine_running": st.num_running,
            "engine_waiting": st.num_waiting,
            "engine_preemptions_total": st.num_preemptions,
            "engine_steps_total": st.steps,
            "engine_prefill_tokens_total": st.prefill_tokens,
            "engine_decode_tokens_total": st.decode_tokens,
            "engine_generated_tokens_total": st.generated_tokens,
            "engine_step_seconds_total": self._step_seconds,
        }
        cache = self.engine.cache_stats()
        if cache is not None:
            for k, v in cache.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    m[f"prefix_cache_{k}"] = float(v)
            hit = sum(float(cache.get(k, 0)) for k in ("device_hit_tokens", "host_hit_tokens", "disk_hit_tokens"))
            looked = float(cache.get("lookup_tokens", 0))
            m["prefix_cache_hit_tokens_total"] = hit
            m["prefix_cache_hit_rate"] = hit / looked if looked else 0.0
        hs = self.engine.hisparse_stats()
        if hs is not None:  # dsakv_hisparse_hit_rate, ..._rows_in_total, per layer ..._layer3_rows_in_last_step
            for k, v in hs.items():
                if isinstance(v, dict):
                    stem = k.removesuffix("_last_step")
                    m.update({f"hisparse_layer{layer}_{stem}_last_step": float(n) for layer, n in v.items()})
                else:
                    m[f"hisparse_{k}"] = float(v)
        for row in self._rank_rows("rows").get("rows", []):  # per DP rank: dsakv_dp_pages_used{dp_rank="1"}, ...
            m.update({f'dp_{k}{{dp_rank="{row["dp_rank"]}"}}': float(v) for k, v in row.items() if k != "dp_rank"})
        spec = self.engine.spec_stats()
        if spec is not None:  # speculative decoding: dsakv_spec_acceptance_rate, dsakv_spec_mean_accepted_length, ...
            m.update({k: float(v) for k, v in spec.items()})
        return m

    def vocab_size(self) -> int:
        return int(self.engine.spec.vocab_size)

    def max_prompt_tokens(self) -> int:
        cap = self._read("stats", self.engine.stats)[0].capacity_tokens  # the pool's size: a snapshot is as good
        if self.engine.max_seq_len is not None:
            cap = min(cap, self.engine.max_seq_len)
        return max(cap - 1, 0)  # room for at least one new token

    # ---- the stepping thread ------------------------------------------------------------

    def _put(self, out: RequestOutput) -> None:
        with self._qlock:
            q = self._queues.get(out.request_id)
        if q is not None:
            q.put(_event(out))

    def _loop(self) -> None:
        eng = self.engine
        while not self._stopping.is_set():
            self._wake.wait(timeout=0.5)
            self._wake.clear()
            while not self._stopping.is_set():
                idle = not eng.has_unfinished()
                t0 = self._step_t0 = time.perf_counter()
                try:
                    outs = eng.step()  # idle: drain aborts reported after the last request left
                except Exception as e:  # broken books or a dead rank: fail everything in flight, report unhealthy
                    self._fail_all(f"{type(e).__name__}: {e}", known=isinstance(e, DsakvError))
                    return
                finally:
                    self._step_t0 = None
                if idle:
                    for out in outs:
                        self._put(out)
                    break
                self._step_seconds += time.perf_counter() - t0
                for out in outs:
                    self._put(out)

    def _fail_all(self, message: str, known: bool = False) -> None:
        say = log.error if known else log.exception  # a known failure (a rank down): its message says it all
        say("engine step failed; failing every request in flight: %s", message)
        self._fatal = message
        with self._qlock:
            ids = list(self._queues)
            choice = {rid: i for v in self._choices.values() for i, rid in enumerate(v)}
        for rid in ids:
            try:
                self.engine.abort(rid)
            except Exception:  # the engine is already broken; the client still gets its error below
                log.debug("abort of %s after the failure raised", rid, exc_info=True)
            with self._qlock:
                q = self._queues.get(rid)
            if q is not None:
                q.put(TokenEvent((), True, "error", f"engine step failed: {message}", choice=choice.get(rid, 0)))


__all__ = ["EngineBackend"]
