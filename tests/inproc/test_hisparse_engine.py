"""HiSparse decode through the Engine (cache/hisparse.py + the attention row-source hook).

A HiSparse engine keeps index-K of every token and a hot buffer of KV rows per request on the device, every
token's KV on the host, and each decode step swaps in only the missing top-k rows. Its greedy tokens must be
those of a plain engine (same schedule, fp32 formats) for contexts many times device_buffer_size, elision on and
off; its swap-in counters must equal a recount from the top-k the producers chose; its pools must be the
planner's bytes.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from dsakv.cache.hisparse import HiSparseStep
from dsakv.config import HiSparseConfig
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.plan.hisparse import hisparse_figures
from dsakv.spec.layout import Kind
from dsakv.testing.engines import INDEX_TOPK, drive, engine, greedy_params, prompts_for, tiny_model
from dsakv.testing.servers import live_server, scrape

# tiny GLM checkpoint: producers 0, 1, 2, 6, 10; each shared layer reuses the last producer before it
GROUPS = {0: (0,), 1: (1,), 2: (2, 3, 4, 5), 6: (6, 7, 8, 9), 10: (10, 11)}
PAGE = 4
BUFFER = INDEX_TOPK  # 16 rows: the smallest buffer, so nearly every step evicts


def run(prompts: list[list[int]], new: tuple[int, ...], **kw: object):
    eng = engine("glm_moe_dsa", page_size=PAGE, **kw)
    ids = [eng.add_request(p, greedy_params(n)) for p, n in zip(prompts, new, strict=True)]
    final = drive(eng)
    return [list(final[r].output_ids) for r in ids], eng


@pytest.mark.parametrize("elide", [True, False], ids=["elide", "dense"])
def test_tokens_identical_to_plain_decode(elide: bool) -> None:
    # contexts 130..180 tokens = 8-11x device_buffer_size; 2 hot buffers for 3 requests (the third waits), a
    # prefill budget of 48 (chunked prompts, mixed prefill + decode steps); same schedule for both engines
    prompts = prompts_for([150, 40, 110], seed=3)
    new = (30, 64, 20)
    # (1024 logical tokens / ratio 24 = 42 hot rows = 2 buffers of 16 + 4, which cap the running requests at 2)
    common = dict(elide=elide, max_tokens=1024, max_batch_tokens=48)
    plain, _ = run(prompts, new, max_running_requests=2, **common)
    hs, eng = run(
        prompts, new, hisparse=True, hisparse_device_buffer_size=BUFFER, hisparse_host_to_device_ratio=24, **common
    )
    assert hs == plain
    assert [len(t) for t in hs] == list(new)
    pool = eng.hisparse
    assert pool is not None and pool.max_requests == 2 and pool.buffer_size == BUFFER
    assert eng.scheduler.max_running_requests == 2
    idx_layers = [k.layer for k in pool.index_keys]
    assert idx_layers == (list(GROUPS) if elide else list(range(12)))
    st = pool.stats
    assert st.steps > 60 and 0 < st.hit_rate < 1
    assert sum(s.rows_in for s in st.total.values()) > 0
    assert pool.num_admitted == 0 or eng.stats().num_running == 0


def test_fp8_formats_identical_and_decode_reads_only_the_hot_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = prompts_for([120], seed=5)
    fmt = dict(kv_format="fp8-656", index_format="fp8-132", max_tokens=512)
    plain, _ = run(prompts, (48,), **fmt)
    host_reads: list[tuple[bool, int]] = []  # (decode-only step, rows) of every host KV read
    orig = HiSparseStep.read

    def counting(self: HiSparseStep, key, slots):  # type: ignore[no-untyped-def]
        if key.kind is Kind.KV:
            host_reads.append((bool((self.tok_hot).all()), int(slots.numel())))
        return orig(self, key, slots)

    monkeypatch.setattr(HiSparseStep, "read", counting)
    hs, eng = run(prompts, (48,), hisparse=True, hisparse_device_buffer_size=BUFFER, **fmt)
    assert hs == plain
    assert host_reads and all(not decode for decode, _ in host_reads)  # only the prefill read host rows
    assert eng.hisparse is not None and eng.hisparse.stats.steps == 48  # 1 prefill + 47 decode steps


def test_stats_equal_a_recount_from_the_producers_topk(monkeypatch: pytest.MonkeyPatch) -> None:
    """One request, buffer larger than its context (nothing evicted): per step and layer, rows swapped in = top-k
    positions outside the newest page that the layer's group never swapped in before. A shared layer recounted
    with any top-k but its own producer's would not match."""
    calls: list[tuple[int, torch.Tensor]] = []
    orig = HiSparseStep.on_topk

    def record(self: HiSparseStep, producer: int, topk: torch.Tensor, mla_path: str) -> None:
        calls.append((producer, topk.clone()))
        orig(self, producer, topk, mla_path)

    monkeypatch.setattr(HiSparseStep, "on_topk", record)
    eng = engine("glm_moe_dsa", page_size=PAGE, max_tokens=512, hisparse=True, hisparse_device_buffer_size=256)
    pool = eng.hisparse
    assert pool is not None
    prompt = prompts_for([90], seed=7)[0]
    rid = eng.add_request(prompt, greedy_params(30))
    resident: dict[int, set[int]] = {layer: set() for layer in range(12)}
    lookups = hits = steps = 0
    while eng.has_unfinished():
        req = eng.get_request(rid)
        assert req is not None
        length = req.num_computed_tokens + 1  # a decode step's token sits at num_computed_tokens
        calls.clear()
        eng.step()
        steps += 1
        if steps == 1:  # the prefill: one chunk, read from the host, nothing swapped in
            assert pool.stats.step == {}  # on_topk is told, swaps nothing
            continue
        assert [p for p, _ in calls] == list(GROUPS)
        newest = (length - 1) // PAGE * PAGE
        want_rows: dict[int, int] = {}
        for producer, topk in calls:
            assert topk.shape == (1, INDEX_TOPK)
            pos = {int(p) for p in topk[0] if p >= 0}
            assert max(pos) <= length - 1
            for layer in GROUPS[producer]:
                miss = {p for p in pos if p < newest and p not in resident[layer]}
                resident[layer] |= miss
                want_rows[layer] = len(miss)
                lookups += len(pos)
                hits += len(pos) - len(miss)
        assert pool.stats.step_rows() == dict(sorted(want_rows.items()))
        assert pool.stats.step_bytes() == {k: v * pool.kv_row_bytes for k, v in sorted(want_rows.items())}
        if eng.has_unfinished():
            for layer in range(12):
                assert set(pool.resident(layer, rid)) == resident[layer]
    assert steps == 30
    assert pool.stats.hit_rate == pytest.approx(hits / lookups, abs=1e-12)
    assert sum(s.rows_in for s in pool.stats.total.values()) == sum(len(r) for r in resident.values())
    assert eng.hisparse_stats()["rows_in_total"] == sum(len(r) for r in resident.values())  # type: ignore[index]


