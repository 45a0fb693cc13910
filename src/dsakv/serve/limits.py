"""HTTP limits of the API server: request sizes, nesting depth, text encoding, timeouts, a connection cap, and
a count of every response by status (5xx included) for /metrics.

    limits = HttpLimits(max_request_bytes=16 * 2**20)       # frozen, validated
    guard = HttpGuard(limits)                               # create_app installs one (app.state.http_guard)
    app.add_middleware(LimitsMiddleware, guard=guard)       # body size / body timeout / status counts
    uvicorn.Config(app, **uvicorn_settings(guard))          # head timeout, keep-alive, connection cap

Where each limit is enforced:

    what                           where                          answer
    Content-Length > max bytes     middleware, before the body    413 request_too_large (body never read)
    streamed body > max bytes      middleware, while reading      413 request_too_large (reading stops)
    body not complete in time      middleware, while reading      408 request_timeout
    JSON nested deeper than max    parse_json_body, before json   400 invalid_json
    lone UTF-16 surrogate          parse_json_body, after json    400 invalid_encoding (param: the field)
    request head not complete      protocol (h11), per request    connection closed after header_timeout
    idle keep-alive connection     uvicorn timeout_keep_alive     connection closed
    request head > max header      h11 max incomplete event size  400 (uvicorn)
    connections > max              protocol, at accept            503 too_many_connections, closed

Every response passes the middleware, which counts it by status; an exception that escapes the app is
counted as a 500 (its body is the app's OpenAI-style error). Imports uvicorn/h11/anyio, the standard library
and dsakv.serve.protocol / dsakv.errors; must not import torch, the engine or disagg.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import threading
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

import anyio

from dsakv.errors import ConfigError
from dsakv.serve.protocol import ApiError, bad, parse_json

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
MAX_JSON_DEPTH = 512


BODY_GRACE_S = 0.02  # after the body deadline: take what already arrived, wait no longer


@dataclass(frozen=True)
class HttpLimits:
    """Bounds on what one client can make the server hold or wait for (module docstring)."""

    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_json_depth: int = 64
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive_timeout: float = 5.0
    max_connections: int = 1024
    max_header_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        for name, flag, lo, hi in (
            ("max_request_bytes", "--max-request-bytes", 64, 2**40),
            # Python's JSON parser recurses once per level: deeper than ~900 is a RecursionError, never a body
            ("max_json_depth", "--max-json-depth", 2, MAX_JSON_DEPTH),
            ("max_connections", "--max-connections", 1, 1 << 20),
            ("max_header_bytes", "--max-header-bytes", 1024, 2**30),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{flag} {v!r} must be an integer >= {lo}")
            if v > hi:
                raise ConfigError(f"{flag} {v!r} must be at most {hi}")
        for name, flag in (
            ("header_timeout", "--http-header-timeout"),
            ("body_timeout", "--http-body-timeout"),
            ("keep_alive_timeout", "--keep-alive-timeout"),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{flag} {v!r} must be a finite number of seconds > 0")
            if v > 86400:
                raise ConfigError(f"{flag} {v!r} must be at most 86400 seconds (a day)")


class HttpGuard:
    """The limits in force and the counters they feed (thread-safe). One per app."""

    def __init__(self, limits: HttpLimits | None = None) -> None:
        self.limits = limits or HttpLimits()
        self._lock = threading.Lock()
        self.responses: dict[int, int] = {}  # status -> responses sent
        self.refused_connections = 0  # over max_connections
        self.head_timeouts = 0  # connections closed with an incomplete request head
        self.body_timeouts = 0  # 408s

    def count(self, status: int) -> None:
        with self._lock:
            self.responses[status] = self.responses.get(status, 0) + 1

    def bump(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def server_errors(self) -> int:
        with self._lock:
            return sum(n for s, n in self.responses.items() if s >= 500)

    def render(self) -> str:
        with self._lock:
            lines = [
                "# HELP dsakv_http_responses_total HTTP responses sent, by status code.",
                "# TYPE dsakv_http_responses_total counter",
            ]
            lines += [f'dsakv_http_responses_total{{code="{s}"}} {n}' for s, n in sorted(self.responses.items())]
            lines += [
                "# HELP dsakv_http_server_errors_total HTTP responses with a 5xx status.",
                "# TYPE dsakv_http_server_errors_total counter",
                f"dsakv_http_server_errors_total {sum(n for s, n in self.responses.items() if s >= 500)}",
            ]
            for name, help_text, v in (
                ("connections_refused", "Connections refused over --max-connections.", self.refused_connections),
                ("header_timeouts", "Connections closed: request head incomplete in time.", self.head_timeouts),
                ("body_timeouts", "Requests answered 408: body incomplete in time.", self.body_timeouts),
            ):
                n = f"dsakv_http_{name}_total"
                lines += [f"# HELP {n} {help_text}", f"# TYPE {n} counter", f"{n} {v}"]
        return "\n".join(lines) + "\n"


# ---- the JSON body ------------------------------------------------------------------------------------

_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)


def json_depth_exceeds(raw: bytes, max_depth: int) -> bool:
    """True when arrays/objects in `raw` nest deeper than max_depth (strings skipped; raw need not be valid)."""
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    depth = 0
    for m in _JSON_TOKEN.finditer(raw):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > max_depth:
                return True
        elif c in (b"]", b"}"):
            depth -= 1
    return False


def _path(parent: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{parent}[{key}]"
    return f"{parent}.{key}" if parent else key


def find_lone_surrogate(obj: Any) -> str | None:
    """The path (e.g. `messages[0].content`) of the first string or key holding a lone UTF-16 surrogate
    (valid JSON via a \\ud800 escape, but not encodable text), else None. Iterative: no recursion limit."""
    stack: list[tuple[str, Any]] = [("", obj)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "(body)"
        elif isinstance(v, dict):
            for k, x in v.items():
                p = _path(path, k)
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return p
                stack.append((p, x))
        elif isinstance(v, list):
            stack.extend((_path(path, i), x) for i, x in enumerate(v))
    return None


def parse_json_body(raw: bytes, limits: HttpLimits) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 naming what is wrong (depth, JSON, encoding)."""
    if json_depth_exceeds(raw, limits.max_json_depth):
        raise bad(
            f"the request body nests arrays/objects deeper than {limits.max_json_depth} levels: flatten it",
            code="invalid_json",
        )
    try:
        body = parse_json(raw)
    except RecursionError:
        raise bad("the request body nests too deeply to parse", code="invalid_json") from None
    where = find_lone_surrogate(body)
    if where is not None:
        raise bad(
            f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text: "
            "send valid Unicode",
            param=where if where != "(body)" else None,
            code="invalid_encoding",
        )
    return body


