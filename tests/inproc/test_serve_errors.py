"""Bad requests get a 4xx with an OpenAI error body naming the field, never a 500, and queue nothing: the pool
is empty afterwards. Also the EngineBackend contract on its own (abort, timeout, unknown ids)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from dsakv.engine.request import SamplingParams
from dsakv.errors import CapacityError, ConfigError
from dsakv.serve.backend import GenerationBackend, TokenEvent
from dsakv.serve.engine_backend import EngineBackend
from dsakv.testing.servers import MODEL, NUM_PAGES, PAGE_SIZE, live_server, make_engine, scrape, wait_idle

CAP = NUM_PAGES * PAGE_SIZE  # 1024 tokens; the longest prompt is CAP - 1
OK = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
CHAT_OK = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

# (path, body (dict, or raw bytes), status, param, code, words in the message)
CASES = [
    ("/v1/completions", b"{bad json", 400, None, "invalid_json", "not valid JSON"),
    ("/v1/completions", b"", 400, None, "invalid_json", "empty"),
    ("/v1/completions", b"[1, 2]", 400, None, "invalid_json", "JSON object"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "missing_required_parameter", "'prompt' is required"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "invalid_value", "empty"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", "invalid_value", "empty"),
    ("/v1/completions", {**OK, "prompt": {"a": 1}}, 400, "prompt", "invalid_value", "token ids"),
    ("/v1/completions", {**OK, "prompt": [1, "a"]}, 400, "prompt", "invalid_value", "token ids"),
    ("/v1/completions", {**OK, "prompt": ["a", "b"]}, 400, "prompt", "invalid_value", "one prompt"),
    ("/v1/completions", {**OK, "prompt": [5, -3]}, 400, "prompt", "invalid_value", "negative"),
    ("/v1/completions", {**OK, "prompt": [5, 512]}, 400, "prompt", "invalid_value", "outside the model's vocabulary"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", "invalid_value", ">= 0"),
    ("/v1/completions", {**OK, "temperature": "hot"}, 400, "temperature", "invalid_value", "number"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "invalid_value", "(0, 1]"),
    ("/v1/completions", {**OK, "top_p": 1.5}, 400, "top_p", "invalid_value", "(0, 1]"),
    ("/v1/completions", {**OK, "top_k": -5}, 400, "top_k", "invalid_value", "top_k"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "invalid_value", "only with"),
    ("/v1/completions", {**OK, "max_tokens": -1}, 400, "max_tokens", "invalid_value", "[1, 2147483647]"),
    ("/v1/completions", {**OK, "max_tokens": "10"}, 400, "max_tokens", "invalid_value", "integer"),
    ("/v1/completions", {**OK, "max_tokens": 2.5}, 400, "max_tokens", "invalid_value", "integer"),
    ("/v1/completions", {**OK, "n": 65}, 400, "n", "invalid_value", "[1, 64]"),
    ("/v1/completions", {**OK, "best_of": 3}, 400, "best_of", "unsupported_parameter", "equals n"),
    ("/v1/completions", {**OK, "seed": -1}, 400, "seed", "invalid_value", "seed"),
    ("/v1/completions", {**OK, "stream": "yes"}, 400, "stream", "invalid_value", "true or false"),
    (
        "/v1/completions",
        {**OK, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "invalid_value",
        "stream",
    ),
    ("/v1/completions", {**OK, "stop": 5}, 400, "stop", "invalid_value", "string"),
    ("/v1/completions", {**OK, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "invalid_value", "at most 4"),
    ("/v1/completions", {**OK, "stop_token_ids": [-1]}, 400, "stop_token_ids", "invalid_value", "token ids"),
    ("/v1/completions", {**OK, "ignore_eos": "no"}, 400, "ignore_eos", "invalid_value", "true or false"),
    ("/v1/completions", {**OK, "logprobs": 21}, 400, "logprobs", "invalid_value", "[0, 20]"),
    ("/v1/completions", {**OK, "logprobs": True}, 400, "logprobs", "invalid_value", "integer"),
    ("/v1/completions", {**OK, "echo": "yes"}, 400, "echo", "invalid_value", "true or false"),
    ("/v1/completions", {**OK, "suffix": "x"}, 400, "suffix", "unsupported_parameter", "not supported"),
    (
        "/v1/completions",
        {**OK, "max_tokens": 0, "echo": True, "stream": True},
        400,
        "max_tokens",
        "invalid_value",
        "streamed",
    ),
    ("/v1/completions", {**OK, "min_tokens": 5}, 400, "min_tokens", "invalid_value", "[0, 4]"),
    ("/v1/completions", {**OK, "repetition_penalty": 0}, 400, "repetition_penalty", "invalid_value", "(0, 100]"),
    ("/v1/completions", {**OK, "presence_penalty": 2.5}, 400, "presence_penalty", "invalid_value", "[-2, 2]"),
    ("/v1/completions", {**OK, "logit_bias": {"x": 1}}, 400, "logit_bias", "invalid_value", "token id"),
    ("/v1/completions", {**OK, "logit_bias": {"5": 101}}, 400, "logit_bias", "invalid_value", "[-100, 100]"),
    ("/v1/completions", {**OK, "logit_bias": [5]}, 400, "logit_bias", "invalid_value", "object"),
    ("/v1/completions", {**OK, "model": "gpt-4"}, 404, "model", "model_not_found", "'gpt-4' is not served"),
    (
        "/v1/completions",
        {**OK, "prompt": [5] * CAP},
        413,
        "prompt",
        "context_length_exceeded",
        f"{CAP} tokens but this server takes at most {CAP - 1}",
    ),
    (
        "/v1/completions",
        {**OK, "prompt": [5] * 1000, "max_tokens": 100},
        413,
        "max_tokens",
        "context_length_exceeded",
        "prompt of 1000 tokens + max_new_tokens 100 = 1100 tokens can never fit",
    ),
    ("/v1/chat/completions", {"model": MODEL}, 400, "messages", "missing_required_parameter", "required"),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "response_format": {"type": "json_object"}},
        400,
        "response_format",
        "invalid_value",
        "text",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        400,
        "messages[0].content",
        "invalid_value",
        "only text",
    ),
    ("/v1/chat/completions", {**CHAT_OK, "top_logprobs": 2}, 400, "top_logprobs", "invalid_value", "needs"),
    ("/v1/chat/completions", {**CHAT_OK, "logprobs": 1}, 400, "logprobs", "invalid_value", "true or false"),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "logprobs": True, "top_logprobs": 21},
        400,
        "top_logprobs",
        "invalid_value",
        "[0, 20]",
    ),
    ("/v1/chat/completions", {**CHAT_OK, "messages": []}, 400, "messages", "invalid_value", "non-empty"),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "messages": [{"role": "bot", "content": "x"}]},
        400,
        "messages[0].role",
        "invalid_value",
        "'bot'",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "messages": [{"role": "user", "content": 3}]},
        400,
        "messages[0].content",
        "invalid_value",
        "string",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "messages": [{"role": "user"}]},
        400,
        "messages[0].content",
        "missing_required_parameter",
        "required",
    ),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "tools": [{"type": "function"}]},
        400,
        "tools",
        "unsupported_parameter",
        "tools",
    ),
    ("/v1/chat/completions", {**CHAT_OK, "temperature": -1}, 400, "temperature", "invalid_value", ">= 0"),
    (
        "/v1/chat/completions",
        {**CHAT_OK, "messages": [{"role": "user", "content": "x" * CAP}]},
        413,
        "messages",
        "context_length_exceeded",
        "prompt tokens",
    ),
]


@pytest.fixture(scope="module")
def server():
    with live_server(make_engine()) as (srv, backend):
        yield srv


@pytest.mark.parametrize("path,body,status,param,code,words", CASES, ids=[f"{i}" for i in range(len(CASES))])
def test_bad_request_is_4xx_with_openai_error(server, path, body, status, param, code, words):
    before = scrape(server.url)
    kw = (
        {"content": body, "headers": {"content-type": "application/json"}}
        if isinstance(body, bytes)
        else {"json": body}
    )
    r = httpx.post(f"{server.url}{path}", timeout=30, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["param"] == param and err["code"] == code
    assert words in err["message"], err["message"]
    h = wait_idle(server.url)  # nothing queued, no page held
    assert h["pages_used"] == 0 and h["pages_free"] == NUM_PAGES
    m = scrape(server.url)
    assert m["dsakv_requests_rejected_total"] == before["dsakv_requests_rejected_total"] + 1
    assert m["dsakv_requests_running"] == 0


def test_routes_and_methods(server):
    r = httpx.get(f"{server.url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    r = httpx.get(f"{server.url}/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def test_openai_client_raises_with_message(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=MODEL, prompt=[1, 2], max_tokens=4, top_p=2.0)
        assert "'top_p' = 2.0 must be a number in (0, 1]" in str(e.value)
        with pytest.raises(openai.APIStatusError) as e2:
            c.completions.create(model=MODEL, prompt=[3] * 2000, max_tokens=4)
        assert e2.value.status_code == 413 and "2000 tokens" in str(e2.value)
        # and the server still serves
        r = c.completions.create(
            model=MODEL, prompt=[1, 2], max_tokens=3, temperature=0, extra_body={"ignore_eos": True}
        )
        want = make_engine().generate([[1, 2]], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
        assert r.choices[0].model_extra["token_ids"] == want
    wait_idle(server.url)


# ---- the backend contract, without HTTP ------------------------------------------------------


def test_engine_backend_contract():
    eng = make_engine()
    b = EngineBackend(eng)
    assert isinstance(b, GenerationBackend) and b.name == "colocated"
    assert b.max_prompt_tokens() == CAP - 1
    with pytest.raises(ConfigError, match="not started"):
        b.submit("x", [1, 2], SamplingParams())
    b.start()
    try:
        b.submit("a", [5, 6, 7], SamplingParams(max_new_tokens=6, ignore_eos=True))
        evs = list(b.events("a", timeout=30))
        assert all(isinstance(e, TokenEvent) for e in evs)
        # the reference on an engine of its own: the backend's thread steps `eng` (it would take generate's outputs)
        assert [t for e in evs for t in e.new_token_ids] == make_engine().generate(
            [[5, 6, 7]], SamplingParams(max_new_tokens=6, ignore_eos=True)
        )[0]
        assert evs[-1].finished and evs[-1].finish_reason == "length" and evs[-1].error is None
        assert not any(e.finished for e in evs[:-1])
        # bad input raises and queues nothing
        with pytest.raises(CapacityError, match="can never fit"):
            b.submit("big", [5] * 1000, SamplingParams(max_new_tokens=100))
        with pytest.raises(ConfigError, match="vocabulary"):
            b.submit("voc", [5, 9999], SamplingParams())
        with pytest.raises(KeyError):
            next(b.events("big", timeout=1))
        # abort mid-way: a final 'abort' event, pages back
        b.submit("long", [5, 6], SamplingParams(max_new_tokens=500, ignore_eos=True))
        it = b.events("long", timeout=30)
        first = next(it)
        assert not first.finished
        b.abort("long")
        rest = list(it)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        b.abort("long")  # finished: a no-op
        b.abort("never-seen")
        # duplicate ids are refused while in flight
        b.submit("dup", [5], SamplingParams(max_new_tokens=300, ignore_eos=True))
        with pytest.raises(ConfigError, match="already in flight"):
            b.submit("dup", [6], SamplingParams())
        it = b.events("dup", timeout=30)
        next(it)
        it.close()  # the reader left: the request is aborted
        h = b.health()
        deadline = 50
        while (h["pages_used"] or h["running"]) and deadline:
            time.sleep(0.05)
            deadline -= 1
            h = b.health()
        assert h["ok"] and h["pages_used"] == 0 and h["running"] == 0 and h["waiting"] == 0
        m = b.metrics()
        assert m["pool_pages_used"] == 0 and m["pool_pages_total"] == NUM_PAGES and m["elide"] == 1.0
        eng.check_integrity()
    finally:
        b.stop()
    assert not b.health()["ok"]


def test_events_timeout_aborts():
    eng = make_engine()
    b = EngineBackend(eng)
    b.start()
    try:
        b._stopping.set()  # freeze the stepping thread: nothing will arrive
        b._wake.set()
        b._thread.join(timeout=10)
        b.submit("t", [5, 6], SamplingParams(max_new_tokens=4))
        with pytest.raises(TimeoutError, match="no token within 0.2 s"):
            list(b.events("t", timeout=0.2))
        assert eng.get_request("t") is None  # aborted by the reader leaving
        assert eng.stats().num_waiting == 0
    finally:
        b.stop()
