"""DeepSeek-V4 in `dsakv serve` (colocated): one real server process on a tiny V4 checkpoint (Flash pattern, prefix
cache on) shared by the module, a real HTTP client. /v1/completions tokens == transformers' DeepseekV4ForCausalLM
(greedy), a repeated prompt hits the prefix cache with the same tokens, the pool is the layout's bytes, a seed draws
the same sampled tokens, logprobs / penalties are refused naming the parameter, and every role refuses a page size
that splits a compressed entry (the PD roles themselves: test_v4_pd_serve)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from dsakv.model.deepseek_v4_tiny import make_tiny_v4
from dsakv.spec.v4 import V4Spec
from dsakv.spec.v4_layout import V4Layout
from dsakv.util.procs import die_with_parent, free_ports

NEW = 8
PAGES = 64
Started = tuple[subprocess.Popen[bytes], str, Path]  # the server process, its URL, its log


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in (5, 20, 40)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4serve") / "flash", "flash")


@pytest.fixture(scope="module")
def server(started: Started, reference: list[list[int]]) -> Iterator[tuple[str, Path]]:
    """The server once it answers /health (started before transformers' reference is computed, which overlaps)."""
    proc, url, log = started
    while True:  # until it answers (or exits): the readiness state, no deadline of ours
        try:
            httpx.get(f"{url}/health", timeout=5)
            break
        except httpx.TransportError:
            assert proc.poll() is None, log.read_text()
            time.sleep(0.1)
    yield url, log


@pytest.fixture(scope="module")
def started(
    ckpt: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port = free_ports(1)
    log = tmp_path_factory.mktemp("v4serve-log") / "serve.log"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "dsakv", "serve", "--model", str(ckpt), "--port", str(port), "--page-size", "16",
           "--num-pages", str(PAGES), "--prefix-cache", "--threads", "1"]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, preexec_fn=die_with_parent())
    try:
        yield proc, f"http://127.0.0.1:{port}", log
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    """transformers' greedy continuation (argmax of each step's logits, eos not special: ignore_eos)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in _prompts():
            ids = list(p)
            for _ in range(NEW):
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p) :])
    return out


def _complete(url: str, prompt: list[int], **kw: Any) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=120)


def test_completions_equal_transformers_and_prefix_hit(server: tuple[str, Path], reference: list[list[int]]) -> None:
    url, log = server
    for p, want in zip(_prompts(), reference, strict=True):
        r = _complete(url, p)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["token_ids"] == want and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    r = _complete(url, _prompts()[2]).json()  # 40 tokens: its 2 full pages and the boundary state are cached
    assert r["choices"][0]["token_ids"] == reference[2]
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
    m = httpx.get(f"{url}/metrics").text
    assert "dsakv_prefix_cache_device_hit_tokens 32\n" in m and f"dsakv_prefix_cache_lookup_tokens {5 + 20 + 80}\n" in m
    h = httpx.get(f"{url}/health").json()
    assert (h["ok"], h["pages_total"], h["running"], h["waiting"]) == (True, PAGES, 0, 0)
    assert h["pages_used"] == 1 + 2  # the cached prefixes only: 20 tokens' 1 full page, 40 tokens' 2


def test_pool_bytes_and_refusals(server: tuple[str, Path], ckpt: Path) -> None:
    url, _ = server
    lay = V4Layout(V4Spec.from_path(ckpt), kv_format="fp32", index_format="fp32", page_size=16)
    metrics = httpx.get(f"{url}/metrics").text
    assert f"dsakv_pool_bytes {lay.pool_bytes(PAGES, 8)}\n" in metrics  # 64 x 1,792 + 8 x 19,200 B
    assert lay.pool_bytes(PAGES, 8) == 64 * 1792 + 8 * 19200
    a, b, c = (_complete(url, [5, 6, 7], temperature=0.7, top_p=0.9, seed=s) for s in (5, 5, 6))
    toks = [r.json()["choices"][0]["token_ids"] for r in (a, b, c)]
    assert toks[0] == toks[1] != toks[2] and len(toks[0]) == NEW  # a seed draws the same tokens
    r = _complete(url, [5, 6, 7], presence_penalty=0.5)
    assert r.status_code == 400 and r.json()["error"]["param"] == "presence_penalty"
    r = _complete(url, [5, 6, 7], logprobs=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"
    assert _complete(url, [5, 6, 7]).status_code == 200  # still serving


@pytest.mark.parametrize("role", ["colocated", "prefill", "decode"])
def test_every_role_refuses_a_page_size_of_partial_entries(ckpt: Path, role: str) -> None:
    cmd = [sys.executable, "-m", "dsakv", "serve", "--role", role, "--model", str(ckpt), "--page-size", "24"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "multiple of 16 tokens" in r.stderr, r.stderr
