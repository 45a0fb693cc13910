"""One request can never fail a batch (issue 26, finding 2): each poison sampling value (unit checks in
tests/unit/engine/test_sampling_poisons.py) batched with 4 normal requests, and a row that does fail (NaN
logits, HiSparse admission), fails or finishes alone while the requests batched with it return exactly their
solo tokens, colocated on the plain, HiSparse and MTP engines; the pool's pages come back (integrity checked
after every step)."""

from __future__ import annotations

import concurrent.futures
import math
from collections.abc import Sequence
from typing import Any

import httpx
import pytest
import torch

from dsakv.cache.hisparse import HiSparsePool
from dsakv.engine.engine import Engine
from dsakv.engine.model_runner import ModelRunner
from dsakv.engine.request import SamplingParams
from dsakv.errors import CapacityError, ConfigError
from dsakv.model.loader import load_draft, load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.engines import flat_engine, prompts_for, tiny_model
from dsakv.testing.servers import MODEL, live_server, make_engine

NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.9, seed=11)
NORMALS = (GREEDY, GREEDY, GREEDY, SAMPLED)  # the 4 requests batched with each poison
PROMPTS = prompts_for([9, 17, 23, 30, 12], seed=5)  # 4 normal prompts, then the poison's


def _poisons(logprobs: bool) -> dict[str, SamplingParams]:
    lp: dict[str, Any] = {"logprobs": 3} if logprobs else {}
    base: dict[str, Any] = {"max_new_tokens": NEW, "ignore_eos": True, "seed": 1, **lp}
    return {
        "temperature_1e-40": SamplingParams(**base, temperature=1e-40),  # fp32 underflow: 1e-40 is denormal
        "temperature_1e-300": SamplingParams(**base, temperature=1e-300),  # 0 in fp32
        "top_p_1e-300": SamplingParams(**base, temperature=1.0, top_p=1e-300),
        "repetition_penalty_1e-300": SamplingParams(**base, temperature=0.8, repetition_penalty=1e-300),
    }


GREEDY_EQUIVALENT = {"temperature_1e-40", "temperature_1e-300", "top_p_1e-300"}  # a point mass on the argmax


def _finite(lps: Any) -> bool:
    return all(math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top) for lp in lps if lp is not None)


# ---- engines: each poison with 4 normal requests ------------------------------------------------------------


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any, Any]:
    ckpt = make_tiny(tmp_path_factory.mktemp("iso-mtp"), seed=0, mtp=1)
    return load_model(ckpt), load_draft(ckpt), ckpt


def _engine(kind: str, mtp_model: Any = None, **kw: Any) -> Engine:
    kw.setdefault("check_every_step", True)
    if kind == "mtp":
        model, draft, ckpt = mtp_model
        return flat_engine(
            model, page_size=16, num_pages=64, speculative_num_steps=2, draft=draft, model_dir=ckpt, **kw
        )
    if kind == "hisparse":
        return flat_engine(
            tiny_model("glm_moe_dsa"),
            page_size=16,
            num_pages=96,
            hisparse=True,
            hisparse_device_buffer_size=16,
            hisparse_host_to_device_ratio=8,
            **kw,
        )
    return flat_engine(tiny_model("glm_moe_dsa"), page_size=16, num_pages=64, **kw)


def _run(eng: Engine, items: Sequence[tuple[str, Sequence[int], SamplingParams]]) -> dict[str, tuple]:
    """Add every request at once, step to the end; per request (tokens, finish reason, error, logprobs)."""
    for rid, prompt, params in items:
        eng.add_request(prompt, params, request_id=rid)
    out: dict[str, tuple] = {}
    lps: dict[str, list] = {}
    steps = 0
    while eng.has_unfinished():
        steps += 1
        assert steps < 500, "the engine did not finish"
        for o in eng.step():
            lps.setdefault(o.request_id, []).extend(o.new_logprobs)
            if o.finished:
                out[o.request_id] = (list(o.output_ids), str(o.finish_reason), o.error, lps[o.request_id])
    eng.check_integrity()
    assert eng.allocator.num_free == eng.allocator.num_pages, "pages are back to the baseline (all free)"
    return out


def _solo(kind: str, mtp_model: Any, prompt: Sequence[int], params: SamplingParams) -> tuple:
    return _run(_engine(kind, mtp_model), [("solo", prompt, params)])["solo"]


