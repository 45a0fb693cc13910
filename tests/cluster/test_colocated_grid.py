"""The colocated pipeline with TP stages: `dsakv generate` / `serve --pp-size 2 --tp-size 2` run 4 processes
(stage s, TP rank r; pipeline/tp_stage.py). Greedy and seeded tokens equal the single-process engine's (one prompt
chunked over several steps; serve: concurrent requests), stage 0's pool ends with 0 pages used, every process exits
0 (generate: rank 0 fails otherwise; serve: each group's stop is logged) and none is left afterwards; a killed
rank of stage 1 is named in /health."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsakv.cli import options
from dsakv.cli.main import build_parser
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import http_up, marked, marked_env, marked_pid, start_marked, wait_for
from dsakv.testing.engines import prompts_for, tiny_model, tiny_path
from dsakv.util.procs import PP_RANK_ENV, TP_RANK_ENV, dsakv_cmd, free_ports

ARCH = "glm_moe_dsa"
POOL = ["--page-size", "4", "--num-pages", "40", "--max-batch-tokens", "8", "--threads", "1"]


def _reference(argv: list[str]) -> Engine:
    """A single-process Engine over the very tree `dsakv *argv` builds."""
    return Engine(tiny_model(ARCH), options.engine_config(build_parser([argv[0]]).parse_args(argv)))


@pytest.mark.parametrize(
    "sampling", [[], ["--temperature", "0.9", "--top-k", "40", "--seed", "5"]], ids=["greedy", "seeded"]
)
def test_generate_pp2_tp2_tokens_equal_single_process(sampling: list[str]) -> None:
    prompts = prompts_for([11, 4], seed=8)  # 11 tokens: prefilled over 2 steps of 8
    argv = ["generate", "--model", str(tiny_path(ARCH)), *POOL, "--max-new-tokens", "6", "--ignore-eos", "--json"]
    argv += sampling
    for q in prompts:
        argv += ["--prompt-ids", ",".join(map(str, q))]
    mark = uuid.uuid4().hex
    r = subprocess.run(
        dsakv_cmd(*argv, "--pp-size", "2", "--tp-size", "2", "--stats"),
        capture_output=True,
        text=True,
        timeout=600,
        env=marked_env(mark),
    )  # every rank and stage dies with its parent (parent-death signal) should it time out
    assert r.returncode == 0, r.stderr[-3000:]
    got = [row["output_ids"] for row in json.loads(r.stdout)]
    sp = {"temperature": 0.9, "top_k": 40, "seed": 5} if sampling else {}
    assert got == _reference(argv).generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, **sp))
    stats = [json.loads(line) for line in r.stderr.splitlines() if line.startswith('{"page_size"')]
    assert [(s["pages_used"], s["pages_free"], s["generated_tokens"]) for s in stats] == [(0, 40, 12)]
    # exit 0 only if every process did: stage 0 waits for its TP rank 1 and stage 1, stage 1 for its TP rank 1
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert marked(mark) == []


def test_serve_pp2_tp2_tokens_equal_single_process_then_a_clean_stop(tmp_path: Path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    argv = ["serve", "--model", str(tiny_path(ARCH)), "--port", str(port), *POOL]
    grid = [*argv, "--pp-size", "2", "--tp-size", "2", "--stage-timeout", "120"]
    p, mark = start_marked("serve-pp2-tp2", grid, tmp_path / "serve.log", port)
    try:
        wait_for(lambda: http_up(url), 300, "serve --pp-size 2 --tp-size 2", [p])
        prompts = prompts_for([11, 4], seed=21)
        bodies = [{"prompt": q, "max_tokens": 6, "temperature": 0, "ignore_eos": True} for q in prompts]
        bodies.append({"prompt": prompts[0], "max_tokens": 6, "temperature": 0.8, "seed": 17, "ignore_eos": True})

        def post(body: dict[str, Any]) -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return list(r.json()["choices"][0]["token_ids"])

        with ThreadPoolExecutor(3) as ex:
            got = list(ex.map(post, bodies))
        one = _reference(argv)
        want = one.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True))
        want += one.generate(prompts[:1], SamplingParams(max_new_tokens=6, ignore_eos=True, temperature=0.8, seed=17))
        assert got == want
        h = httpx.get(f"{url}/health", timeout=30).json()
        assert (h["pages_used"], h["running"], h["waiting"]) == (0, 0, 0), h
        # SIGTERM to stage 0's rank 0 alone: it stops its TP rank, then stage 1, which stops its own TP rank
        os.kill(p.pid, signal.SIGTERM)
        wait_for(lambda: not p.alive(), 120, "serve to stop", [])
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    assert log.count("TP group stopped: tp rank 1 exited 0") == 2, log[-3000:]  # stage 0's rank 1 and stage 1's
    assert "pipeline stopped: pipeline stage 1 exited 0" in log and "Traceback" not in log, log[-3000:]
    assert marked(mark) == []


def test_serve_pp2_tp2_a_killed_stage_rank_is_named(tmp_path: Path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    argv = ["serve", "--model", str(tiny_path(ARCH)), "--port", str(port), *POOL]
    grid = [*argv, "--pp-size", "2", "--tp-size", "2", "--stage-timeout", "120"]
    p, mark = start_marked("serve-pp2-tp2", grid, tmp_path / "serve.log", port)
    try:
        wait_for(lambda: http_up(url), 300, "serve --pp-size 2 --tp-size 2", [p])
        victim = marked_pid(mark, {PP_RANK_ENV: "1", TP_RANK_ENV: "1"})
        os.kill(victim, signal.SIGKILL)  # idle: the next tick's broadcast on stage 1 fails
        wait_for(lambda: not http_up(url), 120, "health to turn 503", [])
        r = httpx.get(f"{url}/health", timeout=30)
        why = f"TP rank down: tp rank 1 (pid {victim}) was killed by signal 9 (SIGKILL)"
        assert r.status_code == 503 and why in r.json()["error"], r.json()
        assert "pipeline stage down: pipeline stage 1 (pid" in r.json()["error"], r.json()
        assert f"(stage 1: {why}" in r.json()["error"], r.json()  # stage 1's rank 0 noted why (its relay round)
        assert r.json()["pages_used"] == 0
        r2 = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert r2.status_code == 503 and why in r2.json()["error"]["message"]
    finally:
        p.kill()
    wait_for(lambda: marked(mark) == [], 60, "every process of the grid to be gone", [])
