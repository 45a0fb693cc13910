"""The OpenAI API's logprobs, echo, n, penalties and usage in disaggregated serving.

In process: a DecodeWorker (real engine, local backend) forks an n = 4 request onto the prompt pages one prefill
transfer filled (exact pages and refcounts), its events carry each choice, the first token's logprobs, the
prompt's and the prefill's cache hit, and an abort before the KV arrived leaves nothing queued.

Over HTTP: one cluster of real processes for the module -- a decode worker, a PP=2 prefill (the last stage
computes the prompt logprobs and samples the first token) and a PP=1 prefill, both with a prefix cache, over
mooncake -- behind a router each, served by the HTTP app. Logprobs equal log_softmax of transformers' logits
(completions with echo, a two-chunk prompt, chat, streaming; within 1e-4), penalties and seeded sampling equal
the colocated engine's tokens, n = 4 reproduces per seed with one prefill transfer, usage's cached_tokens is
the prefill's exact prefix-cache hit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.config import DecodeConfig
from dsakv.disagg.decode.worker import DecodeWorker
from dsakv.disagg.protocol.messages import Abort, Hello, Prealloc, StageDone, WireLogprobs, fetch_health
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.request import SamplingParams, TokenLogprobs
from dsakv.serve.app import create_app
from dsakv.serve.tokenizer import load_tokenizer
from dsakv.testing.cluster import PAGE_SIZE, Cluster, assert_clean, role_config, wait_for
from dsakv.testing.engines import _hf, tiny_model, tiny_path
from dsakv.testing.servers import MODEL, LiveServer, make_engine, sse_events

pytestmark = [pytest.mark.timeout(300)]

TOL = 1e-4
TOK = load_tokenizer(tiny_path("glm_moe_dsa"), 512)
PROMPT = "The quick brown fox jumps over the lazy dog. The key-value cache holds"


# ---- in process: the decode worker's n > 1 fork --------------------------------------------------------------


def _decode() -> DecodeWorker:
    model = tiny_model("glm_moe_dsa")
    engine = dict(kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE, num_pages=24)
    dec = DecodeWorker(DecodeConfig(model="", config=role_config(engine)), model)
    spec, mdl = model
    lay = mdl.layout_for(elide=True, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    be = make_backend("local")
    be.register(DevicePool(lay, 2).regions())
    manifest = Manifest.from_pool(DevicePool(lay, 2), be.meta()).to_bytes()
    dec._rpc_handshake(Hello("P", 0, 1, "127.0.0.1:1", manifest, boot="b0"))
    be.close()
    return dec


def test_decode_forks_n4_onto_one_transfer_and_aborts_every_choice():
    dec = _decode()
    eng, alloc = dec.engine, dec.engine.allocator
    prompt = list(range(2, 42))  # 40 tokens: pages 0-1 whole, the last prompt token in page 2
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=5, n=4, logprobs=2, prompt_logprobs=1)
    got = dec.prealloc(Prealloc("r#1", prompt, params, "P", 1, 10.0))
    assert len(got.pages) == 3 and alloc.num_used == 3  # the prompt + its first token, once
    assert sorted(eng.scheduler.unforked) == ["r#1/1", "r#1/2", "r#1/3"]
    first = TokenLogprobs(7, -1.5, ((7, -1.5), (9, -2.0)))
    plps = [TokenLogprobs(t, -0.25 * t, ((t, -0.25 * t),)) for t in prompt[1:]]
    done = StageDone("r#1", "P", 0, True, None, 0.0, 100, 7, WireLogprobs.pack([first]), WireLogprobs.pack(plps), 32,
                     boot="b0", grant=got.grant)  # fmt: skip
    assert dec.stage_done(done).started
    shared = got.pages[:2]
    assert alloc.refcount[shared].tolist() == [4, 4] and alloc.num_used == 3  # forks hold references only
    dec.step_once()  # every fork recomputes the prompt's last partial page (8 tokens) in a page of its own
    assert alloc.num_used == 3 + 3  # vs 4 x 3 = 12 pages for four separate requests
    while eng.has_unfinished():
        dec.step_once()
    rows = dec.events.since(0).events
    assert {r.rid for r in rows} == {"r#1"}
    assert sorted(r.choice for r in rows if r.finished) == [0, 1, 2, 3]
    assert [len([t for r in rows if r.choice == i for t in r.tokens]) for i in range(4)] == [4] * 4
    head = rows[0]
    assert head.choice == 0 and head.tokens == [7] and head.cached_tokens == 32
    assert head.logprobs is not None and head.logprobs.unpack() == (first,)
    assert head.prompt_logprobs is not None and head.prompt_logprobs.unpack() == tuple(plps)
    for r in rows:  # every token's logprobs travel with it
        assert r.tokens and r.logprobs is not None and r.logprobs.token_ids == r.tokens
    assert all(r.prompt_logprobs is None for r in rows[1:])
    assert alloc.num_used == 0 and dec.integrity() == "ok" and not dec.outputs.tracked()
    # an n = 4 request aborted while its KV is in flight: its forks are aborted with it, none is queued
    got = dec.prealloc(Prealloc("r#2", prompt, params, "P", 1, 10.0))
    assert dec.abort(Abort("r#2", "client left"))
    dec.stage_done(
        StageDone("r#2", "P", 0, False, "aborted", boot="b0", grant=got.grant)
    )  # the stage reports: the pages may go
    assert not eng.has_unfinished() and alloc.num_used == 0 and dec.integrity() == "ok"
    dec.backend.close()


# ---- over HTTP: one cluster, a PP=2 and a PP=1 prefill ------------------------------------------------------


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("disagg-api"))
    servers: dict[str, LiveServer] = {}
    try:
        dec = cluster.decode("decode", "mooncake", True)
        pre = {
            "pp2": cluster.prefill("pp2", "mooncake", True, (7, 5), extra=["--prefix-cache"]),
            "pp1": cluster.prefill("pp1", "mooncake", True, (12,), extra=["--prefix-cache"]),
        }
        cluster.wait_healthy([dec, *pre["pp2"], *pre["pp1"]], timeout=180)
        for name, stages in pre.items():
            router = cluster.router([stages[0].addr], [dec.addr])
            assert router.wait_ready(60), router.health()
            servers[name] = LiveServer(create_app(router, MODEL, TOK)).start()
        yield {"decode": dec.addr, "prefill": {k: v[0].addr for k, v in pre.items()}, "servers": servers}
    finally:
        for srv in servers.values():
            srv.stop()
        cluster.close()


@pytest.fixture(params=["pp2", "pp1"])
def pd(request, world) -> Iterator[tuple[str, str, str]]:
    """(HTTP url, prefill stage 0, decode) of one topology; every worker idle and balanced after the test."""
    yield world["servers"][request.param].url, world["prefill"][request.param], world["decode"]
    assert_clean([world["decode"]])


def hf_logprobs(ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(_hf("glm_moe_dsa")(torch.tensor([ids])).logits[0].float(), -1)


def post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _check_prompt_and_output(lp: dict[str, Any], ids: list[int], k: int) -> None:
    """Completions logprobs of prompt + output `ids` (echo) against transformers."""
    ref = hf_logprobs(ids)
    assert lp["tokens"] == [TOK.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None  # the first prompt token: null
    for i in range(1, len(ids)):  # token i from the logits at position i - 1
        assert abs(lp["token_logprobs"][i] - ref[i - 1, ids[i]].item()) < TOL, i
        top = lp["top_logprobs"][i]
        vals, idx = ref[i - 1].topk(k)
        want = {TOK.decode([t]): v for t, v in zip(idx.tolist(), vals.tolist(), strict=True)}
        assert set(want) <= set(top) and len(top) <= k + 1, i
        assert all(abs(top[s] - v) < TOL for s, v in want.items()), i


def test_completion_echo_logprobs_equal_transformers(pd):
    url, _, _ = pd
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 3, "ignore_eos": True}
    r = post(url, "/v1/completions", body)
    (c,) = r["choices"]
    p_ids, out = r["prompt_token_ids"], c["token_ids"]
    assert p_ids == TOK.encode(PROMPT) and len(out) == 5 and c["text"] == PROMPT + TOK.decode(out)
    _check_prompt_and_output(c["logprobs"], p_ids + out, 3)
    ref = hf_logprobs(p_ids + out)
    assert out == [int(ref[i - 1].argmax()) for i in range(len(p_ids), len(p_ids) + 5)]  # greedy: the best each
    assert r["usage"] == {
        "prompt_tokens": len(p_ids),
        "completion_tokens": 5,
        "total_tokens": len(p_ids) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},  # prompt logprobs compute every position
    }
    # echo only (max_tokens 0, what loglikelihood harnesses send): the prompt and its logprobs
    z = post(url, "/v1/completions", {**body, "max_tokens": 0, "logprobs": 0})
    (zc,) = z["choices"]
    assert zc["text"] == PROMPT and zc["token_ids"] == [] and z["usage"]["completion_tokens"] == 0
    assert zc["logprobs"]["token_logprobs"][1:] == pytest.approx(
        c["logprobs"]["token_logprobs"][1 : len(p_ids)], abs=TOL
    )
    # streamed: the same tokens, offsets and logprobs
    events = sse_events(url, "/v1/completions", {"model": MODEL, **body, "stream": True})
    text, lps, toks, offs = "", [], [], []
    for ev in events:
        for ch in ev["choices"]:
            text += ch["text"]
            if ch["logprobs"]:
                lps += ch["logprobs"]["token_logprobs"]
                toks += ch["logprobs"]["tokens"]
                offs += ch["logprobs"]["text_offset"]
    assert text == c["text"] and toks == c["logprobs"]["tokens"] and offs == c["logprobs"]["text_offset"]
    assert lps[0] is None and lps[1:] == pytest.approx(c["logprobs"]["token_logprobs"][1:], abs=1e-6)


def test_two_chunk_prompt_logprobs_equal_transformers(pd):
    """300 prompt tokens > max-batch-tokens 256: the prefill computes the prompt in two chunks, and position 255's
    logits (in chunk 0) give token 256 (in chunk 1)."""
    url, _, _ = pd
    prompt = torch.randint(2, 512, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    r = post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 1})
    (c,) = r["choices"]
    _check_prompt_and_output(c["logprobs"], prompt + c["token_ids"], 1)


def test_chat_logprobs_equal_transformers(pd):
    url, _, _ = pd
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    with openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120) as client:
        r = client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=msgs,
                max_tokens=6,
                temperature=0,
                logprobs=True,
                top_logprobs=2,
                stream=True,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
        )
    c = r.choices[0]
    n = len(r.model_extra["prompt_token_ids"])
    ids = r.model_extra["prompt_token_ids"] + c.model_extra["token_ids"]
    ref = hf_logprobs(ids)
    content = c.logprobs.content
    assert len(content) == 6 and c.message.content == TOK.decode(ids[n:])
    for i, e in enumerate(content):
        t = ids[n + i]
        assert e.token == TOK.decode([t]) and abs(e.logprob - ref[n + i - 1, t].item()) < TOL
        assert bytes(e.bytes) == TOK.token_bytes(t)
        assert [x.token for x in e.top_logprobs] == [TOK.decode([j]) for j in ref[n + i - 1].topk(2).indices.tolist()]
        assert [x.logprob for x in e.top_logprobs] == pytest.approx(ref[n + i - 1].topk(2).values.tolist(), abs=TOL)
    streamed = [e for ch in chunks for x in ch.choices if x.logprobs for e in x.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-6)
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == 6


def test_n4_forks_on_decode_one_transfer_and_reproduces_per_seed(pd):
    url, prefill, decode = pd
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 11, "ignore_eos": True, "logprobs": 1}
    before_d, before_p = fetch_health(decode).counters, fetch_health(prefill).counters
    r = post(url, "/v1/completions", {**body, "n": 4})
    after_d, after_p = fetch_health(decode).counters, fetch_health(prefill).counters
    assert after_p["submitted"] - before_p["submitted"] == 1  # the prompt is prefilled once
    assert after_d["prealloc"] - before_d["prealloc"] == 1 and after_d["started"] - before_d["started"] == 1
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    got = [c["token_ids"] for c in r["choices"]]
    assert len({tuple(g) for g in got}) > 1
    p_ids = TOK.encode(PROMPT)
    sp = [SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=1.0, seed=11 + i) for i in range(4)]
    assert got == make_engine().generate([p_ids] * 4, sp)  # choice i == colocated with seed + i
    for i in range(4):  # ... and == a PD request of its own with seed + i
        one = post(url, "/v1/completions", {**body, "seed": 11 + i})
        assert one["choices"][0]["token_ids"] == got[i]
        assert one["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(
            r["choices"][i]["logprobs"]["token_logprobs"], abs=TOL
        )
    assert r["usage"]["prompt_tokens"] == len(p_ids) and r["usage"]["completion_tokens"] == 20
    # streamed: every choice's chunks carry its index and end with its finish_reason
    events = sse_events(url, "/v1/completions", {"model": MODEL, **body, "n": 4, "stream": True})
    pieces = [ch for ev in events for ch in ev["choices"]]
    assert [[t for ch in pieces if ch["index"] == i for t in ch["token_ids"]] for i in range(4)] == got
    assert sorted(ch["index"] for ch in pieces if ch["finish_reason"] == "length") == [0, 1, 2, 3]
    # a stop string ends each choice on its own (the router aborts that choice on decode; pd checks nothing leaks)
    greedy = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    text = post(url, "/v1/completions", greedy)["choices"][0]["text"]
    stop = text[10:14]
    s = post(url, "/v1/completions", {**greedy, "n": 2, "stop": [stop]})
    assert [c["finish_reason"] for c in s["choices"]] == ["stop", "stop"]
    assert [c["text"] for c in s["choices"]] == [text[: text.index(stop)]] * 2


def test_penalties_min_tokens_bias_and_seeds_equal_colocated(pd):
    url, _, _ = pd
    ids = TOK.encode(PROMPT)
    eos = 1
    # eos pushed up by +100 but masked for min_tokens 3: the first three tokens (the first sampled on the prefill's
    # last stage) avoid it, the fourth is eos; penalties shape the rest
    plain = make_engine().generate([ids], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    cases = [
        {"temperature": 0, "logit_bias": {str(eos): 100}, "min_tokens": 3, "repetition_penalty": 1.3},
        # the greedy first token banned (the prefill's last stage samples it): the output must change
        {"temperature": 0, "presence_penalty": 2.0, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
         "logit_bias": {str(plain[0]): -100}, "ignore_eos": True},
        {"temperature": 0.8, "top_k": 40, "seed": 99, "presence_penalty": 1.5, "frequency_penalty": 0.5,
         "logit_bias": {"7": 5.0}, "ignore_eos": True},
    ]  # fmt: skip
    wants = []
    for case in cases:
        kw = {k: v for k, v in case.items() if k != "logit_bias"}
        bias = {int(t): float(b) for t, b in case.get("logit_bias", {}).items()}
        sp = SamplingParams(max_new_tokens=8, logit_bias=bias, **kw)
        want = make_engine().generate([ids], sp)[0]
        r = post(url, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, **case})
        assert r["choices"][0]["token_ids"] == want, case
        assert r["usage"]["completion_tokens"] == len(want)
        assert r["choices"][0]["finish_reason"] == ("stop" if case is cases[0] else "length")
        wants.append(want)
    assert len(wants[0]) == 4 and wants[0][-1] == eos and eos not in wants[0][:3]  # min_tokens held eos back
    assert wants[1][0] != plain[0]


def test_cached_tokens_are_the_prefill_prefix_hit(pd):
    url, prefill, _ = pd
    g = torch.Generator().manual_seed(21)  # each topology has its own prefill (and prefix cache)
    shared = torch.randint(2, 512, (40,), generator=g).tolist()
    a = shared + torch.randint(2, 512, (10,), generator=g).tolist()
    b = shared + torch.randint(2, 512, (7,), generator=g).tolist()
    ra = post(url, "/v1/completions", {"prompt": a, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert ra["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    wait_for(lambda: fetch_health(prefill).awaiting_release == 0, 20, "prefill released request a")
    rb = post(url, "/v1/completions", {"prompt": b, "max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert rb["usage"] == {
        "prompt_tokens": 47,
        "completion_tokens": 3,
        "total_tokens": 50,
        "prompt_tokens_details": {"cached_tokens": 2 * PAGE_SIZE},  # the 40 shared tokens' two whole pages
    }
    want = make_engine().generate([b], SamplingParams(max_new_tokens=3, ignore_eos=True))[0]
    assert rb["choices"][0]["token_ids"] == want
