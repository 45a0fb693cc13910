"""The serving backend contract: what the HTTP layer (dsakv.serve.app) and the router build on.

The HTTP app never touches an Engine or a router directly; it drives a `GenerationBackend`:

    backend.start()
    backend.submit("cmpl-1", prompt_ids, SamplingParams(max_new_tokens=16))   # CapacityError/ConfigError -> 4xx
    for ev in backend.events("cmpl-1", timeout=60.0):                           # TokenEvent, until ev.finished
        ...
    backend.abort("cmpl-1")                                                    # client went away
    backend.stop()

Implementations: `EngineBackend` (dsakv.serve.engine_backend, colocated: one Engine driven by a background
thread) and `RouterBackend` (dsakv.disagg.router.backend: prefill + decode workers behind a router).
Imports only the standard library and dsakv.engine.request (SamplingParams, no torch); must not import
dsakv.model, dsakv.disagg, dsakv.serve or dsakv.cli (it sits in engine so disagg can implement it).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, NamedTuple, Protocol, runtime_checkable

from dsakv.engine.request import SamplingParams, TokenLogprobs

FINISH_REASONS = ("stop", "length", "abort", "error")


class TokenEvent(NamedTuple):
    """New tokens of one choice of a request since its last event; each choice's last event has finished=True
    (params.n choices: events() ends after all n finished)."""

    new_token_ids: tuple[int, ...]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | "error" | None (not finished)
    error: str | None  # clear message when finish_reason == "error"
    logprobs: tuple[TokenLogprobs, ...] = ()  # one per new token, when params.logprobs is set
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt tokens 1.. (params.prompt_logprobs), once
    choice: int = 0  # the choice (index), 0..params.n - 1
    num_cached_tokens: int = 0  # prompt tokens reused from the prefix cache (choice 0)


# what a backend may support beyond plain generation (its `features`; the HTTP layer 400s the rest)
FEATURES = ("logprobs", "prompt_logprobs", "n", "penalties")


@runtime_checkable
class GenerationBackend(Protocol):
    name: str  # "colocated" | "disaggregated"
    # features: frozenset[str], a subset of FEATURES (optional attribute; missing = none)
    # vocab_size() -> int | None: the model's vocabulary (optional; the HTTP layer 400s token ids >= it)

    def start(self) -> None:
        """Start background work (threads, connections). Idempotent."""
        ...

    def stop(self) -> None:
        """Abort what is in flight and stop background work. Idempotent."""
        ...

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> dict[str, Any] | None:
        """Queue a request; raise dsakv.errors.CapacityError / ConfigError for bad input (-> HTTP 413/400). May
        return fields every response object of the request carries (a colocated DP instance: {"dp_rank": r})."""
        ...

    def events(self, request_id: str, timeout: float) -> Iterator[TokenEvent]:
        """Blocking iterator of events until finished; raises TimeoutError if nothing arrives within `timeout`."""
        ...

    def abort(self, request_id: str) -> None:
        """Abort a queued or running request and free its pages; no-op if unknown or finished."""
        ...

    def health(self) -> dict[str, Any]:
        """{"ok": bool, ...details}: /health returns 200 when ok, 503 otherwise."""
        ...

    def metrics(self) -> dict[str, float]:
        """Flat name -> value, exported on /metrics as gauges prefixed `dsakv_` (names: [a-z0-9_]+)."""
        ...

    def max_prompt_tokens(self) -> int:
        """The longest prompt the backend can ever take (for 4xx validation before submit)."""
        ...


__all__ = ["FEATURES", "FINISH_REASONS", "GenerationBackend", "TokenEvent"]
