"""The OpenAI-compatible HTTP app over a GenerationBackend.

    app = create_app(EngineBackend(engine), "tiny")          # uvicorn.run(app, host="127.0.0.1", port=8000)

Routes:
    POST /v1/completions          prompt: text or token ids   -> choices[0].text, choices[0].token_ids (extension)
    POST /v1/chat/completions     messages                    -> choices[0].message.content, choices[0].token_ids
         "stream": true gives SSE chunks `data: {...}` ending with `data: [DONE]`; errors after the first byte
         come as one `data: {"error": {...}}` chunk before [DONE].
    GET  /v1/models               the served model
    GET  /health                  backend.health(): 200 when ok, else 503
    GET  /metrics                 Prometheus text: request counters, TTFT/TPOT/e2e histograms, backend gauges

Bad input is a 4xx with {"error": {"message", "type", "param", "code"}}, never a 500: 400 for malformed JSON,
fields or sampling values (protocol.py), 404 for another model name, 413 when the prompt (or prompt +
max_tokens) can never fit the KV pool; HTTP limits (serve/limits.py: body size 413, body timeout 408, nesting
depth and lone surrogates 400, head/keep-alive timeouts, connection cap 503) sit in a middleware and the uvicorn
protocol; an unexpected exception is a 500 with the same error body, and every status is counted in /metrics.
The request is aborted, and its pages freed, when the client disconnects.
Responses also carry `prompt_token_ids` (extension). One log line per request: id, prompt/output tokens, TTFT,
finish reason. Imports fastapi/anyio, dsakv.serve.* and dsakv.errors; must not import torch, engine internals,
disagg or cli.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from dsakv.errors import CapacityError, DsakvError
from dsakv.serve.backend import GenerationBackend, TokenEvent
from dsakv.serve.limits import HttpGuard, HttpLimits, LimitsMiddleware, parse_json_body
from dsakv.serve.metrics import ServerMetrics
from dsakv.serve.protocol import ApiError, GenRequest, parse_chat, parse_completion
from dsakv.serve.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds without any event from the backend before a request fails
_END = object()


@dataclass
class _Generation:
    """One request's run: consumes backend events, detokenizes, applies stop strings, times it."""

    rid: str
    g: GenRequest
    prompt_ids: list[int]
    t0: float
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    t_first: float | None = None
    t_last: float | None = None

    @property
    def usage(self) -> dict[str, int]:
        n, m = len(self.prompt_ids), len(self.ids)
        return {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m}


