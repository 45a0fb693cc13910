"""`dsakv serve` as a real process: pool sized from --kv-budget exactly as the planner does, a startup line with
the capacity, one log line per request, exact greedy ids over HTTP, clean exit on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from dsakv.engine.request import SamplingParams
from dsakv.plan.capacity import max_total_num_tokens
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.engines import tiny_path
from dsakv.testing.servers import make_engine
from dsakv.util.procs import die_with_parent, free_ports


def test_parser_stays_light():
    code = (
        "import sys; from dsakv.cli.main import build_parser; p = build_parser(); "
        "a = p.parse_args(['serve', '--model', 'x', '--no-elide', '--kv-budget', '1MiB']); "
        "assert a.role == 'colocated' and a.elide is False and a.host == '127.0.0.1' and a.port == 8000; "
        "bad = [m for m in ('torch', 'fastapi', 'uvicorn', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_serve_process_end_to_end(tmp_path):
    model = tiny_path("glm_moe_dsa")
    budget = 3 * 2**20
    spec = ModelSpec.from_path(model)
    pages = (
        max_total_num_tokens(budget, KVLayout(spec, elide=False, kv_format="fp32", index_format="fp32", page_size=16))
        // 16
    )
    assert pages == budget // (5376 * 16)  # 36 pages: 12 layers x (320 KV + 128 index) B/token, no elision
    port = free_ports(1)
    log = tmp_path / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [
        sys.executable,
        "-m",
        "dsakv",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--no-elide",
        "--kv-budget",
        "3MiB",
        "--page-size",
        "16",
        "--threads",
        "1",
    ]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                h = httpx.get(f"{url}/health", timeout=2).json()
                break
            except httpx.TransportError:
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        assert h["pages_total"] == pages and h["capacity_tokens"] == pages * 16 and h["elide"] is False
        metrics = httpx.get(f"{url}/metrics").text
        assert "dsakv_kv_bytes_per_token 5376\n" in metrics and "dsakv_elide 0\n" in metrics
        body = {"prompt": [5, 6, 7, 8], "max_tokens": 7, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60).json()
        want = make_engine().generate([[5, 6, 7, 8]], SamplingParams(max_new_tokens=7, ignore_eos=True))[0]
        assert r["choices"][0]["token_ids"] == want
        rid = r["id"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            raise
    text = log.read_text()
    assert rc == 0, text
    assert f"capacity {pages * 16} tokens ({pages} pages x 16), 5376 B/token" in text and "elide=False" in text
    assert f"request {rid}: prompt=4 output=7 ttft=" in text and "finish=length" in text


def test_disagg_roles_dispatch_to_disagg_cli():
    """--role router|prefill|decode go to dsakv.cli.disagg_roles.run_role (its own errors come back as exit code 2)."""
    r = subprocess.run(
        [sys.executable, "-m", "dsakv", "serve", "--role", "router"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2, r.stderr
    assert "a router needs at least one prefill and one decode worker" in r.stderr
