"""Test support for the serve tests: a live uvicorn server on 127.0.0.1 (a thread of this process) over a real
Engine on the tiny checkpoint, and helpers to read /metrics and /health."""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import uvicorn

from dsakv.engine.engine import Engine
from dsakv.serve.app import create_app
from dsakv.serve.engine_backend import EngineBackend
from dsakv.serve.limits import uvicorn_settings
from dsakv.serve.tokenizer import ByteTokenizer
from dsakv.testing.engines import flat_engine, tiny_model, tiny_path  # noqa: F401  (one tiny checkpoint per process, shared)

MODEL = "tiny"
PAGE_SIZE = 16
NUM_PAGES = 64  # 1024 tokens: small, so "prompt too long" cases stay cheap


def make_engine(**kw: object) -> Engine:
    kw.setdefault("page_size", PAGE_SIZE)
    kw.setdefault("num_pages", NUM_PAGES)
    kw.setdefault("check_every_step", True)
    return flat_engine(tiny_model("glm_moe_dsa"), **kw)


class LiveServer:
    """uvicorn serving `app` on a 127.0.0.1 socket bound to a free port, in a background thread, under the app's
    HTTP limits (the protocol `dsakv serve` runs)."""

    def __init__(self, app: Any) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        guard = getattr(getattr(app, "state", None), "http_guard", None)
        kw = uvicorn_settings(guard) if guard is not None else {}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", **kw)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self, timeout: float = 30.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.url} within {timeout} s")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


@contextmanager
def live_server(engine: Engine, tokenizer: object = None, **kw: object) -> Iterator[tuple[LiveServer, EngineBackend]]:
    backend = EngineBackend(engine)
    app = create_app(backend, MODEL, tokenizer or ByteTokenizer(), **kw)  # type: ignore[arg-type]
    srv = LiveServer(app).start()
    try:
        yield srv, backend
    finally:
        srv.stop()


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


def scrape(url: str) -> dict[str, float]:
    """/metrics as {name or name{labels}: value}; asserts every line is valid exposition text."""
    r = httpx.get(f"{url}/metrics", timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("# HELP ") or line.startswith("# TYPE "):
            continue
        m = _SAMPLE.match(line)
        assert m, f"bad exposition line: {line!r}"
        out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def wait_idle(url: str, timeout: float = 10.0) -> dict:
    """Poll /health until no request runs or waits and no page is used (read after the last step, not during a
    long one); the last health body."""
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=10).json()
        fresh = h.get("step_running_s") is None  # not figures from before a step that still runs
        if fresh and h["pages_used"] == 0 and h["running"] == 0 and h["waiting"] == 0:
            return h
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {h}")
        time.sleep(0.02)


def sse_events(url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """Raw SSE: every `data:` payload; asserts the stream ends with [DONE] and nothing follows."""
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(ln[6:]) for ln in lines[:-1]]
