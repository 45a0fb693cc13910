"""The OpenAI-compatible HTTP app over a GenerationBackend.

    app = create_app(EngineBackend(engine), "tiny")          # uvicorn.run(app, host="127.0.0.1", port=8000)

Routes:
    POST /v1/completions          prompt: text or token ids   -> choices[i].text, choices[i].token_ids (extension)
    POST /v1/chat/completions     messages                    -> choices[i].message.content, choices[i].token_ids
         "stream": true gives SSE chunks `data: {...}` ending with `data: [DONE]` (each chunk holds one choice,
         by index); errors after the first byte come as one `data: {"error": {...}}` chunk before [DONE].
         logprobs in OpenAI's shapes: completions {tokens, token_logprobs, top_logprobs, text_offset} (echo puts
         the prompt first, its first token null), chat {content: [{token, logprob, bytes, top_logprobs}]}.
         usage: prompt_tokens (once), completion_tokens (all choices), prompt_tokens_details.cached_tokens.
    GET  /v1/models               the served model, with max_model_len
    POST /tokenize                {"prompt"} or {"messages"} -> {"tokens", "count", "max_model_len"}
    POST /detokenize              {"tokens"} -> {"prompt"}
    GET  /health                  backend.health(): 200 when ok, else 503
    GET  /metrics                 Prometheus text: request counters, TTFT/TPOT/e2e histograms, backend gauges

Bad input is a 4xx with {"error": {"message", "type", "param", "code"}}, never a 500: 400 for malformed JSON,
fields or sampling values (protocol.py) and for what the backend's `features` lack, 404 for another model name,
413 when the prompt (or prompt +
max_tokens) can never fit the KV pool; HTTP limits (serve/limits.py: body size 413, body timeout 408, nesting
depth and lone surrogates 400, head/keep-alive timeouts, connection cap 503) sit in a middleware and the uvicorn
protocol; an unexpected exception is a 500 with the same error body, and every status is counted in /metrics.
The request is aborted, and its pages freed, when the client disconnects. CPU-heavy request work (JSON parsing,
tokenizing, chat templates, /detokenize) runs in worker threads (at most 4 at once), never on the event loop,
and a text longer than max_prompt_tokens x the tokenizer's max_token_chars is a 413 before it is tokenized.
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
from typing import Any, cast

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsakv.engine.request import TokenLogprobs
from dsakv.errors import CapacityError, DsakvError
from dsakv.serve.backend import GenerationBackend, TokenEvent
from dsakv.serve.limits import HttpGuard, HttpLimits, LimitsMiddleware, parse_json_body
from dsakv.serve.metrics import ServerMetrics
from dsakv.serve.protocol import MAX_TOKEN_ID, ApiError, GenRequest, check_model, parse_chat, parse_completion
from dsakv.serve.render import Renderer, _Choice, _Generation, _Piece
from dsakv.serve.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds without any event from the backend before a request fails
_END = object()


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
        self.cpu = anyio.CapacityLimiter(4)  # request CPU work off the event loop: JSON, tokenizing, chat templates
        self.created = int(time.time())
        self.render = Renderer(tokenizer, model_name)

    async def call(self, fn: Any, *args: Any) -> Any:
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.limiter)

    async def work(self, fn: Any, *args: Any) -> Any:
        """CPU-heavy request work (JSON parsing, tokenizing, chat templates) in a worker thread: the event loop
        goes on serving other requests meanwhile."""
        return await anyio.to_thread.run_sync(fn, *args, limiter=self.cpu)

    async def body(self, request: Request) -> dict[str, Any]:
        return cast(dict[str, Any], await self.work(parse_json_body, await request.body(), self.guard.limits))

    def check_text_size(self, chars: int, limit: int, param: str) -> None:
        """413 before tokenizing a text that cannot fit: more characters than limit tokens can stand for."""
        per = getattr(self.tokenizer, "max_token_chars", None)
        if isinstance(per, int) and per > 0 and chars > limit * per:
            raise ApiError(
                413,
                f"the prompt has {chars} characters, at least {-(-chars // per)} tokens (a token of this "
                f"tokenizer stands for at most {per} characters), but this server takes at most {limit} prompt "
                "tokens: shorten the prompt",
                param=param,
                code="context_length_exceeded",
            )

    async def encode(self, g: GenRequest, limit: int) -> list[int]:
        """The prompt's token ids: given, or the text / chat messages tokenized in a worker thread after the
        size check."""
        if g.prompt_ids is not None:
            return g.prompt_ids
        if g.prompt_text is not None:
            self.check_text_size(len(g.prompt_text), limit, "prompt")
            return cast(list[int], await self.work(self.tokenizer.encode, g.prompt_text))
        assert g.messages is not None
        self.check_text_size(sum(len(m["content"]) for m in g.messages), limit, "messages")
        return cast(list[int], await self.work(self.tokenizer.render_chat, g.messages))

    async def vocab_size(self) -> int | None:
        """The model's vocabulary size (token ids are below it): the backend's `vocab_size()` (optional in the
        contract; the router learns it from --model or its decodes), None when it does not know yet."""
        fn = getattr(self.backend, "vocab_size", None)
        v = await self.call(fn) if callable(fn) else None
        return int(v) if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    # ---- admission ------------------------------------------------------------------

    async def admit(self, request: Request, kind: str) -> _Generation:
        t0 = time.perf_counter()
        self.metrics.received()
        try:
            body = await self.body(request)
            g = parse_completion(body) if kind == "completion" else parse_chat(body)
            if g.model is not None and g.model != self.model_name:
                raise ApiError(
                    404,
                    f"model {g.model!r} is not served here: this server serves {self.model_name!r} (see /v1/models)",
                    param="model",
                    code="model_not_found",
                )
            limit = await self.call(self.backend.max_prompt_tokens)
            prompt_ids = await self.encode(g, limit)
            if not prompt_ids:
                raise ApiError(400, "the prompt encodes to no tokens: give a non-empty prompt", param="prompt")
            check_model(g, prompt_ids, await self.vocab_size())
            param = "prompt" if kind == "completion" else "messages"
            if len(prompt_ids) > limit:
                raise ApiError(
                    413,
                    f"the prompt has {len(prompt_ids)} tokens but this server takes at most {limit} prompt tokens "
                    f"(KV pool capacity minus one new token): shorten the prompt",
                    param=param,
                    code="context_length_exceeded",
                )
            self._check_features(g)
            rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex[:24]
            try:
                await self.call(self.backend.submit, rid, prompt_ids, g.params)
            except CapacityError as e:
                raise ApiError(413, str(e), param="max_tokens", code="context_length_exceeded") from None
            except DsakvError as e:  # errors.Unavailable (a dead rank, a stopped engine): its status 503
                raise ApiError(getattr(e, "status", 400), str(e), code=getattr(e, "code", "invalid_value")) from None
        except ApiError:
            self.metrics.rejected()
            raise
        self.metrics.started(len(prompt_ids))
        gen = _Generation(rid, g, prompt_ids, t0)
        gen.choices = [_Choice(i, self.tokenizer.detokenizer()) for i in range(g.params.n)]
        return gen

    def _check_features(self, g: GenRequest) -> None:
        """400 for what this backend cannot do (its `features`; the colocated and router backends do all)."""
        have: frozenset[str] = getattr(self.backend, "features", frozenset())
        p = g.params
        asked = [
            ("logprobs", p.logprobs is not None, "logprobs" if g.kind == "completion" else "top_logprobs"),
            ("prompt_logprobs", p.prompt_logprobs is not None, "echo"),
            ("n", p.n > 1, "n"),
            ("penalties", p.penalised, "presence_penalty"),
        ]
        for feature, used, param in asked:
            if used and feature not in have:
                what = {"penalties": "penalties, logit_bias and min_tokens", "prompt_logprobs": "echo with logprobs"}
                raise ApiError(
                    400,
                    f"{what.get(feature, feature)} are not supported by the {self.backend.name} backend "
                    "(serve the model colocated for them)",
                    param=param,
                    code="unsupported_parameter",
                )

    # ---- running ----------------------------------------------------------------------

    async def _watch_disconnect(self, request: Request, gen: _Generation) -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                if gen.finish_reason is None:
                    log.info("request %s: client disconnected, aborting", gen.rid)
                    await self.call(self.backend.abort, gen.rid)
                return

    async def _abort_choice(self, gen: _Generation, index: int) -> None:
        if len(gen.choices) == 1:
            await self.call(self.backend.abort, gen.rid)
        else:
            await self.call(cast(Any, self.backend).abort_choice, gen.rid, index)

    async def run(self, request: Request, gen: _Generation) -> AsyncGenerator[_Piece, None]:
        """Pieces (choice, text delta, new token ids, their logprobs) until gen.finish_reason is set."""
        stops = gen.g.stop
        hold = max((len(s) for s in stops), default=1) - 1
        gen.ran = True
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
                    if all(c.finish_reason is not None for c in gen.choices):
                        gen.finish_reason = "done"
                    else:
                        gen.finish_reason, gen.error = "error", "the backend ended the request without a final event"
                    break
                ev = cast(TokenEvent, got)
                if not 0 <= ev.choice < len(gen.choices):
                    gen.finish_reason, gen.error = "error", f"the backend sent an event for choice {ev.choice}"
                    break
                c = gen.choices[ev.choice]
                if ev.prompt_logprobs is not None:
                    gen.prompt_logprobs = tuple(ev.prompt_logprobs)
                if ev.choice == 0 and gen.cached_tokens is None and (ev.new_token_ids or ev.finished):
                    gen.cached_tokens = int(ev.num_cached_tokens)
                if c.finish_reason is not None:  # e.g. the abort that follows a stop string
                    continue
                now = time.perf_counter()
                new = list(ev.new_token_ids)
                lps = list(ev.logprobs)
                if new:
                    gen.t_first = gen.t_first or now
                    gen.t_last = now
                    c.ids.extend(new)
                    c.logprobs.extend(lps)
                    self.metrics.tokens(len(new))
                c.pending += c.detok.feed(new)
                if ev.finished:
                    c.pending += c.detok.flush()
                cut = min((i for i in (c.pending.find(s) for s in stops) if i >= 0), default=-1)
                if cut >= 0:
                    c.pending = c.pending[:cut]
                    c.finish_reason = "stop"
                    await self._abort_choice(gen, c.index)
                elif ev.finished:
                    c.finish_reason, c.error = ev.finish_reason or "stop", ev.error
                done = c.finish_reason is not None
                out = c.pending if done or not hold else c.pending[: max(len(c.pending) - hold, 0)]
                c.pending = c.pending[len(out) :]
                c.text += out
                if c.finish_reason in ("error", "timeout"):
                    gen.finish_reason, gen.error = c.finish_reason, c.error
                elif all(x.finish_reason is not None for x in gen.choices):
                    gen.finish_reason = "done"
                if out or new or done:
                    yield _Piece(c.index, out, new, lps)
        finally:
            watcher.cancel()
            if gen.finish_reason is None or any(c.finish_reason is None for c in gen.choices):
                # cancelled (client gone) or failed: free the request's pages
                if gen.finish_reason is None:
                    gen.finish_reason = "abort"
                with anyio.CancelScope(shield=True):
                    await self.call(self.release, gen.rid)
            self._log_done(gen)

    def release(self, rid: str) -> None:
        """The reader of `rid` is gone: abort it and drop what the backend keeps for it (its queue, its record),
        via the backend's `release` when it has one."""
        fn = getattr(self.backend, "release", None)
        if callable(fn):
            fn(rid)
        else:
            self.backend.abort(rid)

    async def leave(self, gen: _Generation) -> None:
        """A streamed request whose response ended before run() started (the client left before the first
        event): free it here, as run() would have."""
        if gen.ran:
            return
        gen.ran = True
        gen.finish_reason = "abort"
        log.info("request %s: client left before the stream started, aborting", gen.rid)
        with anyio.CancelScope(shield=True):
            await self.call(self.release, gen.rid)
        self._log_done(gen)

    def _log_done(self, gen: _Generation) -> None:
        end = time.perf_counter()
        ttft = gen.t_first - gen.t0 if gen.t_first is not None else None
        n = len(gen.ids)
        tpot = (gen.t_last - gen.t_first) / (n - 1) if n > 1 and gen.t_last and gen.t_first else None
        reasons = [c.finish_reason or "abort" for c in gen.choices]
        overall = gen.finish_reason if gen.finish_reason in ("error", "timeout", "abort") else reasons[0]
        self.metrics.done(overall or "abort", ttft, tpot, end - gen.t0)
        log.info(
            "request %s: prompt=%d output=%d ttft=%s e2e=%.3fs cached=%d%s finish=%s%s",
            gen.rid,
            len(gen.prompt_ids),
            n,
            f"{ttft:.3f}s" if ttft is not None else "-",
            end - gen.t0,
            gen.cached_tokens or 0,
            f" n={len(gen.choices)} ({sum(len(c.ids) for c in gen.choices)} tokens in all)"
            if len(gen.choices) > 1
            else "",
            overall if len(reasons) == 1 or overall != reasons[0] else ",".join(reasons),
            f" error={gen.error}" if gen.error else "",
        )

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
        choices = [self.render.choice(gen, c, c.text, c.ids, c.logprobs, True) for c in gen.choices]
        body = self.render.envelope(gen, choices, False)
        body["usage"] = gen.usage
        body["prompt_token_ids"] = gen.prompt_ids
        return JSONResponse(body)

    async def stream(self, request: Request, gen: _Generation) -> AsyncIterator[bytes]:
        """SSE chunks; the chunk that ends a choice carries its finish_reason (an empty one if no text came)."""

        def sse(obj: dict[str, Any]) -> bytes:
            return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"

        def chunk(c: _Choice, text: str, ids: list[int], lps: list[TokenLogprobs]) -> dict[str, Any]:
            return self.render.envelope(gen, [self.render.choice(gen, c, text, ids, lps, False)], True)

        first = True
        if gen.g.kind == "chat":  # OpenAI's first chat chunk of each choice: the role
            for c in gen.choices:
                head = self.render.envelope(
                    gen, [{"index": c.index, "delta": {"role": "assistant", "content": ""}}], True
                )
                head["choices"][0] |= {"logprobs": None, "finish_reason": None, "token_ids": []}
                if first:
                    head["prompt_token_ids"], first = gen.prompt_ids, False
                yield sse(head)
        async with contextlib.aclosing(self.run(request, gen)) as pieces:
            async for piece in pieces:
                c = gen.choices[piece.index]
                if c.finish_sent:
                    continue
                ch = chunk(c, piece.text, piece.ids, piece.logprobs)
                if first:
                    ch["prompt_token_ids"], first = gen.prompt_ids, False
                c.finish_sent = ch["choices"][0]["finish_reason"] is not None
                yield sse(ch)
        err = self._error_of(gen)
        if err is not None:
            yield sse(err.body())
        else:
            for c in gen.choices:
                if not c.finish_sent:
                    c.finish_reason = c.finish_reason or gen.finish_reason
                    yield sse(chunk(c, "", [], []))
            if gen.g.include_usage:
                tail = self.render.envelope(gen, [], True)
                tail["usage"] = gen.usage
                yield sse(tail)
        yield b"data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """The SSE response of one request; however the response ends (the client may leave before the body's first
    chunk, so the generator never runs), the request is freed."""

    def __init__(self, srv: _Server, request: Request, gen: _Generation) -> None:
        super().__init__(
            srv.stream(request, gen), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
        self._srv, self._gen = srv, gen

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):  # the client left mid-stream: nothing to answer, nothing to log
            log.info("request %s: client left mid-stream", self._gen.rid)
        finally:
            await self._srv.leave(self._gen)


def _is_id(t: object, top: int) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= top


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

    @app.exception_handler(ClientDisconnect)
    async def _client_left(request: Request, exc: ClientDisconnect) -> Response:
        # the client closed the connection before its request body arrived: nobody reads an answer; 499 (nginx's
        # "client closed request") counts it in /metrics without a traceback or a 5xx
        log.info("%s %s: the client left before sending its whole request", request.method, request.url.path)
        return Response(status_code=499)

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

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await srv.body(request)
        limit = await srv.call(backend.max_prompt_tokens)
        if "messages" in body:
            msgs = parse_chat({"messages": body["messages"]}).messages
            assert msgs is not None
            ids = await srv.work(srv.tokenizer.render_chat, msgs)
        else:
            p = body.get("prompt")
            if not isinstance(p, str):
                raise ApiError(400, f"'prompt' = {p!r} must be a string (or give 'messages')", param="prompt")
            add = body.get("add_special_tokens", True)
            if not isinstance(add, bool):
                raise ApiError(400, f"'add_special_tokens' = {add!r} must be true or false", param="add_special_tokens")
            ids = await srv.work(srv.tokenizer.encode, p, add)
        return {"count": len(ids), "max_model_len": limit + 1, "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await srv.body(request)
        ids = body.get("tokens")
        vocab = await srv.vocab_size()
        top = vocab - 1 if vocab is not None else MAX_TOKEN_ID
        if not isinstance(ids, list) or not all(_is_id(t, top) for t in ids):
            shown = repr(ids) if len(repr(ids)) <= 80 else repr(ids)[:77] + "..."
            msg = f"'tokens' = {shown} must be a list of token ids (integers in [0, {top}])"
            raise ApiError(400, msg, param="tokens")
        return {"prompt": await srv.work(srv.tokenizer.decode, ids)}

    async def generate(request: Request, kind: str) -> Response:
        gen = await srv.admit(request, kind)
        if gen.g.stream:
            return _Stream(srv, request, gen)
        return await srv.complete(request, gen)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await generate(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await generate(request, "chat")

    return app


__all__ = ["DEFAULT_REQUEST_TIMEOUT", "create_app"]