class _Server:
    def __init__(
        self, backend: GenerationBackend, model_name: str, tokenizer: Tokenizer, timeout: float, guard: HttpGuard
    ) -> None:
        self.backend = backend
        self.guard = guard
        self.model_name = model_name
        self.tokenizer = tokenizer
        self.timeout = timeout
        self.metrics = ServerMetrics()
        self.limiter = anyio.CapacityLimiter(1024)  # threads parked on backend.events()
        self.created = int(time.time())

    async def call(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    # ---- admission ------------------------------------------------------------------

    async def admit(self, request: Request, kind: str) -> _Generation:
        t0 = time.perf_counter()
        self.metrics.received()
        try:
            body = parse_json_body(await request.body(), self.guard.limits)
            g = parse_completion(body) if kind == "completion" else parse_chat(body)
            if g.model is not None and g.model != self.model_name:
                raise ApiError(
                    404,
                    f"model {g.model!r} is not served here: this server serves {self.model_name!r} (see /v1/models)",
                    param="model",
                    code="model_not_found",
                )
            if g.prompt_ids is not None:
                prompt_ids = g.prompt_ids
            elif g.prompt_text is not None:
                prompt_ids = self.tokenizer.encode(g.prompt_text)
            else:
                assert g.messages is not None
                prompt_ids = self.tokenizer.render_chat(g.messages)
            if not prompt_ids:
                raise ApiError(400, "the prompt encodes to no tokens: give a non-empty prompt", param="prompt")
            limit = await self.call(self.backend.max_prompt_tokens)
            param = "prompt" if kind == "completion" else "messages"
            if len(prompt_ids) > limit:
                raise ApiError(
                    413,
                    f"the prompt has {len(prompt_ids)} tokens but this server takes at most {limit} prompt tokens "
                    f"(KV pool capacity minus one new token): shorten the prompt",
                    param=param,
                    code="context_length_exceeded",
                )
            rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
            try:
                await self.call(self.backend.submit, rid, prompt_ids, g.params)
            except CapacityError as e:
                raise ApiError(413, str(e), param="max_tokens", code="context_length_exceeded") from None
            except DsakvError as e:
                raise ApiError(400, str(e), code="invalid_value") from None
        except ApiError:
            self.metrics.rejected()
            raise
        self.metrics.started(len(prompt_ids))
        return _Generation(rid, g, prompt_ids, t0)

    # ---- running ----------------------------------------------------------------------

    async def _watch_disconnect(self, request: Request, gen: _Generation) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                if gen.finish_reason is None:
                    log.info("request %s: client disconnected, aborting", gen.rid)
                    await self.call(self.backend.abort, gen.rid)
                return

    async def run(self, request: Request, gen: _Generation) -> AsyncGenerator[tuple[str, list[int]], None]:
        """(text delta, new token ids) pieces until gen.finish_reason is set."""
        stops = gen.g.stop
        hold = max((len(s) for s in stops), default=1) - 1
        detok = self.tokenizer.detokenizer()
        pending = ""
        watcher = asyncio.create_task(self._watch_disconnect(request, gen))
        it = self.backend.events(gen.rid, self.timeout)
        try:
            while gen.finish_reason is None:
                try:
                    got = await anyio.to_thread.run_sync(next, it, _END, limiter=self.limiter, abandon_on_cancel=True)
                except TimeoutError as e:
                    gen.finish_reason, gen.error = "timeout", str(e)
                    break
                if got is _END:
                    gen.finish_reason, gen.error = "error", "the backend ended the request without a final event"
                    break
                ev = cast(TokenEvent, got)
                now = time.perf_counter()
                new = list(ev.new_token_ids)
                if new:
                    gen.t_first = gen.t_first or now
                    gen.t_last = now
                    gen.ids.extend(new)
                    self.metrics.tokens(len(new))
                pending += detok.feed(new)
                if ev.finished:
                    pending += detok.flush()
                cut = min((i for i in (pending.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    pending = pending[:cut]
                    gen.finish_reason = "stop"
                    await self.call(self.backend.abort, gen.rid)
                elif ev.finished:
                    gen.finish_reason, gen.error = ev.finish_reason or "stop", ev.error
                out = pending if gen.finish_reason is not None or not hold else pending[: max(len(pending) - hold, 0)]
                pending = pending[len(out) :]
                gen.text += out
                if out or new:
                    yield out, new
        finally:
            watcher.cancel()
            if gen.finish_reason is None:  # cancelled (client gone) or failed: free the request's pages
                gen.finish_reason = "abort"
                with anyio.CancelScope(shield=True):
                    await self.call(self.backend.abort, gen.rid)
            self._log_done(gen)

    def _log_done(self, gen: _Generation) -> None:
        end = time.perf_counter()
        ttft = gen.t_first - gen.t0 if gen.t_first is not None else None
        n = len(gen.ids)
        tpot = (gen.t_last - gen.t_first) / (n - 1) if n > 1 and gen.t_last and gen.t_first else None
        self.metrics.done(gen.finish_reason or "abort", ttft, tpot, end - gen.t0)
        log.info(
            "request %s: prompt=%d output=%d ttft=%s e2e=%.3fs finish=%s%s",
            gen.rid,
            len(gen.prompt_ids),
            n,
            f"{ttft:.3f}s" if ttft is not None else "-",
            end - gen.t0,
            gen.finish_reason,
            f" error={gen.error}" if gen.error else "",
        )

    # ---- responses ----------------------------------------------------------------------

    def _choice(self, gen: _Generation, text: str, ids: list[int], finish: str | None, final: bool) -> dict:
        c: dict[str, Any] = {"index": 0}
        if gen.g.kind == "completion":
            c["text"] = text
        elif final and not gen.g.stream:
            c["message"] = {"role": "assistant", "content": text}
        else:
            c["delta"] = {"content": text} if text or finish is None else {}
        c["logprobs"] = None
        c["finish_reason"] = finish
        c["token_ids"] = ids
        return c

    def _envelope(self, gen: _Generation, choices: list[dict], chunk: bool) -> dict[str, Any]:
        obj = (
            "text_completion"
            if gen.g.kind == "completion"
            else ("chat.completion.chunk" if chunk else "chat.completion")
        )
        return {"id": gen.rid, "object": obj, "created": int(time.time()), "model": self.model_name, "choices": choices}

    def _error_of(self, gen: _Generation) -> ApiError | None:
        if gen.finish_reason == "timeout":
            return ApiError(504, gen.error or "timed out", code="timeout")
        if gen.finish_reason == "error":
            return ApiError(500, f"generation failed: {gen.error}", code="generation_failed")
        return None

    async def complete(self, request: Request, gen: _Generation) -> JSONResponse:
        async with contextlib.aclosing(self.run(request, gen)) as pieces:
            async for _ in pieces:
                pass
        err = self._error_of(gen)
        if err is not None:
            raise err
        body = self._envelope(gen, [self._choice(gen, gen.text, gen.ids, gen.finish_reason, True)], False)
        body["usage"] = gen.usage
        body["prompt_token_ids"] = gen.prompt_ids
        return JSONResponse(body)

    async def stream(self, request: Request, gen: _Generation) -> AsyncIterator[bytes]:
        """SSE chunks; the chunk that ends the request carries finish_reason (an empty one if no text came)."""

        def sse(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        def chunk(text: str, ids: list[int], finish: str | None) -> dict[str, Any]:
            return self._envelope(gen, [self._choice(gen, text, ids, finish, False)], True)

        first = True
        if gen.g.kind == "chat":  # OpenAI's first chat chunk: the role
            head = chunk("", [], None)
            head["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            head["prompt_token_ids"], first = gen.prompt_ids, False
            yield sse(head)
        finish_sent = False
        async with contextlib.aclosing(self.run(request, gen)) as pieces:
            async for text, ids in pieces:
                finish = gen.finish_reason if gen.finish_reason not in ("error", "timeout") else None
                c = chunk(text, ids, finish)
                if first:
                    c["prompt_token_ids"], first = gen.prompt_ids, False
                finish_sent = finish is not None
                yield sse(c)
        err = self._error_of(gen)
        if err is not None:
            yield sse(err.body())
        else:
            if not finish_sent:
                yield sse(chunk("", [], gen.finish_reason))
            if gen.g.include_usage:
                tail = self._envelope(gen, [], True)
                tail["usage"] = gen.usage
                yield sse(tail)
        yield b"data: [DONE]\n\n"


def create_app(
    backend: GenerationBackend,
    model_name: str,
    tokenizer: Tokenizer | None = None,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    manage_backend: bool = True,
    limits: HttpLimits | None = None,
) -> FastAPI:
    """The app; with manage_backend it starts the backend at startup and stops it at shutdown. `limits` (HTTP
    limits, serve/limits.py) may be replaced before startup via app.state.http_guard.limits."""
    guard = HttpGuard(limits)
    srv = _Server(backend, model_name, tokenizer or ByteTokenizer(), request_timeout, guard)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if manage_backend:
            await anyio.to_thread.run_sync(backend.start)
        try:
            yield
        finally:
            if manage_backend:
                await anyio.to_thread.run_sync(backend.stop)

    app = FastAPI(title="dsakv", version="0.1.0", lifespan=lifespan)
    app.state.server = srv
    app.state.http_guard = guard
    app.add_middleware(LimitsMiddleware, guard=guard)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        err = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", code=code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:  # logged with its traceback
        err = ApiError(500, f"internal error: {type(exc).__name__}: {str(exc)[:200]}", code="internal_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health() -> JSONResponse:
        h = await srv.call(backend.health)
        return JSONResponse(h, status_code=200 if h.get("ok") else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        m = await srv.call(backend.metrics)
        text = srv.metrics.render(m, backend.name) + guard.render()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        limit = await srv.call(backend.max_prompt_tokens)
        card = {
            "id": model_name,
            "object": "model",
            "created": srv.created,
            "owned_by": "dsakv",
            "max_model_len": limit + 1,
            "backend": backend.name,
            "tokenizer": srv.tokenizer.name,
        }
        return {"object": "list", "data": [card]}

    async def generate(request: Request, kind: str) -> Response:
        gen = await srv.admit(request, kind)
        if gen.g.stream:
            return StreamingResponse(
                srv.stream(request, gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        return await srv.complete(request, gen)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    return app


__all__ = ["DEFAULT_REQUEST_TIMEOUT", "create_app"]
