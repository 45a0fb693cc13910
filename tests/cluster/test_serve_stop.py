"""SIGTERM to a served app: uvicorn's graceful stop, then the caller's own shutdown, then the signal's exit status
(dsakv.serve.server holds the signal that uvicorn would raise again inside its run)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import httpx

from dsakv.util.procs import die_with_parent, free_ports

SCRIPT = """
import sys, types
from dsakv.serve.limits import HttpGuard
from dsakv.serve.server import held_stop_signals, reraise_stop_signals, run_http

async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            kind = (await receive())["type"].split(".")[1]  # startup, then shutdown
            await send({"type": f"lifespan.{kind}.complete"})
            if kind == "shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"up"})

app.state = types.SimpleNamespace(http_guard=HttpGuard())
rc = run_http(app, "127.0.0.1", int(sys.argv[1]), "warning")
with open(sys.argv[2], "w") as f:  # the caller's shutdown: reached before the process ends
    f.write(f"rc={rc} held={held_stop_signals()}")
reraise_stop_signals()
print("after the re-raise", flush=True)
"""


def test_sigterm_lets_the_caller_shut_down_then_exits_with_the_signal(tmp_path) -> None:
    port = free_ports(1)
    out = tmp_path / "after.txt"
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(port), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=die_with_parent(),
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/", timeout=2).text == "up"
                break
            except httpx.TransportError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline
                time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
    finally:
        proc.kill()
    logs = proc.stdout.read() if proc.stdout else ""
    assert out.read_text() == f"rc=0 held=[{int(signal.SIGTERM)}]", logs
    assert rc == -signal.SIGTERM, logs
    assert "after the re-raise" not in logs, logs
