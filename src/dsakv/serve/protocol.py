"""OpenAI request parsing and validation: JSON body -> GenRequest, or ApiError (a 4xx with an OpenAI error body).

Accepted (completions `/v1/completions`, chat `/v1/chat/completions`):

    model            optional; must equal the served model name when given (else 404 model_not_found)
    prompt           completions: a string, a non-empty list of token ids, or a one-element list of either
    messages         chat: [{"role": system|developer|user|assistant|tool, "content": str | [{"type": "text", ...}]}]
    max_tokens       int >= 1, default 16 (chat also takes max_completion_tokens)
    temperature      number >= 0, default 1.0 (0 = greedy)
    top_p            number in (0, 1], default 1
    top_k            extension: int >= 1; null, 0 or -1 = off
    seed             int in [0, 2**63) or null
    n                1 only;  best_of: null or 1
    stop             null, a string or a list of up to 4 non-empty strings (matched on the output text)
    stop_token_ids   extension: list of token ids that end generation (included in the output)
    ignore_eos       extension: bool
    stream           bool;  stream_options: {"include_usage": bool}
    echo, suffix, logprobs (completions) / logprobs, top_logprobs, tools (chat), presence/frequency_penalty != 0,
    logit_bias: rejected with 400 (unsupported). Other fields (e.g. `user`) are ignored.

Imports the standard library, dsakv.errors and dsakv.engine.request (no torch).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.serve.tokenizer import CHAT_ROLES

DEFAULT_MAX_TOKENS = 16
DEFAULT_TEMPERATURE = 1.0
MAX_STOP_STRINGS = 4


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


def parse_json(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        raise bad("the request body is empty: send a JSON object", code="invalid_json")
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(body: dict[str, Any], name: str, default: int | None, *, minimum: int, maximum: int | None = None) -> Any:
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v) or v < minimum or (maximum is not None and v > maximum):
        rng = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise bad(f"'{name}' = {v!r} must be an integer {rng}", name)
    return v


def _token_ids(v: Any, param: str) -> list[int] | None:
    """v as a list of token ids, None if it is not a list of ints; 400 on negative ids."""
    if isinstance(v, list) and v and all(_is_int(t) for t in v):
        if any(t < 0 for t in v):
            raise bad(f"'{param}' has negative token id(s) {[t for t in v if t < 0][:8]}: ids are >= 0", param)
        return list(v)
    return None


def _reject(body: dict[str, Any], name: str, ok: Any, what: str) -> None:
    v = body.get(name)
    if v is not None and v not in ok:
        raise bad(f"'{name}' = {v!r} is not supported by this server ({what})", name, code="unsupported_parameter")


def _sampling(body: dict[str, Any], max_tokens_names: tuple[str, ...]) -> tuple[SamplingParams, tuple[str, ...]]:
    max_tokens = DEFAULT_MAX_TOKENS
    for name in max_tokens_names:
        if body.get(name) is not None:
            max_tokens = _int(body, name, DEFAULT_MAX_TOKENS, minimum=1)
            break
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
    if top_k is not None and (not _is_int(top_k) or top_k < -1):
        raise bad(f"'top_k' = {top_k!r} must be an integer >= 1 (0, -1 or null = no top-k filter)", "top_k")
    if top_k is not None and top_k < 1:
        top_k = None
    seed = _int(body, "seed", None, minimum=0, maximum=2**63 - 1)
    n = _int(body, "n", 1, minimum=1)
    if n != 1:
        raise bad(f"'n' = {n} is not supported: this server returns one choice per request (n = 1)", "n")
    best_of = _int(body, "best_of", 1, minimum=1)
    if best_of != 1:
        raise bad(f"'best_of' = {best_of} is not supported (only 1)", "best_of", code="unsupported_parameter")
    for pen in ("presence_penalty", "frequency_penalty"):
        v = body.get(pen)
        if v is not None and (not _is_num(v) or not -2 <= v <= 2):
            raise bad(f"'{pen}' = {v!r} must be a number in [-2, 2]", pen)
        if v:
            raise bad(f"'{pen}' = {v!r} is not supported (only 0)", pen, code="unsupported_parameter")
    lb = body.get("logit_bias")
    if lb not in (None, {}):
        raise bad("'logit_bias' is not supported by this server", "logit_bias", code="unsupported_parameter")
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
    elif not isinstance(stop_ids, list) or not all(_is_int(t) and t >= 0 for t in stop_ids):
        raise bad(f"'stop_token_ids' = {stop_ids!r} must be a list of token ids (integers >= 0)", "stop_token_ids")
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
    _reject(body, "echo", (False,), "echo of the prompt")
    _reject(body, "suffix", ("",), "suffix")
    _reject(body, "logprobs", (0,), "logprobs")
    params, stops = _sampling(body, ("max_tokens",))
    stream, include_usage = _stream(body)
    return GenRequest("completion", text, ids, None, params, stops, stream, include_usage, _model(body))


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
    _reject(body, "logprobs", (False,), "logprobs")
    _reject(body, "top_logprobs", (0,), "logprobs")
    if body.get("tools"):
        raise bad("'tools' is not supported by this server", "tools", code="unsupported_parameter")
    rf = body.get("response_format")
    if rf is not None and rf != {"type": "text"}:
        raise bad('\'response_format\' other than {"type": "text"} is not supported', "response_format")
    params, stops = _sampling(body, ("max_completion_tokens", "max_tokens"))
    stream, include_usage = _stream(body)
    return GenRequest("chat", None, None, out, params, stops, stream, include_usage, _model(body))


__all__ = ["ApiError", "DEFAULT_MAX_TOKENS", "GenRequest", "bad", "parse_chat", "parse_completion", "parse_json"]