@pytest.mark.parametrize("elide", [True, False], ids=["elide", "dense"])
def test_pool_bytes_equal_planner_figures(elide: bool) -> None:
    budget = 3 << 20
    eng = engine(
        "glm_moe_dsa",
        page_size=PAGE,
        elide=elide,
        kv_budget=budget,
        hisparse=True,
        hisparse_device_buffer_size=32,
        hisparse_host_to_device_ratio=10,
    )
    fig = hisparse_figures(budget, eng.layout, 10, 32)
    pool = eng.hisparse
    assert pool is not None
    assert (pool.device_bytes, pool.host_bytes) == (fig.device_bytes, fig.host_bytes)
    assert pool.max_requests == fig.max_requests and pool.hot_rows == fig.hot_rows
    assert eng.allocator.num_pages * PAGE == fig.logical_tokens
    assert eng.stats().pool_bytes == fig.device_bytes
    assert eng.scheduler.max_running_requests == min(64, fig.max_requests or 0)
    # the tiny layout: 12 x 320 B KV; index-K 128 B on 5 producers (elided) or all 12 layers (dense)
    kv, idx = 12 * 320, (5 if elide else 12) * 128
    assert (fig.kv_bytes_per_token, fig.index_bytes_per_token) == (kv, idx)
    cell = kv + 10 * idx
    assert fig.device_tokens == budget // cell // PAGE * PAGE
    assert fig.logical_tokens == fig.device_tokens * 10 // PAGE * PAGE


