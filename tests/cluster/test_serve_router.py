"""The OpenAI API through the disaggregated router: `dsakv demo` (2 PP prefill stages + decode + router, real
processes on 127.0.0.1) serves, the real `openai` client and httpx drive it, tokens equal a colocated engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from dsakv.cli.demo_cmd import demo_prompts
from dsakv.engine.request import SamplingParams
from dsakv.serve.tokenizer import load_tokenizer
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.engines import tiny_path
from dsakv.testing.logscan import find_tracebacks, watch_dir
from dsakv.testing.servers import make_engine
from dsakv.util import ceil_div
from dsakv.util.procs import die_with_parent, free_ports

TOK = load_tokenizer(tiny_path("glm_moe_dsa"), 512)  # make-tiny's byte-level BPE


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc): the demo starts its workers in their own sessions, so killing the
    demo alone would leave them running."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    kids = [int(k) for k in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`dsakv demo` serving (not --once) on a free port; SIGTERM stops it and its workers."""
    log_dir = watch_dir(tmp_path_factory.mktemp("demo"))  # demo.out and the workers' logs: scanned for tracebacks
    port = free_ports(1)
    cmd = [
        sys.executable,
        "-m",
        "dsakv",
        "demo",
        "--model",
        str(tiny_path("glm_moe_dsa")),
        "--port",
        str(port),
        "--log-dir",
        str(log_dir),
        "--serve",
        "--no-host-tier",
    ]
    out = open(log_dir / "demo.out", "w")  # noqa: SIM115
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent())
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while "serving until Ctrl-C" not in (log_dir / "demo.out").read_text():
            assert proc.poll() is None, (log_dir / "demo.out").read_text()
            assert time.monotonic() < deadline, (log_dir / "demo.out").read_text()
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            for pid in [*_descendants(proc.pid), proc.pid]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait(timeout=10)
            raise
        finally:
            out.close()
    text = (log_dir / "demo.out").read_text()
    assert rc == 0, text
    assert "outputs matched: 9/9" in text and "stopping" in text


@pytest.fixture(scope="module")
def client(demo):
    with openai.OpenAI(base_url=f"{demo}/v1", api_key="none", max_retries=0, timeout=120) as c:
        yield c


def _idle(url: str, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        h = httpx.get(f"{url}/health", timeout=10).json()
        if h["pages_used"] == 0 and h["in_flight"] == 0:
            return h
        assert time.monotonic() < deadline, h
        time.sleep(0.1)


def test_router_completions_equal_colocated(client, demo):
    prompts = [[5, 6, 7, 8], list(range(30, 100)), [300, 12, 99, 4, 4]]
    want = make_engine().generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True))
    got = []
    for p in prompts:
        r = client.completions.create(
            model="glm_moe_dsa", prompt=p, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
        )
        got.append(r.choices[0].model_extra["token_ids"])
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 10
    assert got == want
    # streaming text prompt (the checkpoint's tokenizer)
    ids = []
    for ch in client.completions.create(
        model="glm_moe_dsa", prompt="héllo", max_tokens=6, temperature=0, stream=True, extra_body={"ignore_eos": True}
    ):
        ids += ch.choices[0].model_extra["token_ids"]
    assert ids == make_engine().generate([TOK.encode("héllo")], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
    h = _idle(demo)
    assert h["ok"] and h["backend"] == "disaggregated" and h["pages_total"] == 256


def test_router_chat_stream_equals_colocated(client):
    messages = [{"role": "user", "content": "hi there"}]
    (want,) = make_engine().generate([TOK.render_chat(messages)], SamplingParams(max_new_tokens=8, ignore_eos=True))
    chunks = list(
        client.chat.completions.create(
            model="glm_moe_dsa",
            messages=messages,
            max_tokens=8,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [t for ch in chunks for t in ch.choices[0].model_extra["token_ids"]] == want
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == TOK.decode(want)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_router_rejects_bad_input_and_frees_nothing(demo):
    r = httpx.post(f"{demo}/v1/completions", json={"prompt": [1, 2], "top_p": 0}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_p"
    r = httpx.post(f"{demo}/v1/completions", json={"prompt": [5] * 5000, "max_tokens": 2}, timeout=30)
    assert r.status_code == 413 and "5000 tokens" in r.json()["error"]["message"]
    # logprobs, echo, n and penalties are served through the router too (test_disagg_api checks their values)
    body = {"prompt": [5, 6, 7], "max_tokens": 2, "temperature": 0, "ignore_eos": True, "n": 2, "echo": True}
    r = httpx.post(f"{demo}/v1/completions", json={**body, "logprobs": 1, "presence_penalty": 0.5}, timeout=60)
    assert r.status_code == 200, r.text
    assert [len(c["logprobs"]["token_logprobs"]) for c in r.json()["choices"]] == [5, 5]
    assert r.json()["usage"]["completion_tokens"] == 4
    assert _idle(demo)["pages_used"] == 0


def test_router_client_disconnect_frees_decode_pages(demo):
    body = {"prompt": [5, 6, 7], "max_tokens": 3000, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{demo}/v1/completions", json=body, timeout=60) as r:
        n = 0
        for line in r.iter_lines():
            if line.startswith("data: {"):
                assert "error" not in json.loads(line[6:])
                n += 1
                if n == 3:
                    break
    h = _idle(demo)
    assert h["pages_used"] == 0
    m = httpx.get(f"{demo}/metrics").text
    assert 'dsakv_requests_finished_total{reason="abort"} 1\n' in m


def test_demo_once_json(tmp_path):
    model = tiny_path("glm_moe_dsa")
    cmd = [
        sys.executable,
        "-m",
        "dsakv",
        "demo",
        "--json",
        "--port",
        "0",
        "--model",
        str(model),
        "--log-dir",
        str(tmp_path),
        "--max-tokens",
        "12",
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert find_tracebacks(r.stderr) == [], r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    want = make_engine().generate([demo_prompts(8)[0]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert summary["completion_ids"] == want[0] == summary["reference_ids"]
    assert summary["ok"] and summary["tokens_equal_colocated"] and summary["chat_stream_done"]
    chat_params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    (chat_want,) = make_engine().generate([summary["chat_prompt_ids"]], chat_params)
    assert summary["chat_ids"] == chat_want and len(chat_want) == 12
    assert summary["requests"] == summary["requests_matched"] == 9
    assert summary["decode_integrity"] == "ok" and summary["metrics"]["dsakv_pairs_ready"] == 1
    # the PP prefill's prefix cache: request 0 again reuses its 2 whole cached pages (32 tokens) on every stage
    pc = summary["prefill_prefix_cache"]
    assert (pc["repeat_hit_tokens"], pc["repeat_equal"], pc["integrity"]) == (32, True, "ok")
    # every stage moved exactly its layout's bytes: prompt pages x bytes per page (index-K on producers only)
    spec = ModelSpec.from_path(model)
    prompts = [*demo_prompts(8), summary["chat_prompt_ids"]]
    pages = sum(ceil_div(len(p), 16) for p in prompts)
    assert [(r["count"], r["bytes"]) for r in summary["transfer"]] == [
        (9, pages * KVLayout(spec, 0, 6, kv_format="fp32", index_format="fp32", page_size=16).bytes_per_page),
        (9, pages * KVLayout(spec, 6, 12, kv_format="fp32", index_format="fp32", page_size=16).bytes_per_page),
    ]
    assert "outputs matched: 9/9" in r.stderr and "ready in" in r.stderr and "shut down: 3/3" in r.stderr
    for name in ("decode", "prefill", "router"):
        assert (tmp_path / f"{name}.log").is_file()
