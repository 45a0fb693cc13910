"""Logprobs, echo, n, penalties and usage over HTTP (a live server with the tiny checkpoint's real tokenizer,
the `openai` client and raw SSE): every logprob equals log_softmax of transformers' logits for the same tokens
(fp32 pool, within 1e-4), in completions with echo, chat, and streaming; n = 4 choices reproduce with seed + i;
usage is exact, cached prompt tokens included."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from dsakv.engine.request import SamplingParams
from dsakv.serve.tokenizer import load_tokenizer
from dsakv.testing.engines import _hf, tiny_path
from dsakv.testing.servers import MODEL, live_server, make_engine, sse_events

PROMPT = "The quick brown fox jumps over the lazy dog. The key-value cache holds"
TOL = 1e-4


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_path("glm_moe_dsa"), 512)


@pytest.fixture(scope="module")
def server(tok):
    with live_server(make_engine(enable_prefix_cache=True), tok) as (srv, _):
        yield srv


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_hf("glm_moe_dsa")(torch.tensor([ids])).logits[0].float(), -1)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_completion_echo_logprobs_equal_transformers(server, tok):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 3}
    r = post(server, "/v1/completions", {**body, "ignore_eos": True})
    (c,) = r["choices"]
    p_ids, out = r["prompt_token_ids"], c["token_ids"]
    assert p_ids == tok.encode(PROMPT) and len(out) == 5
    ids = p_ids + out
    ref = hf_logprobs(ids)
    lp = c["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert c["text"] == PROMPT + tok.decode(out)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token: null
    for i in range(1, len(ids)):  # token i from the logits at position i - 1
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < TOL
        top = lp["top_logprobs"][i]
        want = {tok.decode([t]): v for t, v in zip(*[x.tolist() for x in ref[i - 1].topk(3)][::-1], strict=True)}
        assert set(want) <= set(top) and len(top) <= 4  # top 3 plus the token itself
        assert all(abs(top[k] - v) < TOL for k, v in want.items())
    assert lp["text_offset"][0] == 0
    assert lp["text_offset"][-1] == len(c["text"]) - len(lp["tokens"][-1])
    for i in range(len(p_ids), len(ids)):  # greedy: each generated token is the best one
        assert ids[i] == int(ref[i - 1].argmax())
    assert r["usage"] == {
        "prompt_tokens": len(p_ids),
        "completion_tokens": 5,
        "total_tokens": len(p_ids) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},  # prompt logprobs compute every position
    }
    # echo only (max_tokens 0, as loglikelihood harnesses send): the prompt and its logprobs, nothing generated
    z = post(server, "/v1/completions", {**body, "max_tokens": 0, "logprobs": 0})
    (zc,) = z["choices"]
    assert zc["text"] == PROMPT and zc["token_ids"] == [] and z["usage"]["completion_tokens"] == 0
    assert zc["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1 : len(p_ids)], abs=TOL)
    assert all(len(t) == 1 for t in zc["logprobs"]["top_logprobs"][1:])  # logprobs 0: the token itself


def test_completion_stream_logprobs_equal_non_stream(server):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": True}
    whole = post(server, "/v1/completions", {**body, "ignore_eos": True})["choices"][0]
    events = sse_events(server.url, "/v1/completions", {**body, "stream": True, "ignore_eos": True})
    text, lps, toks, offs = "", [], [], []
    for ev in events:
        for c in ev["choices"]:
            text += c["text"]
            if c["logprobs"]:
                lps += c["logprobs"]["token_logprobs"]
                toks += c["logprobs"]["tokens"]
                offs += c["logprobs"]["text_offset"]
    assert text == whole["text"] and toks == whole["logprobs"]["tokens"]
    assert offs == whole["logprobs"]["text_offset"]
    assert lps[0] is None and lps[1:] == pytest.approx(whole["logprobs"]["token_logprobs"][1:], abs=1e-6)


def test_chat_logprobs_equal_transformers(server, tok, client):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=msgs,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    c = r.choices[0]
    ids = r.model_extra["prompt_token_ids"] + c.model_extra["token_ids"]
    n = len(r.model_extra["prompt_token_ids"])
    ref = hf_logprobs(ids)
    content = c.logprobs.content
    assert len(content) == 6 and c.message.content == tok.decode(ids[n:])
    for i, e in enumerate(content):
        t = ids[n + i]
        assert e.token == tok.decode([t]) and abs(e.logprob - ref[n + i - 1, t].item()) < TOL
        assert bytes(e.bytes) == tok.token_bytes(t)
        assert [x.token for x in e.top_logprobs] == [tok.decode([j]) for j in ref[n + i - 1].topk(2).indices.tolist()]
    # the bytes are exact (a token may hold part of a character): decoded together they give the text
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", "replace") == c.message.content
    # streamed: the same entries, chunk by chunk
    events = sse_events(
        server.url,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": msgs,
            "max_tokens": 6,
            "temperature": 0,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
            "stream": True,
        },
    )
    streamed = [e for ev in events for ch in ev["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert [e["token"] for e in streamed] == [e.token for e in content]
    assert [e["logprob"] for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)


def test_n4_choices_reproduce_with_seed_plus_index(client):
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11, n=4, extra_body={"ignore_eos": True}
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    got = [c.model_extra["token_ids"] for c in r.choices]
    for i in range(4):
        one = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=11 + i, extra_body={"ignore_eos": True}
        )
        assert one.choices[0].model_extra["token_ids"] == got[i]
    assert len({tuple(g) for g in got}) > 1
    assert r.usage.prompt_tokens == len(r.model_extra["prompt_token_ids"]) and r.usage.completion_tokens == 20
    # streamed: every choice's chunks carry its index and end with its finish_reason
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=5,
            temperature=1.0,
            seed=11,
            n=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    per = {
        i: [t for ch in chunks for c in ch.choices if c.index == i for t in c.model_extra["token_ids"]]
        for i in range(4)
    }
    assert [per[i] for i in range(4)] == got
    assert sorted(c.index for ch in chunks for c in ch.choices if c.finish_reason == "length") == [0, 1, 2, 3]


def test_penalties_over_http_equal_the_engine(client, tok):
    ids = tok.encode(PROMPT)
    plain = make_engine().generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    ban = {plain[0]: -100.0}  # the greedy first token is banned: the output must change
    sp = SamplingParams(
        max_new_tokens=8,
        ignore_eos=True,
        presence_penalty=2.0,
        frequency_penalty=1.0,
        logit_bias=ban,
        min_tokens=3,
        repetition_penalty=1.3,
    )
    want = make_engine().generate([ids], sp)[0]
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=8,
        temperature=0,
        presence_penalty=2.0,
        frequency_penalty=1.0,
        logit_bias={str(k): v for k, v in ban.items()},
        extra_body={"ignore_eos": True, "min_tokens": 3, "repetition_penalty": 1.3},
    )
    assert r.choices[0].model_extra["token_ids"] == want and want[0] != plain[0]


def test_usage_counts_cached_prompt_tokens(client):
    prompt = list(range(100, 150))  # 50 tokens: 3 whole pages of 16 cached after the first request
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == 48
    assert again.usage.prompt_tokens == 50 and again.usage.total_tokens == 50 + again.usage.completion_tokens
