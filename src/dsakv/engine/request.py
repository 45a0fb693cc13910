"""Request and SamplingParams: one generation request, its state held in token counters.

A request's tokens are prompt_ids + output_ids. `num_computed_tokens` of them have
their KV in the pool (at slots of `page_ids`); the scheduler computes the rest in
chunks. When a chunk brings num_computed_tokens up to num_tokens, the logits of
its last token give the next output token:

    tokens:   | prompt (num_prompt_tokens) ............ | output_ids ........ |
    computed: |<-- num_computed_tokens -->|  pending  ->|
    pages:    | page_ids[0] | page_ids[1] | ...   (ceil(num_computed / page_size) pages held)

Preemption resets num_computed_tokens (the pages are freed) and keeps output_ids:
the request later recomputes prompt + outputs and continues where it stopped.
Imports only the standard library and dsakv.errors; must not import model, disagg, serve or cli.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dsakv.errors import ConfigError

MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI's top_logprobs


class RequestStatus(enum.StrEnum):
    WAITING = "waiting"  # queued: new or preempted (no pages), or prefilled elsewhere and ready (holds its pages)
    WAITING_KV = "waiting_kv"  # disaggregated decode: pages reserved, its KV is being transferred in
    RUNNING = "running"  # admitted: holds the pages of its computed tokens
    FINISHED = "finished"  # done (see finish_reason): holds no pages, unless kept (keep_pages) until release


class FinishReason(enum.StrEnum):
    STOP = "stop"  # sampled an eos token or one of stop_token_ids (included in output_ids)
    LENGTH = "length"  # max_new_tokens reached, or the model's max positions
    ABORT = "abort"  # abort(request_id)
    ERROR = "error"  # the model step failed; `error` says why


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


class TokenLogprobs(NamedTuple):
    """One token's log-probability and the `top` most likely tokens at its position, best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def _num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and float("-inf") < float(v) < float("inf")


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each new token and when to stop.

    The logits a token is drawn from ("processed logits"), per row of a batch at once (sampling.process_logits):
    logits + logit_bias, minus presence_penalty for every token already generated and frequency_penalty times
    its count, repetition_penalty on every token of prompt + output (positive logits divided by it, negative
    ones multiplied), eos and stop_token_ids masked while fewer than min_tokens are generated, then divided by
    temperature (greedy: by 1). temperature == 0 is greedy (argmax of them; top_p/top_k/seed are ignored).
    Otherwise top_k, then top_p (nucleus), then a draw from the request's own torch.Generator seeded with
    `seed`: the same seed gives the same tokens whatever else is in the batch.

    logprobs = k (0..20) reports each generated token's log_softmax of the processed logits and the k best
    tokens; prompt_logprobs = k the same for every prompt token after the first, from the raw logits of the
    prefill pass (a request with prompt_logprobs does not reuse the prefix cache: every position is computed).
    n > 1: n sequences for one prompt (Engine.add_request), sharing the prompt's pages; choice i draws with
    seed + i.
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int | None = None
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    n: int = 1

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens = {self.max_new_tokens!r} must be an integer >= 1")
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)):
            raise ConfigError(f"temperature = {self.temperature!r} must be a number >= 0 (0 = greedy)")
        if not (0.0 <= float(self.temperature) < float("inf")):
            raise ConfigError(f"temperature = {self.temperature!r} must be a finite number >= 0 (0 = greedy)")
        object.__setattr__(self, "temperature", float(self.temperature))
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p = {self.top_p!r} must be in (0, 1] (1 = no nucleus filter)")
        object.__setattr__(self, "top_p", float(self.top_p))
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            raise ConfigError(f"top_k = {self.top_k!r} must be an integer >= 1, or None for no top-k filter")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise ConfigError(f"seed = {self.seed!r} must be an integer in [0, 2**63), or None for a random seed")
        stops = self.stop_token_ids
        if isinstance(stops, (str, bytes)) or not isinstance(stops, Sequence):
            raise ConfigError(f"stop_token_ids = {stops!r} must be a list of token ids")
        for t in stops:
            if not _is_int(t) or t < 0:
                raise ConfigError(f"stop_token_ids contains {t!r}: token ids are integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stops))
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(f"ignore_eos = {self.ignore_eos!r} must be true or false")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or not 0 <= v <= MAX_LOGPROBS):
                raise ConfigError(f"{name} = {v!r} must be an integer in [0, {MAX_LOGPROBS}], or None for none")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _num(v) or not -2.0 <= float(v) <= 2.0:
                raise ConfigError(f"{name} = {v!r} must be a number in [-2, 2] (0 = off)")
            object.__setattr__(self, name, float(v))
        rp = self.repetition_penalty
        if not _num(rp) or not 0.0 < float(rp) <= 100.0:
            raise ConfigError(f"repetition_penalty = {rp!r} must be a number in (0, 100] (1 = off)")
        object.__setattr__(self, "repetition_penalty", float(rp))
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise ConfigError(
                f"min_tokens = {self.min_tokens!r} must be an integer in [0, max_new_tokens = {self.max_new_tokens}]"
            )
        lb = self.logit_bias
        if isinstance(lb, dict):
            lb = tuple(lb.items())
        if isinstance(lb, (str, bytes)) or not isinstance(lb, Sequence):
            raise ConfigError(f"logit_bias = {lb!r} must map token ids to biases")
        pairs = []
        for item in lb:
            if not isinstance(item, Sequence) or len(item) != 2:
                raise ConfigError(f"logit_bias entry {item!r} must be a (token id, bias) pair")
            t, b = item
            if not _is_int(t) or t < 0:
                raise ConfigError(f"logit_bias has token id {t!r}: token ids are integers >= 0")
            if not _num(b) or not -100.0 <= float(b) <= 100.0:
                raise ConfigError(f"logit_bias[{t}] = {b!r} must be a number in [-100, 100]")
            pairs.append((int(t), float(b)))
        object.__setattr__(self, "logit_bias", tuple(sorted(dict(pairs).items())))
        if not _is_int(self.n) or not 1 <= self.n <= 64:
            raise ConfigError(f"n = {self.n!r} must be an integer in [1, 64] (sequences per prompt)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalised(self) -> bool:
        """True if the processed logits differ from logits / temperature (a bias, penalty or min_tokens)."""
        return bool(
            self.logit_bias
            or self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.min_tokens
        )


@dataclass(eq=False)
class Request:
    """One request. The scheduler owns status, num_computed_tokens and page_ids."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival: int = 0  # admission order key: lower is older
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # tokens reused from the prefix cache at the last admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    page_ids: list[int] = field(default_factory=list)  # pages of the sequence, in token order
    prefix_match: Any = None  # the prefix cache's match at admission, released when the request leaves
    num_preemptions: int = 0
    kv_from_peer: bool = False  # its prompt KV was written by a prefill worker (prealloc/start_decode)
    keep_pages: bool = False  # on finishing (stop/length) keep the pages held until Scheduler.release()
    sampling_seed: int = 0  # params.seed, or one the engine drew
    generator: Any = None  # torch.Generator, created by the sampler on first use
    output_logprobs: list[TokenLogprobs] = field(default_factory=list)  # one per output token, if params.logprobs
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt tokens 1.., if params.prompt_logprobs
    choice_index: int = 0  # which of the params.n sequences of its prompt
    forks: list[Request] = field(default_factory=list)  # the other n - 1 sequences, until they share its pages

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ConfigError(f"request_id = {self.request_id!r} must be a non-empty string")
        prompt = tuple(self.prompt_ids)
        if not prompt:
            raise ConfigError(f"request {self.request_id}: the prompt is empty: give at least one token id")
        for t in prompt:
            if not _is_int(t) or t < 0:
                raise ConfigError(f"request {self.request_id}: prompt token {t!r} is not a token id (an integer >= 0)")
        self.prompt_ids = tuple(int(t) for t in prompt)

    # ---- token counters --------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending_tokens(self) -> int:
        """Tokens whose KV is not in the pool yet (1 while decoding)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def in_prefill(self) -> bool:
        return self.num_pending_tokens > 1

    def token_ids(self, start: int = 0, end: int | None = None) -> list[int]:
        """Tokens [start, end) of prompt + output."""
        n = self.num_prompt_tokens
        end = self.num_tokens if end is None else end
        if end <= n:
            return list(self.prompt_ids[start:end])
        if start >= n:
            return self.output_ids[start - n : end - n]
        return list(self.prompt_ids[start:]) + self.output_ids[: end - n]

    @property
    def all_token_ids(self) -> list[int]:
        return self.token_ids()

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.error = error

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.value}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, pages={len(self.page_ids)})"
        )


@dataclass(frozen=True)
class RequestOutput:
    """What step() reports for a request: the tokens new since the last report, and all so far."""

    request_id: str
    new_token_ids: tuple[int, ...]
    output_ids: tuple[int, ...]
    finished: bool
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    new_logprobs: tuple[TokenLogprobs, ...] = ()  # of new_token_ids, when params.logprobs is set
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # prompt tokens 1..; with the first token only
    choice_index: int = 0

    @classmethod
    def of(cls, req: Request, num_new: int) -> RequestOutput:
        out = tuple(req.output_ids)
        lps = tuple(req.output_logprobs[len(out) - num_new :]) if num_new and req.output_logprobs else ()
        first = num_new and len(out) == num_new and req.params.prompt_logprobs is not None
        return cls(
            request_id=req.request_id,
            new_token_ids=out[len(out) - num_new :] if num_new else (),
            output_ids=out,
            finished=req.is_finished,
            finish_reason=req.finish_reason,
            error=req.error,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_tokens=req.num_cached_tokens,
            new_logprobs=lps,
            prompt_logprobs=tuple(req.prompt_logprobs) if first else None,
            choice_index=req.choice_index,
        )
