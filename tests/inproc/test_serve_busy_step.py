"""/health, /metrics and /v1/models answer while an engine step holds the engine (a long prefill, a pipeline round
trip, a collective), from the figures read after the last step, and say how long that step has run.

A live server over a real engine whose model runner waits inside one step until the test releases it (the engine's
lock is held meanwhile, as during any step): the probes answer with the figures from before that step and
`step_running_s` / `dsakv_engine_step_running_seconds`; once released the request ends with exact tokens and the
figures are fresh again (step_running_s null). Without the bounded wait the probes would wait for the step.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from dsakv.engine.model_runner import ModelRunner
from dsakv.engine.request import SamplingParams
from dsakv.serve.engine_backend import STATS_WAIT_S
from dsakv.testing.engines import flat_engine, tiny_model
from dsakv.testing.servers import MODEL, NUM_PAGES, PAGE_SIZE, live_server, make_engine, scrape, wait_idle

pytestmark = [pytest.mark.timeout(300)]

PROMPT = [5, 6, 7, 8, 9]


class GatedRunner:
    """The engine's own ModelRunner; while `armed` is set, the next step waits in run() until `release` is set."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.armed = threading.Event()
        self.entered = threading.Event()
        self.release = threading.Event()

    def run(self, chunks: Sequence) -> object:
        if self.armed.is_set():
            self.armed.clear()
            self.entered.set()
            assert self.release.wait(120), "never released"
        return self.inner.run(chunks)

    def __getattr__(self, name: str) -> object:  # the rest of the runner's API (prompt logits, ...) is its own
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def served():
    spec, model = tiny_model("glm_moe_dsa")
    runners: list[GatedRunner] = []

    def gated(pool):
        runners.append(GatedRunner(ModelRunner(model, pool)))
        return runners[-1]

    engine = flat_engine((spec, model), page_size=PAGE_SIZE, num_pages=NUM_PAGES, check_every_step=True, runner=gated)
    with live_server(engine) as (srv, _backend):
        yield srv.url, runners[0]


def test_probes_answer_during_a_held_step_then_fresh(served):
    url, gate = served
    want = make_engine().generate([PROMPT], SamplingParams(max_new_tokens=4, ignore_eos=True))[0]
    idle = wait_idle(url)
    assert idle["step_running_s"] is None and idle["pages_used"] == 0
    before = scrape(url)
    assert before["dsakv_engine_step_running_seconds"] == 0
    gate.release.clear()
    gate.armed.set()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        held = pool.submit(httpx.post, f"{url}/v1/completions", json=body, timeout=120)
        assert gate.entered.wait(60)  # the prefill step of the request waits in the runner, the engine's lock held
        probes = [pool.submit(httpx.get, f"{url}{path}", timeout=30) for path in ("/health", "/metrics", "/v1/models")]
        got = [p.result(timeout=30) for p in probes]  # they answer: the step is still held
        assert not held.done()
        h, m, models = got[0].json(), scrape(url), got[2].json()
        assert got[0].status_code == 200 and h["ok"] is True
        # the figures read after the last step (idle), and how long the held step has run
        assert (h["pages_used"], h["running"], h["waiting"], h["pages_total"]) == (0, 0, 0, NUM_PAGES)
        assert h["step_running_s"] >= STATS_WAIT_S
        assert m["dsakv_engine_step_running_seconds"] >= STATS_WAIT_S
        assert m["dsakv_pool_pages_used"] == 0 and m["dsakv_pool_pages_total"] == NUM_PAGES
        assert models["data"][0]["max_model_len"] == NUM_PAGES * PAGE_SIZE
        gate.release.set()
        r = held.result(timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    after = wait_idle(url)
    assert after["step_running_s"] is None and after["pages_used"] == 0
    assert scrape(url)["dsakv_engine_step_running_seconds"] == 0
