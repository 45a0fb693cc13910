"""`dsakv serve --tp-size 2`: rank 0 serves HTTP and broadcasts each step's requests; rank 1 (its child process)
runs every step on its shard. Concurrent greedy and seeded requests get the single-rank engine's tokens."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx

from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import wait_for
from dsakv.testing.engines import engine, prompts_for, tiny_path
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

ARCH = "glm_moe_dsa"


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_tp2_tokens_equal_single_rank(tmp_path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(tiny_path(ARCH)), "--port", str(port), "--page-size", "4", "--max-tokens", "512",
        "--threads", "1", "--tp-size", "2",
    )  # fmt: skip
    p = Proc("serve-tp2", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    try:
        wait_for(lambda: _up(url), 240, "serve --tp-size 2", [p])
        prompts = prompts_for([9, 4, 13], seed=21)
        bodies = [{"prompt": q, "max_tokens": 8, "temperature": 0, "ignore_eos": True} for q in prompts]
        bodies.append({"prompt": prompts[0], "max_tokens": 8, "temperature": 0.8, "seed": 17, "ignore_eos": True})

        def post(body: dict) -> list[int]:
            r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        with ThreadPoolExecutor(4) as ex:
            got = list(ex.map(post, bodies))
        one = engine(ARCH, page_size=4, max_tokens=512)
        want = one.generate(prompts, SamplingParams(max_new_tokens=8, ignore_eos=True))
        want += one.generate(prompts[:1], SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=17))
        assert got == want
        # SIGTERM to the server's process group (rank 1 is in it): both exit within the bound (uvicorn re-raises
        # the signal it handled: -15), no SIGKILL needed
        assert p.stop(timeout=60) in (0, -signal.SIGTERM), p.tail()
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    # a clean stop: rank 0 stops rank 1 (which ignores the group's SIGTERM), so no rank is ever seen down
    assert "tensor-parallel ranks failed" not in log and "TP rank down" not in log and "RankDown" not in log, log
    # rank 0 stopped rank 1 before it exited itself: uvicorn's re-raised SIGTERM used to end rank 0 first, and
    # rank 1 then saw the group's connection close (a traceback) until its parent-death SIGKILL came
    assert "serve: stopped" in log and "TP group stopped: tp rank 1 exited 0" in log, log