@pytest.mark.parametrize("kind", ["plain", "hisparse", "mtp"])
def test_each_poison_with_four_normal_requests(kind: str, mtp_model: Any) -> None:
    normals = [(f"n{i}", PROMPTS[i], p) for i, p in enumerate(NORMALS)]
    solo = {rid: _solo(kind, mtp_model, prompt, p)[:3] for rid, prompt, p in normals}
    assert all(s[1] == "length" and len(s[0]) == NEW for s in solo.values())
    greedy_solo = _solo(kind, mtp_model, PROMPTS[4], GREEDY)[0]
    for name, poison in _poisons(logprobs=kind != "mtp").items():
        got = _run(_engine(kind, mtp_model), [*normals, ("poison", PROMPTS[4], poison)])
        for rid, *_ in normals:
            assert got[rid][:3] == solo[rid], (kind, name, rid)
        toks, reason, error, lps = got["poison"]
        assert (reason, error, len(toks)) == ("length", None, NEW), (kind, name, got["poison"])
        assert toks == _solo(kind, mtp_model, PROMPTS[4], poison)[0], (kind, name)  # its own tokens, batched or not
        if name in GREEDY_EQUIVALENT:
            assert toks == greedy_solo, (kind, name)
        assert _finite(lps) and (kind == "mtp" or len(lps) == NEW), (kind, name, lps)
    # stop_token_ids covering the vocabulary under min_tokens: refused on add, naming the values; nothing queued
    eng = _engine(kind, mtp_model)
    cover = SamplingParams(
        max_new_tokens=NEW, temperature=1.0, min_tokens=3, stop_token_ids=tuple(range(eng.spec.vocab_size))
    )
    with pytest.raises(ConfigError, match=r"request cover: stop_token_ids .* cover all \d+ tokens"):
        eng.add_request(PROMPTS[4], cover, request_id="cover")
    assert not eng.has_unfinished()
    got = _run(eng, normals)
    assert {rid: v[:3] for rid, v in got.items()} == solo


class _NaNRows:
    """The real runner, with the logits of one request's row set to NaN from its `after`-th output token on (a
    model fault confined to one sequence)."""

    def __init__(self, inner: Any, victim: str, after: int) -> None:
        self.inner, self.victim, self.after = inner, victim, after

    def __getattr__(self, name: str) -> Any:
        if name == "run_with_prompt_logits":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def run(self, chunks: Sequence[Any]) -> torch.Tensor:
        logits = self.inner.run(chunks).clone()
        for b, c in enumerate(chunks):
            if c.request.request_id == self.victim and c.request.num_output_tokens >= self.after:
                logits[b, ::3] = float("nan")
        return logits


@pytest.mark.parametrize("kind", ["plain", "hisparse"])
def test_nan_logits_of_one_row_fail_that_request_alone(kind: str) -> None:
    normals = [(f"n{i}", PROMPTS[i], p) for i, p in enumerate(NORMALS)]
    solo = {rid: _solo(kind, None, prompt, p)[:3] for rid, prompt, p in normals}
    eng = _engine(kind)
    eng.runner = _NaNRows(eng.runner, "victim", after=2)
    got = _run(eng, [*normals, ("victim", PROMPTS[4], SAMPLED)])
    assert {rid: got[rid][:3] for rid, *_ in normals} == solo
    toks, reason, error, _ = got["victim"]
    assert reason == "error" and len(toks) == 2 and "NaN at" in error, got["victim"]
    assert eng.stats().pages_free == eng.allocator.num_pages


def test_hisparse_n_above_the_hot_buffers_is_refused_and_n_within_waits_its_turn() -> None:
    eng = _engine("hisparse")
    hot = eng.scheduler.max_running_requests
    assert eng.hisparse is not None and hot == eng.hisparse.max_requests == 6
    with pytest.raises(ConfigError, match=rf"n = 64 sequences need a HiSparse hot buffer each.* at most {hot}"):
        eng.add_request(PROMPTS[4], SamplingParams(max_new_tokens=NEW, n=64), request_id="n64")
    assert not eng.has_unfinished()
    # 4 running + an n = 4 request: its 4 sequences never take more hot buffers than there are (they wait)
    normals = [(f"n{i}", PROMPTS[i], p) for i, p in enumerate(NORMALS)]
    solo = {rid: _solo("hisparse", None, prompt, p)[:3] for rid, prompt, p in normals}
    greedy_solo = _solo("hisparse", None, PROMPTS[4], GREEDY)[0]
    for rid, prompt, p in normals:
        eng.add_request(prompt, p, request_id=rid)
    eng.step()  # the 4 are running
    got = _run(eng, [("fan", PROMPTS[4], SamplingParams(max_new_tokens=NEW, ignore_eos=True, n=4))])
    finals: dict[str, tuple] = {}
    finals.update(got)
    # _run collected the 4 normals too (they finished in its steps)
    assert {rid: finals[rid][:3] for rid, *_ in normals} == solo
    for rid in ("fan", "fan/1", "fan/2", "fan/3"):
        assert finals[rid][:3] == (greedy_solo, "length", None), rid