def test_metrics_show_hisparse_counters() -> None:
    eng = engine("glm_moe_dsa", page_size=16, num_pages=64, hisparse=True, hisparse_device_buffer_size=BUFFER)
    with live_server(eng) as (srv, _):
        body = {"prompt": list(range(100, 190)), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{srv.url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        m = scrape(srv.url)
    st = eng.hisparse_stats()
    assert st is not None
    assert m["dsakv_hisparse_steps"] == st["steps"] == 12
    assert m["dsakv_hisparse_rows_in_total"] == st["rows_in_total"] > 0
    assert m["dsakv_hisparse_bytes_in_total"] == st["bytes_in_total"] == st["rows_in_total"] * 320
    assert m["dsakv_hisparse_hit_rate"] == pytest.approx(st["hit_rate"], abs=1e-6)
    assert m["dsakv_hisparse_device_bytes"] == m["dsakv_pool_bytes"] == st["device_bytes"]
    assert m["dsakv_hisparse_host_bytes"] == st["host_bytes"] == 64 * 16 * 12 * 320
    for layer in range(12):
        assert m[f"dsakv_hisparse_layer{layer}_rows_in_last_step"] == st["rows_in_last_step"][layer]
        assert m[f"dsakv_hisparse_layer{layer}_bytes_in_last_step"] == st["bytes_in_last_step"][layer]


def test_abort_frees_the_hot_buffer() -> None:
    eng = engine("glm_moe_dsa", page_size=PAGE, max_tokens=512, hisparse=True, hisparse_device_buffer_size=BUFFER)
    pool = eng.hisparse
    assert pool is not None
    a = eng.add_request(prompts_for([60], seed=2)[0], greedy_params(50))
    b = eng.add_request(prompts_for([30], seed=4)[0], greedy_params(5))
    for _ in range(3):
        eng.step()
    assert pool.num_admitted == 2
    eng.abort(a)
    eng.step()
    assert pool.num_admitted == 1 and b in pool._reqs
    drive(eng)
    eng.add_request([5, 6, 7], greedy_params(1))
    drive(eng)
    assert eng.allocator.num_free == eng.allocator.num_pages


def test_bad_hisparse_options_are_refused() -> None:
    with pytest.raises(ConfigError, match="index_topk 16"):
        engine("glm_moe_dsa", hisparse=True, hisparse_top_k=8)
    with pytest.raises(ConfigError, match="smaller than the top-k 16"):
        engine("glm_moe_dsa", hisparse=True, hisparse_device_buffer_size=8)
    with pytest.raises(ConfigError, match="prefix cache"):
        engine("glm_moe_dsa", hisparse=True, enable_prefix_cache=True)
    with pytest.raises(ConfigError, match="less than one request buffer"):
        engine("glm_moe_dsa", page_size=PAGE, hisparse=True, kv_budget=40_000)
    with pytest.raises(ConfigError, match="must be a number >= 1"):
        HiSparseConfig(host_to_device_ratio=0.5)
    spec, _ = tiny_model("glm_moe_dsa")
    assert HiSparseConfig(enabled=True).buffer_for(spec.index_topk) == 2 * INDEX_TOPK


def test_forks_sampling_and_prompt_logprobs_equal_plain() -> None:
    """n = 2 forks (sharing the prompt's pages, each admitted with its newest page loaded from the host), seeded
    sampling with logprobs, and prompt logprobs (the prefill read from the host KV): all as a plain engine."""
    prompt = prompts_for([75], seed=9)[0]
    sp = SamplingParams(
        max_new_tokens=20, ignore_eos=True, temperature=0.8, top_k=50, seed=7, n=2, logprobs=2, prompt_logprobs=1
    )

    def outs(**kw: object) -> list[tuple]:
        eng = engine("glm_moe_dsa", page_size=PAGE, max_tokens=512, **kw)
        eng.add_request(prompt, sp, request_id="r")
        seen = []
        while eng.has_unfinished():
            for o in eng.step():
                seen.append((o.request_id, o.new_token_ids, repr(o.new_logprobs), repr(o.prompt_logprobs)))
        return sorted(seen)

    plain = outs()
    hs = outs(hisparse=True, hisparse_device_buffer_size=BUFFER)
    assert {r for r, *_ in hs} == {"r", "r/1"} and sum(len(t) for _, t, *_ in hs) == 40
    assert any(pl != "None" for *_, pl in hs)
    assert hs == plain
