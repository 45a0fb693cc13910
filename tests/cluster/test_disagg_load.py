"""A few hundred requests through the router to a PP=4 prefill (5,3,2,2 layers, index-K elision forced on:
REFERENCE failure mode 3, each stage registers only its own layers while decode registers all 12) and a
decode worker, over mooncake. Every request completes with colocated serving's tokens; nothing is left in
flight and no worker holds a page at the end. Also the router as a process: `dsakv serve --role router`
serving the OpenAI API over the same workers.
"""

from __future__ import annotations

import random
import sys
import time

import httpx
import pytest

from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import PAGE_SIZE, Cluster, Proc, assert_clean, free_ports, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(300)]

BACKEND = "mooncake"
N_REQUESTS = 300
PAGES = 320  # 5120 tokens per pool


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("disagg-load"))
    try:
        pages = ["--num-pages", str(PAGES)]
        dec = cluster.decode("decode", BACKEND, True, extra=pages)
        pre = cluster.prefill("pp4", BACKEND, True, (5, 3, 2, 2), extra=pages)
        cluster.wait_healthy([dec, *pre], timeout=180)
        yield cluster, dec, pre
    finally:
        cluster.close()


def _workload(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(3, 90))] for _ in range(n)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True) for _ in range(n)]
    return prompts, params


def test_few_hundred_requests_nothing_left_in_flight(world):
    cluster, dec, pre = world
    prompts, params = _workload(N_REQUESTS)
    ref = Engine(tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=PAGES)).generate(
        prompts, params
    )
    router = cluster.router([pre[0].addr], [dec.addr], kv_timeout=30.0, queue_timeout=120.0)
    assert router.wait_ready(60), router.health()
    t0 = time.monotonic()
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        router.submit(f"load-{i}", p, sp)
    outs, reasons = [], []
    for i in range(N_REQUESTS):
        toks: list[int] = []
        for ev in router.events(f"load-{i}", 60.0):
            toks += ev.new_token_ids
            if ev.finished:
                reasons.append((ev.finish_reason, ev.error))
        outs.append(toks)
    elapsed = time.monotonic() - t0
    bad = [(i, r) for i, r in enumerate(reasons) if r != ("length", None)]
    assert not bad, bad[:5]
    assert outs == ref
    m = router.metrics()
    assert m["router_in_flight"] == 0 and m["router_queued"] == 0, m
    assert m["finished_total"] == N_REQUESTS and m["failed_total"] == 0, m
    assert router.health()["in_flight"] == 0
    assert_clean([dec.addr] + [s.addr for s in pre], procs=cluster.procs)
    ntok = sum(len(o) for o in outs)
    print(
        f"\n{N_REQUESTS} requests ({sum(map(len, prompts))} prompt tokens, {ntok} generated) through router -> "
        f"PP4 prefill -> decode ({BACKEND}): {elapsed:.2f}s, {N_REQUESTS / elapsed:.1f} req/s, "
        f"{ntok / elapsed:.1f} generated tok/s, retries {m['retries_total']:.0f}"
    )
    router.stop()


def test_router_process_serves_openai_api(world):
    cluster, dec, pre = world
    port = free_ports(1)
    cmd = [sys.executable, "-m", "dsakv", "serve", "--role", "router", "--model", str(cluster.model)]
    cmd += ["--port", str(port), "--prefill", pre[0].addr, "--decode", dec.addr, "--kv-timeout", "20"]
    router = Proc("router", cmd, cluster.logdir / "router.log", f"127.0.0.1:{port}").start()
    cluster.procs.append(router)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    wait_for(up, 90, "router /health 200", [router])
    prompts, _ = _workload(4)
    sp = SamplingParams(max_new_tokens=6, ignore_eos=True)
    ref = Engine(tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=PAGES)).generate(prompts, sp)
    for p, want in zip(prompts, ref, strict=True):
        body = {"prompt": p, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
    metrics = httpx.get(f"{url}/metrics", timeout=5).text
    assert "dsakv_router_in_flight 0" in metrics, metrics
    health = httpx.get(f"{url}/health", timeout=5).json()
    assert health["ok"] and health["backend"] == "disaggregated" and health["in_flight"] == 0, health
    router.signal(2)
    assert router.popen is not None and router.popen.wait(timeout=20) == 0, router.tail()
    assert_clean([dec.addr] + [s.addr for s in pre], procs=cluster.procs)
