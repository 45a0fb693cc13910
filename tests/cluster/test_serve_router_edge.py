"""The HTTP edge in front of the disaggregated router: the same validators as the colocated server, threads that
survive a request's failure, and a /health that sees a dead or stuck serving loop.

One cluster of real processes for the module (a decode and a PP=1 prefill over mooncake) behind in-process
RouterBackends served by the HTTP app (the vocabulary the router checks comes from the decode's health). Every
oversized integer (>= 2**64: what once killed the router-dispatch thread; >= 2**31: past the control plane's id
bound; >= vocab) is a 400 naming the field on both servers, and the router keeps serving: a normal request
afterwards returns exactly the colocated engine's tokens.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest

from dsakv.config import RouterConfig
from dsakv.disagg.protocol.messages import MAX_ID
from dsakv.disagg.router.backend import RouterBackend
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.serve.app import create_app
from dsakv.serve.engine_backend import EngineBackend
from dsakv.serve.protocol import MAX_TOKEN_ID
from dsakv.serve.tokenizer import load_tokenizer
from dsakv.testing.cluster import Cluster, assert_clean, wait_for
from dsakv.testing.engines import tiny_path
from dsakv.testing.servers import MODEL, LiveServer, live_server, make_engine, scrape

pytestmark = [pytest.mark.timeout(300)]

TOK = load_tokenizer(tiny_path("glm_moe_dsa"), 512)
VOCAB = 512
NORMAL = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
BIG = 2**64

# (body fields over NORMAL, param named by the 400, words in the message)
OVERSIZED = [
    ({"top_k": BIG}, "top_k", f"[1, {MAX_TOKEN_ID}]"),
    ({"top_k": 2**31}, "top_k", f"[1, {MAX_TOKEN_ID}]"),
    ({"stop_token_ids": [7, BIG]}, "stop_token_ids", f"[0, {MAX_TOKEN_ID}]"),
    ({"stop_token_ids": [2**31]}, "stop_token_ids", f"[0, {MAX_TOKEN_ID}]"),
    ({"stop_token_ids": [VOCAB]}, "stop_token_ids", "outside the model's vocabulary 0..511"),
    ({"logit_bias": {str(BIG): 1}}, "logit_bias", f"above the largest token id {MAX_TOKEN_ID}"),
    ({"logit_bias": {str(VOCAB + 3): -5}}, "logit_bias", "[515] outside the model's vocabulary 0..511"),
    ({"prompt": [5, BIG]}, "prompt", f"above the largest token id {MAX_TOKEN_ID}"),
    ({"prompt": [5, 2**63 - 1]}, "prompt", f"above the largest token id {MAX_TOKEN_ID}"),
    ({"prompt": [5, VOCAB]}, "prompt", "[512] outside the model's vocabulary 0..511"),
    ({"max_tokens": BIG}, "max_tokens", f"[1, {MAX_TOKEN_ID}]"),
    ({"n": BIG}, "n", "[1, 64]"),
    ({"seed": BIG}, "seed", "[0, 9223372036854775807]"),
    ({"min_tokens": BIG}, "min_tokens", "[0, 6]"),
    ({"logprobs": BIG}, "logprobs", "[0, 20]"),
]


def test_protocol_token_bound_is_the_control_planes():
    assert MAX_TOKEN_ID == MAX_ID


@pytest.fixture(scope="module")
def want() -> list[int]:
    return make_engine().generate([NORMAL["prompt"]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Iterator[dict[str, Any]]:
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("router-edge"))
    srv: LiveServer | None = None
    try:
        dec = cluster.decode("decode", "mooncake", True)
        (pre,) = cluster.prefill("pre", "mooncake", True, (12,))
        cluster.wait_healthy([dec, pre], timeout=180)
        router = cluster.router([pre.addr], [dec.addr])
        assert router.wait_ready(60), router.health()
        wait_for(lambda: router.vocab_size() == VOCAB, 30, "the decode's vocabulary in the router")
        srv = LiveServer(create_app(router, MODEL, TOK)).start()
        yield {"cluster": cluster, "router": router, "url": srv.url, "decode": dec.addr, "prefill": pre.addr}
    finally:
        if srv is not None:
            srv.stop()
        cluster.close()


def _normal(url: str) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", json=NORMAL, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _check_refused(url: str, fields: dict[str, Any], param: str, words: str) -> None:
    r = httpx.post(f"{url}/v1/completions", json={**NORMAL, **fields}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, "invalid_value", "invalid_request_error"), err
    assert words in err["message"], err["message"]
    assert len(err["message"]) < 300, err["message"]  # a 20-digit id is named, not a wall of digits


@pytest.fixture(scope="module")
def colocated_server() -> Iterator[tuple[LiveServer, EngineBackend]]:
    with live_server(make_engine(), TOK) as (srv, backend):
        yield srv, backend


@pytest.fixture
def colocated(colocated_server) -> str:
    return colocated_server[0].url


@pytest.mark.parametrize("fields,param,words", OVERSIZED, ids=[f"{i}-{p}" for i, (_, p, _) in enumerate(OVERSIZED)])
def test_colocated_refuses_oversized_integers(colocated, want, fields, param, words):
    _check_refused(colocated, fields, param, words)
    assert _normal(colocated) == want


def test_router_keeps_serving_after_every_oversized_integer(world, want):
    url, router = world["url"], world["router"]
    assert _normal(url) == want
    for fields, param, words in OVERSIZED:
        _check_refused(url, fields, param, words)
        assert _normal(url) == want, fields  # the dispatch thread lives on
    h = httpx.get(f"{url}/health", timeout=10)
    assert h.status_code == 200 and h.json()["ok"] and h.json()["error"] is None
    assert {k: v["error"] for k, v in h.json()["loops"].items()} == dict.fromkeys(router.loops(), None)
    assert router.counters["dispatch_errors_total"] == 0  # refused at the edge, none reached the dispatch
    # the router as a library refuses what its codec cannot carry before queueing it (no HTTP in front)
    for params, what in (
        (SamplingParams(top_k=BIG), "params.top_k"),
        (SamplingParams(stop_token_ids=(BIG,)), "stop_token_ids[0]"),
        (SamplingParams(logit_bias=((BIG, 1.0),)), "logit_bias[0][0]"),
    ):
        with pytest.raises(ConfigError, match=what.replace("[", r"\[")):
            router.submit("lib", [5, 6], params)
    with pytest.raises(ConfigError, match=r"prompt_ids\[1\]"):
        router.submit("lib", [5, BIG], SamplingParams())
    with pytest.raises(ConfigError, match=r"prompt token id\(s\) \[600\] are outside the vocabulary 0..511"):
        router.submit("lib", [5, 600], SamplingParams())
    assert router.record("lib") is None and not router.book.queue
    assert len(router.book.ledger) == 0  # every record went once its last event was read
    assert_clean([world["decode"]])


@pytest.mark.expect_traceback("an injected placing bug must be logged with its traceback")
def test_dispatch_failure_fails_that_request_alone(world, want, monkeypatch):
    """A request whose placing raises (as the 2**64 top_k once did in the prealloc's packing) gets its own error;
    the dispatch thread goes on and the next request returns exact tokens."""
    router = world["router"]
    real = router.dispatcher.place

    def place(req):
        if req.rid == "poison":
            raise OverflowError("int too big to convert")
        return real(req)

    monkeypatch.setattr(router.dispatcher, "place", place)
    before = router.counters["dispatch_errors_total"]
    router.submit("poison", [5, 6, 7], SamplingParams(max_new_tokens=2))
    evs = list(router.events("poison", 60))
    assert [(e.finished, e.finish_reason) for e in evs] == [(True, "error")]
    assert "could not dispatch it (OverflowError: int too big to convert)" in (evs[0].error or "")
    assert router.counters["dispatch_errors_total"] == before + 1
    assert _normal(world["url"]) == want
    assert router.loops()["router-dispatch"]["error"] is None


@pytest.mark.expect_traceback("an injected event-handling bug must be logged with its traceback")
def test_event_failure_fails_that_request_alone(world, want, monkeypatch):
    """An event the router cannot hand over fails its request alone; the poller goes on."""
    router = world["router"]
    real = router.book.push

    def push(req, *a, **kw):
        if req.rid == "bad-event" and a and a[0]:  # its first tokens
            raise ValueError("unusable logprobs")
        return real(req, *a, **kw)

    monkeypatch.setattr(router.book, "push", push)
    router.submit("bad-event", [5, 6, 7], SamplingParams(max_new_tokens=40, ignore_eos=True))
    evs = list(router.events("bad-event", 60))
    assert [(e.new_token_ids, e.finished, e.finish_reason) for e in evs] == [((), True, "error")]
    assert "a bad event from decode" in (evs[0].error or "") and "unusable logprobs" in (evs[0].error or "")
    assert router.counters["event_errors_total"] == 1
    monkeypatch.undo()
    assert _normal(world["url"]) == want
    assert_clean([world["decode"]])  # the decode was told to abort it: no page held


class _Clock:
    def __init__(self) -> None:
        import time

        self._mono = time.monotonic
        self.offset = 0.0

    def __call__(self) -> float:
        return self._mono() + self.offset


def _router(world: dict[str, Any], clock: _Clock | None = None) -> RouterBackend:
    cfg = RouterConfig(
        prefill=(world["prefill"],), decode=(world["decode"],), kv_timeout=20.0, rpc_timeout=3.0, health_interval=0.2
    )
    r = RouterBackend(cfg, clock=clock) if clock is not None else RouterBackend(cfg)
    world["cluster"].routers.append(r)
    r.start()
    assert r.wait_ready(60), r.health()
    return r


class _Die(BaseException):
    """Not an Exception: nothing in the router catches it, so the dispatch thread ends (a stand-in for a bug)."""


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the thread we kill
def test_health_reports_a_dead_dispatch_loop(world):
    r = _router(world)
    with live_app(r) as url:
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200

        def die() -> bool | None:
            raise _Die

        r.dispatcher.next = die  # type: ignore[method-assign]
        r._wake.set()
        wait_for(lambda: not r.loops()["router-dispatch"]["alive"], 30, "the dispatch thread to end")
        h = httpx.get(f"{url}/health", timeout=10)
        assert h.status_code == 503, h.text
        body = h.json()
        assert body["ok"] is False and body["error"] == "serving loop(s) not running: router-dispatch dead"
        assert body["loops"]["router-dispatch"] == {"alive": False, "last_turn_s": body["loops"]["router-dispatch"][
            "last_turn_s"], "error": "dead"}  # fmt: skip


def test_health_reports_a_stuck_dispatch_loop_and_recovers(world, want):
    clock = _Clock()
    r = _router(world, clock)
    entered, release = threading.Event(), threading.Event()
    real = r.dispatcher.place

    def place(req):
        if req.rid == "blocked":
            entered.set()
            release.wait(120)
        return real(req)

    r.dispatcher.place = place  # type: ignore[method-assign]
    with live_app(r) as url:
        r.submit("blocked", list(NORMAL["prompt"]), SamplingParams(max_new_tokens=6, ignore_eos=True))
        assert entered.wait(60)
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200  # blocked, not yet for long
        clock.offset = r.stuck_after + 1.0  # no turn for longer than any RPC may take
        events = f"router-events-{world['decode']}"
        wait_for(lambda: r.loops()[events]["error"] is None, 30, "the events loop to turn on the new clock")
        h = httpx.get(f"{url}/health", timeout=10)
        assert h.status_code == 503 and h.json()["error"] == "serving loop(s) not running: router-dispatch stuck"
        assert h.json()["loops"]["router-dispatch"]["error"] == "stuck"
        assert h.json()["loops"][events]["error"] is None  # it turns on
        release.set()  # the loop turns again: healthy, and the request it held completes exactly
        toks = [t for ev in r.events("blocked", 60) for t in ev.new_token_ids]
        assert toks == want
        wait_for(lambda: httpx.get(f"{url}/health", timeout=10).status_code == 200, 30, "health ok again")


class live_app:
    """The HTTP app over router `r` on a live server; the router is stopped by the cluster."""

    def __init__(self, r: RouterBackend) -> None:
        self.srv = LiveServer(create_app(r, MODEL, TOK, manage_backend=False))

    def __enter__(self) -> str:
        return self.srv.start().url

    def __exit__(self, *exc: object) -> None:
        self.srv.stop()


# ---- finding 7: streams whose client leaves before the first event ------------------------------------------

LEAVERS = 40
STREAM = {**NORMAL, "max_tokens": 900, "stream": True}  # fits either pool; never done before its client left


def _leave(url: str, path: str, body: dict[str, Any], wait_head: bool) -> None:
    """POST a streamed request on a raw socket and close it: at once (maybe before the server read the body), or
    as soon as the response head arrives (the stream started, its first event not yet read)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=60) as s:
        head = f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
        s.sendall(f"{head}content-length: {len(data)}\r\n\r\n".encode() + data)
        if wait_head:
            got = b""
            while b"\r\n\r\n" not in got:
                chunk = s.recv(4096)
                assert chunk, got
                got += chunk
            assert got.startswith(b"HTTP/1.1 200"), got[:200]


