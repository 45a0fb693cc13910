"""What the HTTP app sends back: the per-request state it renders (_Generation, its _Choice per sequence, the
_Piece each step yields) and Renderer, which turns them into OpenAI's JSON shapes (choices, envelopes, logprobs
for completions and chat). Imports serve.protocol, serve.tokenizer and the engine's TokenLogprobs; must not
import fastapi, torch, disagg or cli.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from dsakv.engine.request import TokenLogprobs
from dsakv.serve.protocol import GenRequest
from dsakv.serve.tokenizer import Detokenizer, Tokenizer


@dataclass
class _Choice:
    """One of a request's n choices: its tokens, text (stop strings applied) and logprobs so far."""

    index: int
    detok: Detokenizer
    ids: list[int] = field(default_factory=list)
    text: str = ""
    pending: str = ""  # text held back while it may be the start of a stop string
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    started: bool = False  # a piece of it was formatted (the echo goes with the first)
    finish_sent: bool = False
    offset: int = 0  # completions logprobs' text_offset of the next token


@dataclass
class _Piece:
    index: int
    text: str
    ids: list[int]
    logprobs: list[TokenLogprobs]


@dataclass
class _Generation:
    """One request's run: consumes backend events, detokenizes, applies stop strings, times it."""

    rid: str
    g: GenRequest
    prompt_ids: list[int]
    t0: float
    choices: list[_Choice] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None  # set when every choice finished ("error"/"timeout" if the request failed)
    error: str | None = None
    t_first: float | None = None
    t_last: float | None = None
    ran: bool = False  # run() started: its `finally` frees the request; else the response's does (_Stream)
    placed: dict[str, Any] = field(default_factory=dict)  # the backend's placement fields (a DP rank), if any

    @property
    def ids(self) -> list[int]:
        return self.choices[0].ids if self.choices else []

    def completion_ids(self, c: _Choice) -> list[int]:
        return [] if self.g.echo_only else c.ids

    @property
    def usage(self) -> dict[str, Any]:
        n = len(self.prompt_ids)
        m = sum(len(self.completion_ids(c)) for c in self.choices)
        return {
            "prompt_tokens": n,
            "completion_tokens": m,
            "total_tokens": n + m,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens or 0},
        }


class Renderer:
    """The OpenAI response shapes of one served model (`model_name`), texts by `tokenizer`."""

    def __init__(self, tokenizer: Tokenizer, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name

    # ---- responses ----------------------------------------------------------------------

    # ---- logprobs in the OpenAI shapes ------------------------------------------------------

    def token_str(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def completion_logprobs(
        self, entries: list[TokenLogprobs | None], ids: list[int], offset: int
    ) -> tuple[dict[str, Any], int]:
        """The legacy completions shape {tokens, token_logprobs, top_logprobs, text_offset}; an entry None (the
        first prompt token) has null logprob and top. The sampled token is always among top_logprobs."""
        tokens: list[str] = []
        lps: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        offs: list[int] = []
        for t, e in zip(ids, entries, strict=True):
            s = self.token_str(t)
            tokens.append(s)
            offs.append(offset)
            offset += len(s)
            if e is None:
                lps.append(None)
                tops.append(None)
                continue
            lps.append(e.logprob)
            top = {self.token_str(i): v for i, v in e.top}
            top.setdefault(s, e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offs}, offset

    def chat_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any]:
        def one(t: int, v: float) -> dict[str, Any]:
            return {"token": self.token_str(t), "logprob": v, "bytes": list(self.tokenizer.token_bytes(t))}

        content = [one(e.token_id, e.logprob) | {"top_logprobs": [one(i, v) for i, v in e.top]} for e in entries]
        return {"content": content, "refusal": None}

    def echo(self, gen: _Generation) -> tuple[str, list[int], list[TokenLogprobs | None]]:
        text = gen.g.prompt_text if gen.g.prompt_text is not None else self.tokenizer.decode(gen.prompt_ids)
        lps: list[TokenLogprobs | None] = [None, *(gen.prompt_logprobs or ())]
        return text, gen.prompt_ids, lps

    # ---- responses ----------------------------------------------------------------------

    def choice(
        self, gen: _Generation, c: _Choice, text: str, ids: list[int], lps: list[TokenLogprobs], final: bool
    ) -> dict:
        """A choice object: the whole choice (final, not streamed) or one streamed piece of it."""
        g = gen.g
        finish = c.finish_reason if final or g.stream else None
        if finish in ("error", "timeout"):
            finish = None
        out: dict[str, Any] = {"index": c.index}
        logprobs: dict[str, Any] | None = None
        if g.kind == "completion":
            if g.echo_only:
                text, ids, lps = "", [], []
            first = not c.started
            echo_text = ""
            entries: list[TokenLogprobs | None] = list(lps)
            tok_ids = list(ids)
            if g.echo and first:
                echo_text, p_ids, p_lps = self.echo(gen)
                entries, tok_ids = p_lps + entries, p_ids + tok_ids
            out["text"] = echo_text + text
            if g.logprobs is not None:
                if len(entries) != len(tok_ids):  # echo without prompt logprobs from the backend
                    missing: list[TokenLogprobs | None] = [None] * (len(tok_ids) - len(entries))
                    entries = missing + entries
                logprobs, c.offset = self.completion_logprobs(entries, tok_ids, c.offset)
        elif final and not g.stream:
            out["message"] = {"role": "assistant", "content": text}
            if g.logprobs is not None:
                logprobs = self.chat_logprobs(lps)
        else:
            out["delta"] = {"content": text} if text or finish is None else {}
            if g.logprobs is not None and lps:
                logprobs = self.chat_logprobs(lps)
        c.started = True
        out["logprobs"] = logprobs
        out["finish_reason"] = finish
        out["token_ids"] = ids
        return out

    def envelope(self, gen: _Generation, choices: list[dict], chunk: bool) -> dict[str, Any]:
        obj = (
            "text_completion"
            if gen.g.kind == "completion"
            else ("chat.completion.chunk" if chunk else "chat.completion")
        )
        out = {"id": gen.rid, "object": obj, "created": int(time.time()), "model": self.model_name, "choices": choices}
        return out | gen.placed
