"""One request's life in the HTTP app (serve/app.py routes to it): _Server admits a request (body, features,
tokens), runs it on the backend's events (disconnects, per-choice aborts, timeouts), answers it whole or as SSE
(_Stream), and frees it however the response ends. Imports fastapi/anyio, dsakv.serve.*, dsakv.errors and
dsakv.engine.request (TokenLogprobs); never torch."""

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
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from dsakv.engine.request import TokenLogprobs
from dsakv.errors import CapacityError, DsakvError
from dsakv.serve.backend import GenerationBackend, TokenEvent
from dsakv.serve.limits import HttpGuard, parse_json_body
from dsakv.serve.metrics import ServerMetrics
from dsakv.serve.protocol import ApiError, GenRequest, check_model, parse_chat, parse_completion
from dsakv.serve.render import Renderer, _Choice, _Generation, _Piece
from dsakv.serve.tokenizer import Tokenizer

log = logging.getLogger("dsakv.serve.app")

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
                placed = await self.call(self.backend.submit, rid, prompt_ids, g.params)
            except CapacityError as e:
                raise ApiError(413, str(e), param="max_tokens", code="context_length_exceeded") from None
            except DsakvError as e:  # errors.Unavailable (a dead rank, a stopped engine): its status 503
                raise ApiError(getattr(e, "status", 400), str(e), code=getattr(e, "code", "invalid_value")) from None
        except ApiError:
            self.metrics.rejected()
            raise
        self.metrics.started(len(prompt_ids))
        gen = _Generation(rid, g, prompt_ids, t0)
        gen.placed = placed if isinstance(placed, dict) else {}  # e.g. {"dp_rank": 1}: in every response object
        gen.choices = [_Choice(i, self.tokenizer.detokenizer()) for i in range(g.params.n)]
        return gen

    def _check_features(self, g: GenRequest) -> None:
        """400 for what this backend cannot do (its `features`: all for DSA models; none for DeepSeek-V4, colocated
        or through a router whose decodes say so)."""
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
                    f"{what.get(feature, feature)} are not supported by the {self.backend.name} backend of this "
                    "model (DeepSeek-V4 serves none of them yet): drop the parameter",
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
