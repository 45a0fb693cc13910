"""The OpenAI-compatible server on a live 127.0.0.1 port, driven by the real `openai` client and httpx: exact
greedy token ids equal Engine.generate on the same prompts, streaming and not, completions and chat."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from dsakv.engine.request import SamplingParams
from dsakv.serve.tokenizer import ByteTokenizer
from dsakv.testing.servers import MODEL, NUM_PAGES, PAGE_SIZE, live_server, make_engine, scrape, sse_events, wait_idle

PROMPTS = [[5, 6, 7, 8], [300, 12, 99], list(range(20, 70)), [2, 3] * 20]
STEPS = 10
TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def server():
    with live_server(make_engine()) as (srv, backend):
        yield srv


@pytest.fixture(scope="module")
def reference():
    eng = make_engine()

    def run(prompts: list[list[int]], steps: int = STEPS, **kw: object) -> list[list[int]]:
        return eng.generate(prompts, SamplingParams(max_new_tokens=steps, **kw))  # type: ignore[arg-type]

    return run


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


def test_completion_ids_equal_engine_generate(client, reference):
    want = reference(PROMPTS)
    for prompt, ids in zip(PROMPTS, want, strict=True):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=STEPS, temperature=0)
        c = r.choices[0]
        assert c.model_extra["token_ids"] == ids
        assert c.text == TOK.decode(ids)
        assert c.finish_reason == ("stop" if len(ids) < STEPS else "length")
        assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
        assert r.model == MODEL and r.object == "text_completion" and r.id.startswith("cmpl-")
        assert r.model_extra["prompt_token_ids"] == prompt


def test_completion_stream_equals_non_stream(client, reference, server):
    prompt = PROMPTS[2]
    (want,) = reference([prompt], 12, ignore_eos=True)
    ids, text, finish = [], "", []
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        c = chunk.choices[0]
        ids += c.model_extra["token_ids"]
        text += c.text
        finish.append(c.finish_reason)
    assert ids == want
    assert text == TOK.decode(want)
    assert finish[-1] == "length" and all(f is None for f in finish[:-1])
    # the raw stream: one chunk per token here, the first names the prompt ids, then [DONE]
    events = sse_events(
        server.url,
        "/v1/completions",
        {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True, "ignore_eos": True},
    )
    assert [t for e in events for t in e["choices"][0]["token_ids"]] == want
    assert events[0]["prompt_token_ids"] == prompt and "prompt_token_ids" not in events[1]
    assert {e["id"] for e in events} == {events[0]["id"]}


def test_text_prompt_uses_byte_fallback(client, reference):
    r = client.completions.create(model=MODEL, prompt="héllo", max_tokens=6, temperature=0)
    prompt_ids = [b + 2 for b in "héllo".encode()]
    assert r.model_extra["prompt_token_ids"] == prompt_ids
    (want,) = reference([prompt_ids], 6)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].text == TOK.decode(want)


def test_chat_ids_equal_engine_generate(client, reference, server):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    prompt = TOK.render_chat(messages)
    assert prompt == TOK.encode("<|system|>\nbe brief\n<|user|>\nhi there\n<|assistant|>\n")
    (want,) = reference([prompt], 8, ignore_eos=True)
    r = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    c = r.choices[0]
    assert c.model_extra["token_ids"] == want
    assert c.message.role == "assistant" and c.message.content == TOK.decode(want)
    assert c.finish_reason == "length" and r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(prompt) and r.usage.total_tokens == len(prompt) + 8
    # streaming, with usage: role chunk, content chunks, usage chunk
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_completion_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    body = [ch for ch in chunks if ch.choices]
    assert [t for ch in body for t in ch.choices[0].model_extra["token_ids"]] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in body) == TOK.decode(want)
    assert body[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8


def test_concurrent_requests_batch_and_match(server, reference):
    prompts = [[7 + i, 40 + i, 90 + 2 * i] * (1 + i % 3) for i in range(8)]
    want = reference(prompts, 12, ignore_eos=True)

    async def go() -> list[list[int]]:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0) as c:

            async def one(p: list[int]) -> list[int]:
                r = await c.completions.create(
                    model=MODEL, prompt=p, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
                )
                return r.choices[0].model_extra["token_ids"]

            return list(await asyncio.gather(*(one(p) for p in prompts)))

    assert asyncio.run(go()) == want
    wait_idle(server.url)


def test_sampling_is_seeded(client):
    kw = dict(
        model=MODEL,
        prompt=[9, 8, 7],
        max_tokens=8,
        temperature=0.9,
        top_p=0.9,
        seed=1234,
        extra_body={"ignore_eos": True, "top_k": 50},
    )
    a = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    b = client.completions.create(**kw).choices[0].model_extra["token_ids"]
    assert a == b and len(a) == 8


def test_stop_token_ids_and_stop_strings(client, reference):
    prompt = PROMPTS[0]
    (ids,) = reference([prompt], 12, ignore_eos=True)
    stop_id = ids[4]
    cut = ids.index(stop_id) + 1  # the first occurrence ends it, and is included
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]},
    )
    assert r.choices[0].model_extra["token_ids"] == ids[:cut] and r.choices[0].finish_reason == "stop"
    # a stop string: the text ends before it (streaming and not)
    text = TOK.decode(ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    want_text = text[: text.find(stop)]
    for stream in (False, True):
        if stream:
            chunks = list(
                client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=12,
                    temperature=0,
                    stop=[stop],
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
            )
            got = "".join(ch.choices[0].text for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop, extra_body={"ignore_eos": True}
            )
            got, reason = r.choices[0].text, r.choices[0].finish_reason
        assert got == want_text and reason == "stop"


def test_models_health_metrics(client, server, reference):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert models.data[0].model_extra["max_model_len"] == NUM_PAGES * PAGE_SIZE
    h = wait_idle(server.url)
    assert h["ok"] is True and h["backend"] == "colocated" and h["elide"] is True
    assert h["pages_total"] == NUM_PAGES and h["capacity_tokens"] == NUM_PAGES * PAGE_SIZE
    before = scrape(server.url)
    r = client.completions.create(
        model=MODEL, prompt=[4, 5, 6], max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.choices[0].model_extra["token_ids"] == reference([[4, 5, 6]], 5, ignore_eos=True)[0]
    m = scrape(server.url)
    assert m["dsakv_requests_total"] == before["dsakv_requests_total"] + 1
    assert m["dsakv_prompt_tokens_total"] == before["dsakv_prompt_tokens_total"] + 3
    assert m["dsakv_generation_tokens_total"] == before["dsakv_generation_tokens_total"] + 5
    assert (
        m['dsakv_requests_finished_total{reason="length"}']
        == before['dsakv_requests_finished_total{reason="length"}'] + 1
    )
    assert m["dsakv_time_to_first_token_seconds_count"] == before["dsakv_time_to_first_token_seconds_count"] + 1
    assert m["dsakv_time_per_output_token_seconds_count"] == before["dsakv_time_per_output_token_seconds_count"] + 1
    assert m['dsakv_time_to_first_token_seconds_bucket{le="+Inf"}'] == m["dsakv_time_to_first_token_seconds_count"]
    assert m["dsakv_requests_running"] == 0 and m["dsakv_requests_failed_total"] == 0
    assert m["dsakv_pool_pages_total"] == NUM_PAGES and m["dsakv_pool_pages_used"] == 0
    assert m["dsakv_pool_pages_free"] == NUM_PAGES and m["dsakv_capacity_tokens"] == NUM_PAGES * PAGE_SIZE
    assert m["dsakv_kv_bytes_per_token"] == 4480 and m["dsakv_elide"] == 1  # tiny, fp32, 5 producers of 12
    assert m["dsakv_engine_generated_tokens_total"] >= m["dsakv_generation_tokens_total"]
    assert m['dsakv_backend_info{backend="colocated"}'] == 1
    assert not any(k.startswith("dsakv_prefix_cache") for k in m)  # no prefix cache on this engine


def test_client_disconnect_aborts_and_frees_pages(server):
    before = scrape(server.url)
    body = {"prompt": [5, 6, 7], "max_tokens": 900, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        got = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                got += 1
            if got == 3:
                break  # leave: the connection closes with 897 tokens to go
    h = wait_idle(server.url)
    assert h["pages_used"] == 0
    m = scrape(server.url)
    aborted = m.get('dsakv_requests_finished_total{reason="abort"}', 0)
    assert aborted == before.get('dsakv_requests_finished_total{reason="abort"}', 0) + 1
    assert m["dsakv_generation_tokens_total"] - before["dsakv_generation_tokens_total"] < 900


def test_prefix_cache_counters_on_metrics(reference):
    first = list(range(100, 140))  # 40 tokens: 2 full pages of 16 + 8
    second = first + list(range(200, 210))
    want = reference([first, second], 5, ignore_eos=True)
    with live_server(make_engine(enable_prefix_cache=True)) as (srv, _):
        got = []
        for p in (first, second):
            body = {"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
            got.append(httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"])
        assert got == want
        m = scrape(srv.url)
    # the second request found the first's 2 full pages (first + 4 outputs = 44 tokens cached as 32)
    assert m["dsakv_prefix_cache_lookups"] == 2
    assert m["dsakv_prefix_cache_lookup_tokens"] == 39 + 49
    assert m["dsakv_prefix_cache_hit_tokens_total"] == 32 and m["dsakv_prefix_cache_device_hit_tokens"] == 32
    assert m["dsakv_prefix_cache_hit_rate"] == 32 / 88
    # the cache holds its full pages and no request does: second + 4 outputs = 54 tokens = 3 full pages, 2 shared
    assert m["dsakv_pool_pages_used"] == 3
    assert m["dsakv_requests_running"] == 0 and m["dsakv_engine_running"] == 0
