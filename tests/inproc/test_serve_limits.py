"""HTTP limits over a live server (serve/limits.py): lone surrogates and deep nesting are 400s, large bodies 413
(announced or streamed), slow bodies 408, slow request heads and idle keep-alive connections are closed, one
connection over the cap gets a 503 JSON body, and every 5xx is counted in /metrics. After each case the pool is
empty and the server still answers."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from dsakv.errors import ConfigError
from dsakv.serve.limits import HttpGuard, HttpLimits, LimitsMiddleware, find_lone_surrogate, json_depth_exceeds
from dsakv.testing.servers import MODEL, NUM_PAGES, live_server, make_engine, scrape, wait_idle

# Size, depth and connection limits are tight; timeouts are generous, so that on a starved box (two suites at once)
# no well-formed request from a real client is ever timed out (ci: one legit httpx POST got a 408 from a 0.6 s
# body timeout: its body had arrived, but the event loop woke only after the deadline).
LIMITS = HttpLimits(
    max_request_bytes=64 * 1024,
    max_json_depth=32,
    header_timeout=30.0,
    body_timeout=30.0,
    keep_alive_timeout=30.0,
    max_connections=6,
)
# The three timeout tests run against a second server with 0.6 s timeouts; every well-formed request to it is sent
# head and body in one write, so the whole request is read before the app asks for its body and no timer races it.
TIGHT = HttpLimits(header_timeout=0.6, body_timeout=0.6, keep_alive_timeout=0.6)
OK = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    with live_server(make_engine(), limits=LIMITS) as (srv, backend):
        yield srv, backend


@pytest.fixture(scope="module")
def tight():
    with live_server(make_engine(), limits=TIGHT) as (srv, backend):
        yield srv, backend


def _post_raw(url: str, raw: bytes, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)


def _error(r: httpx.Response, status: int, code: str) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    return err


def _post_one_write(port: int, payload: dict) -> tuple[bytes, dict]:
    """POST /v1/completions with head and body in one sendall; (status line, JSON body) of the answer."""
    body = json.dumps(payload).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    s = _connect(port)
    s.settimeout(30)
    s.sendall(head.encode() + body)
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    s.close()
    status_line, _, rest = data.partition(b"\r\n")
    return status_line, json.loads(rest.split(b"\r\n\r\n", 1)[1])


def _assert_still_serving(url: str, port: int | None = None) -> None:
    """The pool is empty and a completion still succeeds: through httpx, or (port given: the tight server) in one
    write."""
    h = wait_idle(url)
    assert h["pages_used"] == 0 and h["pages_free"] == NUM_PAGES
    if port is None:
        r = httpx.post(f"{url}/v1/completions", json=OK, timeout=30)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text
    else:
        status_line, out = _post_one_write(port, OK)
        assert status_line.startswith(b"HTTP/1.1 200") and len(out["choices"][0]["token_ids"]) == 2, out


def _connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.settimeout(5)
    return s


def _closed_after(s: socket.socket, limit: float) -> float:
    """Seconds until the server closed s (recv returned b''), failing if that takes longer than limit."""
    t0 = time.monotonic()
    s.settimeout(limit)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            raise AssertionError(f"connection still open after {limit} s") from None
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return time.monotonic() - t0


def test_limits_validate():
    for kw, words in (
        ({"max_request_bytes": 0}, "--max-request-bytes 0"),
        ({"header_timeout": float("nan")}, "--http-header-timeout nan"),
        ({"body_timeout": -1}, "--http-body-timeout -1"),
        ({"keep_alive_timeout": float("inf")}, "--keep-alive-timeout inf"),
        ({"max_connections": 0}, "--max-connections 0"),
    ):
        with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
            HttpLimits(**kw)  # type: ignore[arg-type]


def test_depth_and_surrogate_scanners():
    assert not json_depth_exceeds(b'{"a": [[1]], "s": "[[[[[[[[[["}', 3)
    assert json_depth_exceeds(b'{"a": [[[1]]]}', 3)
    assert json_depth_exceeds(b"[" * 100_000, 64)  # unterminated: still detected, without recursion
    assert find_lone_surrogate({"messages": [{"content": "ok"}, {"content": "x\ud800"}]}) == "messages[1].content"
    assert find_lone_surrogate({"a\udfff": 1}) == "a\udfff"
    assert find_lone_surrogate({"prompt": "fine \U0001f600"}) is None


@pytest.mark.parametrize(
    "path,raw,param",
    [
        ("/v1/completions", b'{"prompt": "hi \\ud800 there", "max_tokens": 2}', "prompt"),
        ("/v1/completions", b'{"prompt": ["\\udfff"], "max_tokens": 2}', "prompt[0]"),
        ("/v1/completions", b'{"prompt": [5], "stop": ["\\ud83d"], "max_tokens": 2}', "stop[0]"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 2}',
            "messages[0].content",
        ),
    ],
)
def test_lone_surrogate_is_400(server, path, raw, param):
    srv, _ = server
    err = _error(_post_raw(srv.url, raw, path), 400, "invalid_encoding")
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"]
    _assert_still_serving(srv.url)


@pytest.mark.parametrize("depth", [33, 1000, 5000])
def test_deep_nesting_is_400(server, depth):
    srv, _ = server
    for raw in (
        b'{"prompt": ' + b"[" * depth + b"5" + b"]" * depth + b"}",
        b'{"prompt": [5], "x": ' + b'{"a": ' * depth + b"1" + b"}" * depth + b"}",
    ):
        err = _error(_post_raw(srv.url, raw), 400, "invalid_json")
        assert "deeper than 32 levels" in err["message"]
    _assert_still_serving(srv.url)


def test_announced_large_body_is_413_unread(server):
    srv, _ = server
    before = scrape(srv.url)
    raw = json.dumps({**OK, "prompt": "x" * (LIMITS.max_request_bytes + 1)}).encode()
    err = _error(_post_raw(srv.url, raw), 413, "request_too_large")
    assert f"{len(raw)} bytes, over this server's limit of {LIMITS.max_request_bytes}" in err["message"]
    m = scrape(srv.url)
    assert m['dsakv_http_responses_total{code="413"}'] == before.get('dsakv_http_responses_total{code="413"}', 0) + 1
    _assert_still_serving(srv.url)


def test_streamed_large_body_is_413(server):
    srv, _ = server

    def chunks():
        yield b'{"prompt": "'
        for _ in range(40):  # 40 x 4 KiB > 64 KiB, no Content-Length (chunked)
            yield b"x" * 4096
        yield b'"}'

    r = httpx.post(f"{srv.url}/v1/completions", content=chunks(), timeout=30)
    err = _error(r, 413, "request_too_large")
    assert "more than 65536" in err["message"]
    _assert_still_serving(srv.url)


def test_slow_body_is_408(tight):
    srv, _ = tight
    s = _connect(srv.port)
    body = json.dumps(OK).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\ncontent-length: {len(body)}"
    s.sendall(head.encode() + b"\r\n\r\n" + body[:5])
    t0 = time.monotonic()
    data = b""
    while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    took = time.monotonic() - t0
    s.close()
    status_line, _, rest = data.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 408"), data[:200]
    assert json.loads(rest.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"
    assert took < TIGHT.body_timeout + 2.0
    assert scrape(srv.url)["dsakv_http_body_timeouts_total"] >= 1
    _assert_still_serving(srv.url, srv.port)


def test_slow_request_head_is_closed(tight):
    srv, _ = tight
    before = scrape(srv.url)["dsakv_http_header_timeouts_total"]
    s = _connect(srv.port)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    t0 = time.monotonic()
    for _ in range(3):  # a dribbling client does not extend the deadline
        time.sleep(0.1)
        s.sendall(b"X")
    _closed_after(s, TIGHT.header_timeout + 3.0)
    took = time.monotonic() - t0
    s.close()
    assert TIGHT.header_timeout - 0.1 <= took <= TIGHT.header_timeout + 2.0
    assert scrape(srv.url)["dsakv_http_header_timeouts_total"] == before + 1
    s = _connect(srv.port)  # a silent connection is closed too
    assert _closed_after(s, TIGHT.header_timeout + 3.0) <= TIGHT.header_timeout + 2.0
    s.close()
    _assert_still_serving(srv.url, srv.port)


def test_idle_keep_alive_is_closed(tight):
    srv, _ = tight
    s = _connect(srv.port)
    s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536)
    assert data.startswith(b"HTTP/1.1 200")
    assert _closed_after(s, TIGHT.keep_alive_timeout + 3.0) <= TIGHT.keep_alive_timeout + 2.0
    s.close()


def test_connection_cap_is_503_json(server):
    srv, _ = server
    before = scrape(srv.url)
    held = [_connect(srv.port) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.2)
        extra = _connect(srv.port)
        data = b""
        while True:
            chunk = extra.recv(65536)
            if not chunk:
                break
            data += chunk
        extra.close()
        assert data.startswith(b"HTTP/1.1 503"), data[:200]
        assert json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    m = scrape(srv.url)
    assert m["dsakv_http_connections_refused_total"] >= before["dsakv_http_connections_refused_total"] + 1
    assert m['dsakv_http_responses_total{code="503"}'] >= 1
    _assert_still_serving(srv.url)


@pytest.mark.expect_traceback("an injected handler bug must be logged with its traceback")
def test_server_errors_are_json_and_counted(server):
    srv, backend = server
    before = scrape(srv.url)["dsakv_http_server_errors_total"]

    def broken() -> int:
        raise RuntimeError("backend exploded")

    backend.max_prompt_tokens = broken  # type: ignore[method-assign]
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json=OK, timeout=30)
    finally:
        del backend.max_prompt_tokens
    err = _error(r, 500, "internal_error")
    assert err["type"] == "server_error" and "RuntimeError: backend exploded" in err["message"]
    m = scrape(srv.url)
    assert m["dsakv_http_server_errors_total"] == before + 1
    assert m['dsakv_http_responses_total{code="500"}'] >= 1
    _assert_still_serving(srv.url)


def _late_loop_body(limits: HttpLimits, arrives: bool) -> tuple[list[int], list[bytes], int]:
    """Drive LimitsMiddleware on an event loop that wakes late: a callback holds the loop past the body deadline
    and then (arrives) hands over the body in the same loop iteration as the deadline fires, as a starved process
    sees a body that arrived in time. (statuses sent, bodies the app read, 408s counted)."""
    import asyncio

    guard = HttpGuard(limits)
    arrived = asyncio.Event()
    statuses: list[int] = []
    read: list[bytes] = []

    async def receive() -> dict:
        await arrived.wait()
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(msg: dict) -> None:
        if msg["type"] == "http.response.start":
            statuses.append(msg["status"])

    async def app(scope, receive_, send_) -> None:
        read.append((await receive_())["body"])
        await send_({"type": "http.response.start", "status": 200, "headers": []})
        await send_({"type": "http.response.body", "body": b""})

    def starve() -> None:
        time.sleep(limits.body_timeout * 2)  # the loop is held: the deadline passes meanwhile
        if arrives:
            # due after the deadline's timer, in the same batch: the deadline cancels the read, then the body is there
            asyncio.get_running_loop().call_later(0, arrived.set)

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.02, starve)
        scope = {"type": "http", "headers": [(b"content-length", b"2")]}
        await LimitsMiddleware(app, guard)(scope, receive, send)

    asyncio.run(main())
    return statuses, read, guard.body_timeouts


def test_body_that_arrived_before_a_late_deadline_is_read():
    """A loop that wakes late fires the body deadline in the same iteration as the body's arrival: the body is
    taken (200), not answered 408; a body that really is missing is still a 408."""
    limits = HttpLimits(body_timeout=0.1)
    assert _late_loop_body(limits, arrives=True) == ([200], [b"{}"], 0)
    assert _late_loop_body(limits, arrives=False) == ([408], [], 1)