class _Errors(logging.Handler):
    """Every WARNING+ record, or any record with a traceback, of any logger while installed."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.bad: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.WARNING or record.exc_info:
            self.bad.append(f"{record.name}: {record.getMessage()[:300]} exc={record.exc_info is not None}")


@contextmanager
def _no_tracebacks() -> Iterator[_Errors]:
    h = _Errors()
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error"), logging.getLogger("uvicorn")]
    for lg in loggers:
        lg.addHandler(h)
    try:
        yield h
    finally:
        for lg in loggers:
            lg.removeHandler(h)
    assert h.bad == [], h.bad


def _left_count(m: dict[str, float], before: dict[str, float]) -> int:
    """Requests that ended because their client left: aborted ones, and 499s (gone before its body was read)."""

    def get(d: dict[str, float], k: str) -> float:
        return d.get(k, 0.0)

    ab = 'dsakv_requests_finished_total{reason="abort"}'
    gone = 'dsakv_http_responses_total{code="499"}'
    return int(get(m, ab) - get(before, ab) + get(m, gone) - get(before, gone))


def _leavers(url: str) -> None:
    for i in range(LEAVERS):
        path = "/v1/completions" if i % 4 else "/v1/chat/completions"
        body = STREAM if i % 4 else {**STREAM, "prompt": None, "messages": [{"role": "user", "content": "hi"}]}
        _leave(url, path, body, wait_head=i % 2 == 0)


def test_colocated_streams_left_before_the_first_event_free_everything(colocated_server, want):
    srv, backend = colocated_server
    before = scrape(srv.url)
    with _no_tracebacks():
        _leavers(srv.url)
        wait_for(lambda: scrape(srv.url)["dsakv_requests_running"] == 0, 60, "every stream freed")
        wait_for(lambda: backend.pending() == 0 and not backend.engine.has_unfinished(), 60, "the engine idle")
        m = scrape(srv.url)
        assert m["dsakv_requests_total"] - before["dsakv_requests_total"] == LEAVERS
        assert _left_count(m, before) == LEAVERS
        assert m["dsakv_http_server_errors_total"] == 0
        assert backend.pending() == 0 and backend._queues == {}
        h = httpx.get(f"{srv.url}/health", timeout=10).json()
        assert (h["pages_used"], h["running"], h["waiting"]) == (0, 0, 0)
        assert _normal(srv.url) == want


def test_router_streams_left_before_the_first_event_free_everything(world, want):
    url, router = world["url"], world["router"]
    before = scrape(url)
    aborted = router.counters["aborted_total"]
    with _no_tracebacks():
        _leavers(url)
        wait_for(lambda: scrape(url)["dsakv_requests_running"] == 0, 60, "every stream freed")
        wait_for(lambda: len(router.book.ledger) == 0, 60, "the router's ledger empty")
        m = scrape(url)
        assert m["dsakv_requests_total"] - before["dsakv_requests_total"] == LEAVERS
        left = _left_count(m, before)
        assert left == LEAVERS
        k499 = 'dsakv_http_responses_total{code="499"}'
        gone = int(m.get(k499, 0) - before.get(k499, 0))
        assert router.counters["aborted_total"] - aborted == LEAVERS - gone  # every submitted one was aborted
        assert m["dsakv_http_server_errors_total"] == 0
        assert (len(router.book.ledger), len(router.book.queue), router.book.by_wire) == (0, 0, {})
        # an attempt aborted while its KV is in flight keeps its decode pages until its KV deadline (kv_timeout 20 s)
        assert_clean([world["decode"]], timeout=90)
        assert _normal(url) == want
        assert len(router.book.ledger) == 0
