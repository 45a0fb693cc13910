"""CPU-heavy request work (JSON parsing, tokenizing, chat templates) runs off the HTTP event loop, and a text that
cannot fit is refused by its size before any of it starts.

A live server over a real engine with a tokenizer that blocks on one marked prompt until the test releases it:
while that request sits in its tokenizer, other requests (completions, chat, /tokenize, /health) complete with
exact tokens -- with tokenizing on the event loop they would all wait behind it. A 10 MB chat message is a 413
naming its size before the tokenizer sees it, while a small request served alongside returns exact tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dsakv.engine.request import SamplingParams
from dsakv.serve.tokenizer import ByteDetokenizer, ByteTokenizer
from dsakv.testing.servers import MODEL, NUM_PAGES, PAGE_SIZE, live_server, make_engine, wait_idle

pytestmark = [pytest.mark.timeout(300)]

MARK = "BLOCK-ME"
SMALL = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "ignore_eos": True}


class GatedTokenizer:
    """The byte tokenizer; a text holding MARK waits in encode/render_chat until `release` is set. Records the
    length of every text it was asked to tokenize."""

    name = "gated-bytes"
    max_token_chars = 1

    def __init__(self) -> None:
        self.inner = ByteTokenizer()
        self.entered = threading.Event()
        self.release = threading.Event()
        self.seen: list[int] = []

    def _gate(self, text: str) -> None:
        self.seen.append(len(text))
        if MARK in text:
            self.entered.set()
            assert self.release.wait(120), "never released"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self._gate(text)
        return self.inner.encode(text, add_special_tokens)

    def render_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        self._gate("".join(m["content"] for m in messages))
        return self.inner.render_chat(messages)

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(ids)

    def token_bytes(self, token_id: int) -> bytes:
        return self.inner.token_bytes(token_id)

    def detokenizer(self) -> ByteDetokenizer:
        return self.inner.detokenizer()


@pytest.fixture(scope="module")
def served():
    tok = GatedTokenizer()
    with live_server(make_engine(), tok) as (srv, _backend):
        yield srv.url, tok


def _want(prompt: list[int], n: int = 4) -> list[int]:
    return make_engine().generate([prompt], SamplingParams(max_new_tokens=n, ignore_eos=True))[0]


def test_a_request_in_its_tokenizer_does_not_stall_others(served):
    url, tok = served
    tok.entered.clear()
    tok.release.clear()
    text = MARK + " held in the tokenizer"
    chat = [{"role": "user", "content": "hi"}]
    with ThreadPoolExecutor(2) as pool, httpx.Client(base_url=url, timeout=60) as c:
        held = pool.submit(
            httpx.post,
            f"{url}/v1/completions",
            json={**SMALL, "prompt": text},
            timeout=120,
        )
        assert tok.entered.wait(60)
        # the held request is inside encode(): everything else is served meanwhile
        r = c.post("/v1/completions", json=SMALL)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == _want(SMALL["prompt"])
        r = c.post("/v1/chat/completions", json={**SMALL, "messages": chat, "prompt": None})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == _want(ByteTokenizer().render_chat(chat))
        r = c.post("/tokenize", json={"prompt": "héllo"})
        assert r.status_code == 200 and r.json()["tokens"] == ByteTokenizer().encode("héllo")
        assert c.get("/health").status_code == 200
        assert not held.done()  # still waiting in its tokenizer: the others did not wait for it
        tok.release.set()
        r = held.result(timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == _want(ByteTokenizer().encode(text))
    h = wait_idle(url)
    assert h["pages_used"] == 0


def test_a_10mb_chat_message_is_refused_by_size_before_tokenizing(served):
    url, tok = served
    tok.release.set()
    limit = NUM_PAGES * PAGE_SIZE - 1
    big = "x" * (10 * 2**20)
    seen = len(tok.seen)
    body = {"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 2}
    with ThreadPoolExecutor(2) as pool:
        refused = pool.submit(httpx.post, f"{url}/v1/chat/completions", json=body, timeout=120)
        small = httpx.post(f"{url}/v1/completions", json=SMALL, timeout=120)
        r = refused.result(timeout=120)
    assert small.status_code == 200 and small.json()["choices"][0]["token_ids"] == _want(SMALL["prompt"])
    assert r.status_code == 413, r.text[:300]
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("context_length_exceeded", "messages")
    assert f"the prompt has {len(big)} characters, at least {len(big)} tokens" in err["message"]
    assert f"at most {limit} prompt tokens" in err["message"]
    assert max(tok.seen[seen:], default=0) < len(big)  # the tokenizer never saw it
    # the same for a completions text prompt
    r = httpx.post(f"{url}/v1/completions", json={**SMALL, "prompt": big[: 2**20]}, timeout=120)
    assert r.status_code == 413 and r.json()["error"]["param"] == "prompt"
    assert max(tok.seen[seen:], default=0) < 2**20
    assert wait_idle(url)["pages_used"] == 0
