"""A TP-2 decode with MTP (`dsakv serve --role decode --tp-size 2 --speculative-num-steps 2`) fed by a TP-1 prefill
with MTP (which sends the draft layer's keys and last hidden state): each decode rank holds the draft's KV / index-K
in its own pool (the sender rule writes every key, the draft's included, to both ranks), runs its shard of the
draft layer and drafts from the first decode step. Tokens == the colocated single-rank engine with MTP (greedy also
== MTP off), seeded too; each request's accept counts == the colocated engine running it alone; clean pools."""

from __future__ import annotations

import pytest

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import load_model
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests
from dsakv.testing.config import engine_config
from dsakv.testing.engines import fitted_mtp_tiny, mtp_prompts
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(500)]

SPEC = ["--speculative-num-steps", "2"]
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=23)
KEYS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return fitted_mtp_tiny(tmp_path_factory.mktemp("tp-mtp-pd"))


def _prompts() -> list[list[int]]:
    return mtp_prompts(2, (9, 37), seed=3)


PROMPTS = _prompts()


def _engine(ckpt, k: int) -> Engine:
    cfg = engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    return Engine(load_model(ckpt), cfg, speculative_num_steps=k, model_dir=ckpt)


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, ckpt, tmp_path_factory):
    backend = request.param
    cluster = Cluster(ckpt, tmp_path_factory.mktemp(f"tp-mtp-{backend}"))
    try:
        decode = cluster.decode("dtp2-mtp", backend, True, extra=["--tp-size", "2", "--worker-name", "dtp2", *SPEC])
        prefill = cluster.prefill("p-mtp", backend, True, (12,), extra=SPEC)
        cluster.wait_healthy([*prefill, decode], timeout=240)
        router = cluster.router([prefill[0].addr], [decode.addr], rpc_timeout=10.0)
        assert router.wait_ready(90), router.health()
        yield backend, cluster, decode, prefill
    finally:
        cluster.close()


def test_decode_tp2_mtp_tokens_and_accept_counts_equal_colocated(world, ckpt):
    backend, cluster, decode, prefill = world
    router = cluster.routers[-1]
    one = _engine(ckpt, 2)
    for i, p in enumerate(PROMPTS):  # one at a time: each request's accept counts are the engine's alone
        before = fetch_health(decode.addr, timeout=3.0).spec
        got = run_requests(router, [p], GREEDY, f"{backend}-g{i}")
        s0 = dict(one.spec_stats() or {})
        want = one.generate([p], GREEDY)
        s1 = one.spec_stats() or {}
        assert [(t, r, e) for t, r, e in got] == [(want[0], "length", None)]
        after = fetch_health(decode.addr, timeout=3.0).spec
        assert before is not None and after is not None
        assert {k: after[k] - before[k] for k in KEYS} == {k: s1[k] - s0.get(k, 0) for k in KEYS}, i
    assert (one.spec_stats() or {})["spec_accepted_tokens"] > 0
    assert [g[0] for g in run_requests(router, PROMPTS, GREEDY, f"{backend}-all")] == _engine(ckpt, 0).generate(
        PROMPTS, GREEDY
    )
    got = run_requests(router, PROMPTS[:2], SEEDED, f"{backend}-s")
    assert [g[0] for g in got] == _engine(ckpt, 2).generate(PROMPTS[:2], SEEDED)
    assert_clean([decode.addr, prefill[0].addr], procs=cluster.procs)
    h = fetch_health(decode.addr, timeout=3.0)
    assert h.ok and h.pages_used == 0
    # both decode ranks received every key, the draft layer's included: pages x 4,928 B (the layout with the draft)
    pages = 2 * sum(ceil_div(len(p), PAGE_SIZE) for p in PROMPTS) + sum(
        ceil_div(len(p), PAGE_SIZE) for p in PROMPTS[:2]
    )
    figure = pages * PAGE_SIZE * 4928
    assert h.kv_bytes_pairs == {"p-mtp:0->tp0": figure, "p-mtp:0->tp1": figure}, h.kv_bytes_pairs
