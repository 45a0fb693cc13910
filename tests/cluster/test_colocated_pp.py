"""The colocated pipeline as processes: `dsakv generate --pp-size 3` and `dsakv serve --pp-size 2` start their
later stages as copies of themselves (pipeline/colocated.py). Tokens equal the single-process engine's (seeded
generate over 3 stages, one of which holds no index producer; greedy and seeded requests served at once; chunked
prefill). A stage killed with a request in flight fails it with an error naming the stage and its exit status,
/health turns 503 naming it, and new requests get 503."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from dsakv.cli import options
from dsakv.cli.main import build_parser
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import wait_for
from dsakv.testing.engines import prompts_for, tiny_model, tiny_path
from dsakv.testing.listen import child_pids
from dsakv.util.procs import CHILD_ENV, Proc, dsakv_cmd, free_ports

ARCH = "glm_moe_dsa"
POOL = ["--page-size", "4", "--num-pages", "40", "--max-batch-tokens", "8", "--threads", "1"]


def _reference(argv: list[str]) -> Engine:
    """A single-process Engine over the very tree `dsakv *argv` builds."""
    return Engine(tiny_model(ARCH), options.engine_config(build_parser([argv[0]]).parse_args(argv)))


def _stage(pid: int, rank: int) -> int | None:
    """The pid of pipeline stage `rank` among `pid`'s children (DSAKV_PP_RANK in its environment)."""
    for kid in child_pids(pid):
        try:
            env = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"DSAKV_PP_RANK={rank}".encode() in env:
            return kid
    return None


def test_generate_pp3_seeded_tokens_equal_single_process() -> None:
    prompts = prompts_for([11, 4, 17], seed=8)
    argv = ["generate", "--model", str(tiny_path(ARCH)), *POOL, "--max-new-tokens", "7", "--ignore-eos", "--json"]
    argv += ["--temperature", "0.9", "--top-k", "40", "--seed", "5"]
    for q in prompts:
        argv += ["--prompt-ids", ",".join(map(str, q))]
    cmd = [*argv, "--pp-size", "3", "--pp-partition", "7,3,2"]  # stage 1 (layers 7-9) holds no producer
    r = subprocess.run(
        dsakv_cmd(*cmd), capture_output=True, text=True, timeout=300, env={**os.environ, **CHILD_ENV}
    )  # the stages die with it (their parent-death signal) should it time out
    assert r.returncode == 0, r.stderr[-3000:]
    got = [row["output_ids"] for row in json.loads(r.stdout)]
    params = SamplingParams(max_new_tokens=7, ignore_eos=True, temperature=0.9, top_k=40, seed=5)
    assert got == _reference(argv).generate(prompts, params)


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_pp2_tokens_equal_then_a_killed_stage_fails_its_request(tmp_path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    argv = ["serve", "--model", str(tiny_path(ARCH)), "--port", str(port), *POOL]
    # a stage timeout far above the test's own waits: the only failure below is the kill
    cmd = [*argv, "--pp-size", "2", "--pp-partition", "5,7", "--stage-timeout", "120"]
    p = Proc("serve-pp2", dsakv_cmd(*cmd), tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    try:
        wait_for(lambda: _up(url), 240, "serve --pp-size 2", [p])
        prompts = prompts_for([9, 4, 13], seed=21)
        bodies = [{"prompt": q, "max_tokens": 8, "temperature": 0, "ignore_eos": True} for q in prompts]
        bodies.append({"prompt": prompts[0], "max_tokens": 8, "temperature": 0.8, "seed": 17, "ignore_eos": True})

        def post(body: dict[str, Any]) -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return list(r.json()["choices"][0]["token_ids"])

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(post, bodies))
        one = _reference(argv)
        want = one.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        want += one.generate(prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=17))
        assert got == want

        # stage 1 frozen, then a request: its response starts once the engine holds it (submit returned), and it
        # cannot take a step (stage 0 waits on stage 1), so it is in flight for certain when stage 1 is killed
        pid1 = _stage(p.pid, 1)
        assert pid1 is not None
        os.kill(pid1, signal.SIGSTOP)
        chunks: list[dict[str, Any]] = []
        accepted = threading.Event()
        body = {"prompt": prompts[1], "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
                accepted.set()
                chunks.extend(json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {"))

        t = threading.Thread(target=stream)
        t.start()
        assert accepted.wait(120)
        os.kill(pid1, signal.SIGKILL)
        t.join(300)
        why = f"pipeline stage 1 (pid {pid1}) was killed by signal 9 (SIGKILL)"
        assert chunks[-1]["error"]["message"].startswith(
            f"generation failed: engine step failed: StageDown: pipeline stage down: {why}"
        ), chunks[-1]
        assert not any(c.get("choices") and c["choices"][0]["token_ids"] for c in chunks)  # no token came
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 503 and why in r.json()["error"]
        assert (r.json()["pages_used"], r.json()["running"], r.json()["waiting"]) == (0, 0, 0)  # its pages freed
        r2 = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=60)
        assert r2.status_code == 503 and why in r2.json()["error"]["message"]
    finally:
        p.kill()
    assert f"pipeline stage down: {why}" in (tmp_path / "serve.log").read_text()
