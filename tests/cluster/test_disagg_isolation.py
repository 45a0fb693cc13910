"""One request can never fail a batch, disaggregated (issue 26, finding 2): each poison sampling value sent
with 4 concurrent normal requests through a PP-2 prefill (prefix cache on) and a decode worker gets its own
result or its own error, while the 4 others return exactly their colocated solo tokens; the pipeline is never
re-formed (same epoch, the prefix cache kept: a cached prompt still hits) and no page is left held.

Real processes over mooncake: decode D, HiSparse decode DH, prefill P (PP=2, 7+5 layers, --prefix-cache), an
in-process router per decode; on DH also n = 64 (above its hot buffers: refused, the others unharmed).
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, free_ports, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import prompts_for, tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(400)]

BACKEND = "mooncake"
NEW = 5
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.9, seed=11)
NORMALS = (GREEDY, GREEDY, GREEDY, SAMPLED)
PROMPTS = prompts_for([9, 40, 23, 30, 12], seed=7)  # 4 normal prompts, then the poison's
_BASE: dict[str, Any] = {"max_new_tokens": NEW, "ignore_eos": True, "seed": 1, "logprobs": 3}
POISONS = {
    "temperature_1e-40": SamplingParams(**_BASE, temperature=1e-40),
    "top_p_1e-300": SamplingParams(**_BASE, temperature=1.0, top_p=1e-300),
    "repetition_penalty_1e-300": SamplingParams(**_BASE, temperature=0.8, repetition_penalty=1e-300),
}
GREEDY_EQUIVALENT = {"temperature_1e-40", "top_p_1e-300"}
HISPARSE = ["--hisparse", "--hisparse-device-buffer-size", "16", "--hisparse-host-to-device-ratio", "4"]


@pytest.fixture(scope="module")
def solo():
    """Colocated solo runs (each request alone on a fresh engine): what PD must return for it."""
    cache: dict[tuple, list[int]] = {}

    def ref(prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params)
        if key not in cache:
            eng = Engine(tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES))
            cache[key] = eng.generate([prompt], params)[0]
        return cache[key]

    return ref


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("disagg-isolation"))
    mc = ["--mooncake-timeout", "5", "--rpc-timeout", "3"]
    try:
        d = cluster.decode("D", BACKEND, True, free_ports(1), extra=mc)
        dh = cluster.decode("DH", BACKEND, True, free_ports(1), extra=[*mc, *HISPARSE])
        p0, p1 = cluster.prefill("P", BACKEND, True, (7, 5), free_ports(3), extra=[*mc, "--prefix-cache"])
        cluster.wait_healthy([d, dh, p0, p1], timeout=240)
        routers = {}
        for name, dec in (("plain", d), ("hisparse", dh)):
            routers[name] = cluster.router([p0.addr], [dec.addr], kv_timeout=20.0)
            assert routers[name].wait_ready(60), routers[name].health()
        yield cluster, routers, {"plain": d, "hisparse": dh}, p0, p1
    finally:
        cluster.close()


def _collect(router, rid: str) -> tuple[list[int], str | None, str | None, list, int]:
    """(tokens, finish reason, error, logprobs, prompt tokens from the prefix cache) of one request."""
    toks: list[int] = []
    lps: list = []
    reason = error = None
    cached = 0
    for ev in router.events(rid, 60.0):
        toks += ev.new_token_ids
        lps += list(ev.logprobs)
        cached = max(cached, ev.num_cached_tokens)
        if ev.finished:
            reason, error = ev.finish_reason, ev.error
    return toks, reason, error, lps, cached


def _finite(lps: list) -> bool:
    return all(math.isfinite(lp.logprob) and all(math.isfinite(v) for _, v in lp.top) for lp in lps)


@pytest.mark.parametrize("decode", ["plain", "hisparse"])
def test_each_poison_with_four_normal_requests_through_pp_prefill_and_decode(world, solo, decode: str) -> None:
    cluster, routers, decodes, p0, p1 = world
    router, d = routers[decode], decodes[decode]
    procs = [*decodes.values(), p0, p1]
    warm = PROMPTS[1]  # 40 tokens: 2 whole pages go to the prefix cache
    router.submit(f"{decode}-warm", warm, GREEDY)
    assert _collect(router, f"{decode}-warm")[:3] == (solo(warm, GREEDY), "length", None)
    before = fetch_health(p0.addr)
    assert before.epoch is not None and (before.cache_pages or 0) >= 2, before
    poisons: dict[str, SamplingParams] = dict(POISONS)
    if decode == "hisparse":  # n above the decode's hot buffers: refused, the others unharmed
        poisons["n_64"] = SamplingParams(max_new_tokens=NEW, ignore_eos=True, n=64)
    for name, poison in poisons.items():
        rids = [f"{decode}-{name}-n{i}" for i in range(4)]
        if name == "n_64":
            for rid, prompt, p in zip(rids, PROMPTS, NORMALS, strict=False):
                router.submit(rid, prompt, p)
            try:
                router.submit(f"{decode}-{name}-poison", PROMPTS[4], poison)
            except ConfigError as e:
                assert "HiSparse hot buffer" in str(e)
            else:
                toks, reason, error, _, _ = _collect(router, f"{decode}-{name}-poison")
                assert reason == "error" and error is not None and "HiSparse hot buffer" in error, (reason, error)
            for rid, prompt, p in zip(rids, PROMPTS, NORMALS, strict=False):
                assert _collect(router, rid)[:3] == (solo(prompt, p), "length", None), rid
            continue
        router.submit(f"{decode}-{name}-poison", PROMPTS[4], poison)  # first: the normals join its steps
        for rid, prompt, p in zip(rids, PROMPTS, NORMALS, strict=False):
            router.submit(rid, prompt, p)
        for rid, prompt, p in zip(rids, PROMPTS, NORMALS, strict=False):
            got = _collect(router, rid)
            assert got[:3] == (solo(prompt, p), "length", None), (name, rid, got)
        toks, reason, error, lps, _ = _collect(router, f"{decode}-{name}-poison")
        assert (reason, error, len(toks)) == ("length", None, NEW), (name, toks, reason, error)
        assert toks == solo(PROMPTS[4], poison), name  # its own tokens, as colocated and alone
        if name in GREEDY_EQUIVALENT:
            assert toks == solo(PROMPTS[4], GREEDY), name
        assert len(lps) == NEW and _finite(lps), (name, lps)
    # stop_token_ids covering the vocabulary under min_tokens: its own error (refused), the 4 others exact
    vocab = tiny_model("glm_moe_dsa")[0].vocab_size
    cover = SamplingParams(max_new_tokens=NEW, temperature=1.0, min_tokens=3, stop_token_ids=tuple(range(vocab)))
    rids = [f"{decode}-cover-n{i}" for i in range(4)]
    for rid, prompt, p in zip(rids, PROMPTS, NORMALS, strict=False):
        router.submit(rid, prompt, p)
    try:
        router.submit(f"{decode}-cover-poison", PROMPTS[4], cover)
    except ConfigError as e:
        assert "cover all" in str(e)
    else:
        toks, reason, error, _, _ = _collect(router, f"{decode}-cover-poison")
        assert reason == "error" and error is not None and "cover all" in error, (toks, reason, error)
    for rid, prompt, p in zip(rids, PROMPTS, NORMALS, strict=False):
        assert _collect(router, rid)[:3] == (solo(prompt, p), "length", None), rid
    # the pipeline never broke: the same epoch, the prefix cache kept (the warm prompt still hits)
    after = fetch_health(p0.addr)
    assert after.epoch == before.epoch and after.down is None, after
    router.submit(f"{decode}-warm2", warm, GREEDY)
    toks, reason, error, _, cached = _collect(router, f"{decode}-warm2")
    assert (toks, reason, error, cached) == (solo(warm, GREEDY), "length", None, 32)
    again = fetch_health(p0.addr)
    assert again.epoch == before.epoch
    assert_clean([d.addr], procs=procs)
    wait_for(lambda: all(fetch_health(p.addr).integrity == "ok" for p in (p0, p1)), 20, "prefill books", procs)