# ---- ASGI middleware: body size, body timeout, status counts --------------------------------------------


class _BodyTimeout(Exception):
    pass


def _error_response(err: ApiError) -> tuple[Message, Message]:
    body = json.dumps(err.body()).encode()
    start = {
        "type": "http.response.start",
        "status": err.status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ],
    }
    return start, {"type": "http.response.body", "body": body, "more_body": False}


def _too_large(limit: int, got: str) -> ApiError:
    return ApiError(
        413,
        f"the request body is {got} bytes, over this server's limit of {limit} bytes "
        "(--max-request-bytes): send a smaller request",
        code="request_too_large",
    )


class LimitsMiddleware:
    """Pure ASGI middleware (no body buffering of its own); see the module docstring."""

    def __init__(self, app: Any, guard: HttpGuard) -> None:
        self.app = app
        self.guard = guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limits = self.guard.limits
        status: list[int] = []

        async def counted_send(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status.append(int(msg["status"]))
                self.guard.count(int(msg["status"]))
            await send(msg)

        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                n = -1
            if n < 0:
                err = bad(f"Content-Length {length[:40]!r} is not a byte count", code="invalid_request")
                for m in _error_response(err):
                    await counted_send(m)
                return
            if n > limits.max_request_bytes:
                for m in _error_response(_too_large(limits.max_request_bytes, str(n))):
                    await counted_send(m)
                return

        received = 0
        body_done = False
        deadline: float | None = None

        async def limited_receive() -> Message:
            nonlocal received, body_done, deadline
            if body_done:
                return await receive()
            if deadline is None:
                deadline = anyio.current_time() + limits.body_timeout
            msg: Message | None = None
            with anyio.move_on_after(max(0.0, deadline - anyio.current_time())):
                msg = await receive()
            if msg is None:
                # The deadline passed, but a loop woken late (a starved process) may fire it after the body
                # arrived: what is already buffered is taken; only a body that is truly missing is a 408.
                with anyio.move_on_after(BODY_GRACE_S):
                    msg = await receive()
                if msg is None:
                    raise _BodyTimeout
            if msg["type"] == "http.request":
                received += len(msg.get("body", b""))
                if received > limits.max_request_bytes:
                    raise _too_large(limits.max_request_bytes, f"more than {limits.max_request_bytes}")
                body_done = not msg.get("more_body", False)
            else:
                body_done = True
            return msg

        try:
            await self.app(scope, limited_receive, counted_send)
        except _BodyTimeout:
            self.guard.bump("body_timeouts")
            if not status:
                err = ApiError(
                    408,
                    f"the request body did not arrive within {limits.body_timeout:g} s (--http-body-timeout)",
                    code="request_timeout",
                )
                for m in _error_response(err):
                    await counted_send(m)
        except Exception:
            if not status:  # the app's error handler answers it (a 500 with an OpenAI-style body)
                self.guard.count(500)
            raise


# ---- uvicorn: head timeout, keep-alive, connection cap ------------------------------------------------


def _guarded_protocol(guard: HttpGuard) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a per-request head deadline and a cap on open connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limits = guard.limits
    refusal = json.dumps(
        ApiError(
            503,
            f"this server holds its maximum of {limits.max_connections} connections (--max-connections): retry later",
            code="too_many_connections",
        ).body()
    ).encode()

    class GuardedH11Protocol(H11Protocol):
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > limits.max_connections:
                guard.bump("refused_connections")
                guard.count(503)
                transport.write(
                    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                    + f"content-length: {len(refusal)}\r\nconnection: close\r\n\r\n".encode()
                    + refusal
                )
                transport.close()
                return
            self._arm_head()

        def _arm_head(self) -> None:
            self._disarm_head()
            self._head_timer = self.loop.call_later(limits.header_timeout, self._head_timeout)

        def _disarm_head(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self.cycle is None or self.cycle.response_complete:  # still waiting for a complete head
                guard.bump("head_timeouts")
                self.transport.close()

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a complete request head arrived
                self._disarm_head()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and self.conn.our_state is not h11.MUST_CLOSE:
                # the next head has keep-alive + header_timeout (idle connections are closed at keep-alive)
                self._head_timer = self.loop.call_later(
                    limits.keep_alive_timeout + limits.header_timeout, self._head_timeout
                )

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm_head()
            super().connection_lost(exc)

    return GuardedH11Protocol


def uvicorn_settings(guard: HttpGuard) -> dict[str, Any]:
    """uvicorn.Config keyword arguments that enforce guard.limits at the protocol level."""
    limits = guard.limits
    return {
        "http": _guarded_protocol(guard),
        "timeout_keep_alive": limits.keep_alive_timeout,
        "h11_max_incomplete_event_size": limits.max_header_bytes,
    }


__all__ = [
    "DEFAULT_MAX_REQUEST_BYTES",
    "HttpGuard",
    "HttpLimits",
    "LimitsMiddleware",
    "find_lone_surrogate",
    "json_depth_exceeds",
    "parse_json_body",
    "uvicorn_settings",
]
