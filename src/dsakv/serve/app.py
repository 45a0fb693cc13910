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

import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from dsakv.serve.backend import GenerationBackend
from dsakv.serve.handler import DEFAULT_REQUEST_TIMEOUT, _Server, _Stream
from dsakv.serve.limits import HttpGuard, HttpLimits, LimitsMiddleware
from dsakv.serve.protocol import MAX_TOKEN_ID, ApiError, parse_chat
from dsakv.serve.tokenizer import ByteTokenizer, Tokenizer

log = logging.getLogger(__name__)


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
