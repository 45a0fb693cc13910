"""OpenAI request parsing and validation: JSON body -> GenRequest, or ApiError (a 4xx with an OpenAI error body).

Accepted (completions `/v1/completions`, chat `/v1/chat/completions`):

    model            optional; must equal the served model name when given (else 404 model_not_found)
    prompt           completions: a string, a non-empty list of token ids, or a one-element list of either
    messages         chat: [{"role": system|developer|user|assistant|tool, "content": str | [{"type": "text", ...}]}]
    max_tokens       int in [1, 2**31 - 1], default 16 (chat also takes max_completion_tokens)
    temperature      number >= 0, default 1.0 (0 = greedy)
    top_p            number in (0, 1], default 1
    top_k            extension: int in [1, 2**31 - 1]; null, 0 or -1 = off
    seed             int in [0, 2**63) or null (choice i of n samples with seed + i)
    n                1..64 choices (they share the prompt's pages);  best_of: null or equal to n
    stop             null, a string or a list of up to 4 non-empty strings (matched on the output text)
    stop_token_ids   extension: list of token ids that end generation (included in the output)
    ignore_eos       extension: bool
    presence_penalty, frequency_penalty   numbers in [-2, 2];  repetition_penalty (extension): (0, 100]
    min_tokens       extension: int in [0, max_tokens] (eos and stop_token_ids masked until then)
    logit_bias       {"token id": bias in [-100, 100]}
    logprobs         completions: int 0..20 (top alternatives per token); chat: bool, with top_logprobs 0..20
    echo             completions: bool, the prompt (and with logprobs its prompt logprobs) before the text;
                     max_tokens 0 is allowed with echo (one token is generated and dropped; not streamed)
    stream           bool;  stream_options: {"include_usage": bool}
    suffix, more than one prompt, tools (chat), response_format other than text: rejected with 400.
    Other fields (e.g. `user`) are ignored.

Every integer is bounded to what the control plane's codec carries (MAX_TOKEN_ID = 2**31 - 1 for token ids,
top_k and max_tokens; disagg.messages.MAX_ID), so the router and the colocated server refuse the same bodies;
`check_model` then bounds every token id (prompt, stop_token_ids, logit_bias keys) by the model's vocabulary.

Imports the standard library, dsakv.errors and dsakv.engine.request (no torch).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

from dsakv.engine.request import MAX_LOGPROBS, SamplingParams
from dsakv.errors import ConfigError
from dsakv.serve.tokenizer import CHAT_ROLES

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 4
MAX_N = 64
MAX_TOKEN_ID = 2**31 - 1  # the largest token id (and top_k, max_tokens) the control plane carries: messages.MAX_ID


class ApiError(Exception):
    """An HTTP error with an OpenAI-style body {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or ("invalid_request_error" if 400 <= status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass(frozen=True)
class GenRequest:
    """A validated generation request. `prompt` is text, token ids, or chat messages (kind says which)."""

    kind: str  # "completion" | "chat"
    prompt_text: str | None
    prompt_ids: list[int] | None
    messages: list[dict[str, str]] | None
    params: SamplingParams
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice's text
    logprobs: int | None = None  # completions' logprobs / chat's top_logprobs (0 with logprobs: true); None: off
    echo_only: bool = False  # echo with max_tokens 0: the generated token is dropped


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad("the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise bad(f"the request body is not valid JSON: {str(e)[:200]}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _num_str(v: object) -> str:
    """repr(v), cut to 80 characters (a 4000-digit integer or a long list is not echoed back whole)."""
    try:
        big = isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 10**40
        s = f"{str(v)[:20]}... ({len(str(v).lstrip('-'))} digits)" if big else repr(v)
    except ValueError:  # an integer over Python's str conversion limit
        s = f"an integer of over {sys.get_int_max_str_digits()} digits"
    return s if len(s) <= 80 else s[:77] + "..."


def _int(body: dict[str, Any], name: str, default: int | None, *, minimum: int, maximum: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise bad(f"'{name}' = {_num_str(v)} must be an integer {rng}", name)
    return v


def _token_ids(v: Any, param: str) -> list[int] | None:
    """v as a list of token ids, None if it is not a list of ints; 400 on ids outside [0, MAX_TOKEN_ID]."""
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        if any(t < 0 for t in v):
            raise bad(f"'{param}' has negative token id(s) {[t for t in v if t < 0][:8]}: ids are >= 0", param)
        big = [t for t in v if t > MAX_TOKEN_ID]
        if big:
            raise bad(f"'{param}' has token id(s) {_show(big)} above the largest token id {MAX_TOKEN_ID}", param)
        return list(v)
    return None


def _show(ids: list[int]) -> str:
    """Up to 8 ids, each cut to 40 digits (an id of 10**4000 digits is not echoed back whole)."""
    return "[" + ", ".join(_num_str(t) for t in ids[:8]) + (", ...]" if len(ids) > 8 else "]")


def check_model(g: GenRequest, prompt_ids: list[int], vocab_size: int | None) -> None:
    """400 for a token id the model does not have: in the prompt (given or tokenized), stop_token_ids or a
    logit_bias key (ids >= vocab_size). The same check for the colocated server and the router."""
    if vocab_size is None:
        return
    top = vocab_size - 1
    p = g.params
    for ids, param in (
        (prompt_ids, "prompt" if g.kind == "completion" else "messages"),
        (list(p.stop_token_ids), "stop_token_ids"),
        ([t for t, _ in p.logit_bias], "logit_bias"),
    ):
        out = [t for t in ids if not 0 <= t < vocab_size]
        if out:
            raise bad(
                f"'{param}' has token id(s) {_show(out)} outside the model's vocabulary 0..{top}: "
                "give ids below the vocabulary size",
                param,
            )


def _reject(body: dict[str, Any], name: str, ok: Any, what: str) -> None:
    v = body.get(name)
    if v is not None and v not in ok:
        raise bad(f"'{name}' = {v!r} is not supported by this server ({what})", name, code="unsupported_parameter")


def _sampling(
    body: dict[str, Any],
    max_tokens_names: tuple[str, ...],
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    min_max_tokens: int = 1,
) -> tuple[SamplingParams, tuple[str, ...]]:
    max_tokens = DEFAULT_MAX_TOKENS
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _int(body, name, DEFAULT_MAX_TOKENS, minimum=min_max_tokens, maximum=MAX_TOKEN_ID)
            break
    max_tokens = max(max_tokens, 1)  # echo with max_tokens 0: one token is generated and dropped
    temperature = body.get("temperature")
    if temperature is None:
        temperature = DEFAULT_TEMPERATURE
    elif not _is_num(temperature) or temperature < 0:
        raise bad(f"'temperature' = {temperature!r} must be a number >= 0 (0 = greedy)", "temperature")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    elif not _is_num(top_p) or not 0 < top_p <= 1:
        raise bad(f"'top_p' = {top_p!r} must be a number in (0, 1]", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (not _is_int(top_k) or not -1 <= top_k <= MAX_TOKEN_ID):
        raise bad(
            f"'top_k' = {_num_str(top_k)} must be an integer in [1, {MAX_TOKEN_ID}] (0, -1 or null = no top-k filter)",
            "top_k",
        )
    if top_k is not None and top_k < 1:
        top_k = None
    seed = _int(body, "seed", None, minimum=0, maximum=2**63 - 1)
    n = _int(body, "n", 1, minimum=1, maximum=MAX_N)
    best_of = _int(body, "best_of", None, minimum=1, maximum=MAX_N)
    if best_of is not None and best_of != n:
        raise bad(
            f"'best_of' = {best_of} is not supported unless it equals n = {n} (every choice is returned)",
            "best_of",
            code="unsupported_parameter",
        )
    pens = {}
    for pen in ("presence_penalty", "frequency_penalty"):
        v = body.get(pen)
        if v is not None and (not _is_num(v) or not -2 <= v <= 2):
            raise bad(f"'{pen}' = {v!r} must be a number in [-2, 2]", pen)
        pens[pen] = float(v or 0.0)
    rp = body.get("repetition_penalty")
    if rp is not None and (not _is_num(rp) or not 0 < rp <= 100):
        raise bad(f"'repetition_penalty' = {rp!r} must be a number in (0, 100] (1 = off)", "repetition_penalty")
    min_tokens = _int(body, "min_tokens", 0, minimum=0, maximum=max_tokens)
    lb = body.get("logit_bias")
    bias: dict[int, float] = {}
    if lb is not None:
        if not isinstance(lb, dict):
            raise bad(f"'logit_bias' = {lb!r} must be an object mapping token ids to biases", "logit_bias")
        for k, v in lb.items():
            try:
                t = int(k)
            except (TypeError, ValueError):
                t = -1
            if t < 0 or str(t) != str(k).strip():
                raise bad(f"'logit_bias' key {k[:40]!r} must be a token id (a non-negative integer)", "logit_bias")
            if t > MAX_TOKEN_ID:
                raise bad(f"'logit_bias' key {_num_str(t)} is above the largest token id {MAX_TOKEN_ID}", "logit_bias")
            if not _is_num(v) or not -100 <= v <= 100:
                raise bad(f"'logit_bias[{k}]' = {v!r} must be a number in [-100, 100]", "logit_bias")
            bias[t] = float(v)
    stop = body.get("stop")
    if stop is None:
        stops: tuple[str, ...] = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        if len(stop) > MAX_STOP_STRINGS:
            raise bad(f"'stop' has {len(stop)} strings: give at most {MAX_STOP_STRINGS}", "stop")
        stops = tuple(s for s in stop if s)
    else:
        raise bad(f"'stop' = {stop!r} must be a string or a list of strings", "stop")
    stop_ids = body.get("stop_token_ids")
    if stop_ids is None:
        stop_ids = []
    elif not isinstance(stop_ids, list) or not all(_is_int(t) and 0 <= t <= MAX_TOKEN_ID for t in stop_ids):
        raise bad(
            f"'stop_token_ids' = {_num_str(stop_ids)} must be a list of token ids (integers in [0, {MAX_TOKEN_ID}])",
            "stop_token_ids",
        )
    ignore_eos = body.get("ignore_eos", False)
    if not isinstance(ignore_eos, bool):
        raise bad(f"'ignore_eos' = {ignore_eos!r} must be true or false", "ignore_eos")
    try:
        params = SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=seed,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=ignore_eos,
            presence_penalty=pens["presence_penalty"],
            frequency_penalty=pens["frequency_penalty"],
            repetition_penalty=float(rp) if rp is not None else 1.0,
            min_tokens=min_tokens,
            logit_bias=tuple(bias.items()),
            n=n,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except ConfigError as e:
        raise bad(str(e)) from None
    return params, stops


def _stream(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad(f"'stream' = {stream!r} must be true or false", "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad(
                f"'stream_options' = {opts!r} must be an object like {{\"include_usage\": true}}", "stream_options"
            )
        if not stream:
            raise bad("'stream_options' is only allowed with \"stream\": true", "stream_options")
        include_usage = opts.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise bad(f"'stream_options.include_usage' = {include_usage!r} must be true or false", "stream_options")
    return stream, include_usage


def _model(body: dict[str, Any]) -> str | None:
    m = body.get("model")
    if m is not None and not isinstance(m, str):
        raise bad(f"'model' = {m!r} must be a string", "model")
    return m


def parse_completion(body: dict[str, Any]) -> GenRequest:
    if "prompt" not in body or body["prompt"] is None:
        raise bad("'prompt' is required: a string or a list of token ids", "prompt", code="missing_required_parameter")
    p = body["prompt"]
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # a batch of one
    text: str | None = None
    ids: list[int] | None = None
    if isinstance(p, str):
        if not p:
            raise bad("'prompt' is empty: give at least one character or token id", "prompt")
        text = p
    else:
        ids = _token_ids(p, "prompt")
        if ids is None:
            if isinstance(p, list) and not p:
                raise bad("'prompt' is empty: give at least one character or token id", "prompt")
            if isinstance(p, list) and all(isinstance(x, (str, list)) for x in p):
                raise bad(f"'prompt' holds {len(p)} prompts: this server takes one prompt per request", "prompt")
            raise bad(
                f"'prompt' must be a string or a list of token ids (integers), got {json.dumps(p)[:80]}", "prompt"
            )
    _reject(body, "suffix", ("",), "suffix")
    echo = body.get("echo", False)
    if echo is None:
        echo = False
    if not isinstance(echo, bool):
        raise bad(f"'echo' = {echo!r} must be true or false", "echo")
    lp = _int(body, "logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    zero = body.get("max_tokens") == 0
    if zero and not echo:
        raise bad("'max_tokens' = 0 must be an integer >= 1 (0 only with \"echo\": true)", "max_tokens")
    if zero and body.get("stream"):
        raise bad("'max_tokens' = 0 (echo only) cannot be streamed", "max_tokens")
    params, stops = _sampling(
        body, ("max_tokens",), lp, lp if echo and lp is not None else None, min_max_tokens=0 if echo else 1
    )
    stream, include_usage = _stream(body)
    return GenRequest(
        "completion",
        text,
        ids,
        None,
        params,
        stops,
        stream,
        include_usage,
        _model(body),
        echo=echo,
        logprobs=lp,
        echo_only=zero,
    )


def _content(m: dict[str, Any], i: int) -> str:
    c = m.get("content")
    if c is None:
        if m.get("role") == "assistant":
            return ""
        raise bad(f"'messages[{i}].content' is required", f"messages[{i}].content", code="missing_required_parameter")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        parts = []
        for j, part in enumerate(c):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(
                    f'\'messages[{i}].content[{j}]\' must be {{"type": "text", "text": "..."}}: only text '
                    "content is supported",
                    f"messages[{i}].content",
                )
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"'messages[{i}].content' must be a string or a list of text parts", f"messages[{i}].content")


def parse_chat(body: dict[str, Any]) -> GenRequest:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required: a list of {role, content}", "messages", code="missing_required_parameter")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {role, content} objects", "messages")
    out: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"'messages[{i}]' must be an object with 'role' and 'content'", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"'messages[{i}].role' = {role!r} must be one of {', '.join(CHAT_ROLES)}", f"messages[{i}].role")
        out.append({"role": role, "content": _content(m, i)})
    want = body.get("logprobs", False)
    if want is None:
        want = False
    if not isinstance(want, bool):
        raise bad(f"'logprobs' = {want!r} must be true or false (chat; top_logprobs gives the count)", "logprobs")
    top = _int(body, "top_logprobs", None, minimum=0, maximum=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
    if body.get("tools"):
        raise bad("'tools' is not supported by this server", "tools", code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise bad('\'response_format\' other than {"type": "text"} is not supported', "response_format")
    lp = (top or 0) if want else None
    params, stops = _sampling(body, ("max_completion_tokens", "max_tokens"), lp)
    stream, include_usage = _stream(body)
    return GenRequest("chat", None, None, out, params, stops, stream, include_usage, _model(body), logprobs=lp)


__all__ = [
    "ApiError",
    "DEFAULT_MAX_TOKENS",
    "MAX_TOKEN_ID",
    "GenRequest",
    "bad",
    "check_model",
    "parse_chat",
    "parse_completion",
    "parse_json",
]