def test_hisparse_prepare_fails_only_the_rows_without_a_hot_buffer() -> None:
    eng = _engine("hisparse")
    pool = eng.hisparse
    assert isinstance(pool, HiSparsePool)
    hot = pool.max_requests
    pages = [[2 * i, 2 * i + 1] for i in range(hot + 2)]
    entries = [(f"r{i}", p, 0, 20) for i, p in enumerate(pages)]
    failed = pool.prepare(entries, [])
    assert sorted(failed) == [hot, hot + 1]
    assert all(isinstance(e, CapacityError) for e in failed.values())
    assert "no free HiSparse hot buffer for request 'r6'" in str(failed[hot])
    assert pool.num_admitted == hot
    rows = pool._step
    assert rows is not None and list(rows.rids) == [f"r{i}" for i in range(hot)]
    assert sorted(rows.blocks.tolist()) == list(range(hot))
    blocks = rows.blocks.tolist()
    # the next step of the admitted rows: nothing fails and each keeps its hot buffer (the failed ones were released)
    assert pool.prepare([(r, p, 20, 21) for r, p, _, _ in entries[:hot]], []) == {}
    assert pool._step is not None and pool._step.blocks.tolist() == blocks and pool.num_admitted == hot


def test_plain_model_runner_is_unchanged_by_the_wrapper() -> None:
    """The fault-injection wrapper runs the engine's own runner: without a victim the tokens are the engine's."""
    eng = _engine("plain")
    assert isinstance(eng.runner, ModelRunner)
    ref = eng.generate([PROMPTS[0]], GREEDY)[0]
    eng2 = _engine("plain")
    eng2.runner = _NaNRows(eng2.runner, "nobody", after=0)
    assert eng2.generate([PROMPTS[0]], GREEDY)[0] == ref


def test_http_each_poison_with_four_concurrent_normal_requests() -> None:
    """Over the colocated OpenAI API (a live server): each poison gets 200 with finite logprobs (it was a 500
    "Out of range float values", or every co-batched request failed) or a 400 naming the values; the 4 normal
    requests sent with it return exactly their solo tokens; no page is held afterwards."""

    def body(prompt: Sequence[int], **kw: Any) -> dict[str, Any]:
        return {"model": MODEL, "prompt": list(prompt), "max_tokens": NEW, "ignore_eos": True, **kw}

    normal = [
        body(PROMPTS[i], temperature=0) if i < 3 else body(PROMPTS[i], temperature=0.9, seed=11) for i in range(4)
    ]
    poisons = {
        "temperature_1e-40": body(PROMPTS[4], temperature=1e-40, logprobs=5),
        "top_p_1e-300": body(PROMPTS[4], temperature=1.0, top_p=1e-300, seed=1, logprobs=5),
        "repetition_penalty_1e-300": body(PROMPTS[4], temperature=0.8, repetition_penalty=1e-300, seed=1, logprobs=5),
    }
    eng = make_engine()
    vocab = eng.spec.vocab_size
    cover = body(PROMPTS[4], temperature=1.0, min_tokens=3, stop_token_ids=list(range(vocab)))
    with live_server(eng) as (srv, _), httpx.Client(base_url=srv.url, timeout=120) as c:

        def post(b: dict[str, Any]) -> httpx.Response:
            return c.post("/v1/completions", json=b)

        solo = [post(b).json()["choices"][0]["token_ids"] for b in normal]
        greedy = post(body(PROMPTS[4], temperature=0)).json()["choices"][0]["token_ids"]
        with concurrent.futures.ThreadPoolExecutor(5) as pool:
            for name, poison in [*poisons.items(), ("cover", cover)]:
                futs = [pool.submit(post, b) for b in [poison, *normal]]
                r, *rest = [f.result() for f in futs]
                assert [x.json()["choices"][0]["token_ids"] for x in rest] == solo, name
                if name == "cover":
                    assert r.status_code == 400 and "cover all" in r.json()["error"]["message"], r.text
                    continue
                assert r.status_code == 200, (name, r.text)
                (choice,) = r.json()["choices"]
                assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == NEW, name
                lps = choice["logprobs"]
                assert all(math.isfinite(v) for v in lps["token_logprobs"]), (name, lps)
                assert all(math.isfinite(v) for top in lps["top_logprobs"] for v in top.values()), (name, lps)
                if name != "repetition_penalty_1e-300":
                    assert choice["token_ids"] == greedy, name
        assert eng.stats().pages_free == eng.allocator.num_pages
