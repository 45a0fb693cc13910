"""DP attention x PP, colocated: `dsakv generate` / `serve --pp-size 2 --tp-size 2 --dp-size 2 --enable-dp-attention
--ep-size 2` run 4 processes (DP rank d, stage s; pipeline/dp_stage.py): each DP rank a pipeline of its own with its
own pools, each stage's two DP ranks the EP group of its MoE layers. Greedy and seeded tokens equal the single-rank
engine's with the requests on both DP ranks (each row / response names its rank) and a rank idle while the other
steps (every stage's all-to-all matched by IDLE steps); serve: /health per rank, every process exits 0 at SIGTERM;
kill -9 of (DP rank 1, stage 1) mid-request: the failed requests, /health and a new request's 503 name it, every
process is gone after the stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import http_up, marked, marked_env, marked_pid, start_marked, wait_for
from dsakv.testing.engines import engine, prompts_for, tiny_path
from dsakv.util.procs import PP_RANK_ENV, TP_RANK_ENV, dsakv_cmd, free_ports

ARCH = "glm_moe_dsa"
POOL = ["--page-size", "4", "--num-pages", "40", "--max-batch-tokens", "8", "--threads", "1"]
GRID = ["--pp-size", "2", "--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]


def _single(prompts: list[list[int]], n: int, **sp: Any) -> list[list[int]]:
    """The single-rank engine's tokens with the same pool and step options."""
    one = engine(ARCH, page_size=4, num_pages=40, max_batch_tokens=8)
    return one.generate(prompts, SamplingParams(max_new_tokens=n, ignore_eos=True, **sp))


@pytest.mark.parametrize(
    "sampling", [[], ["--temperature", "0.9", "--top-k", "40", "--seed", "5"]], ids=["greedy", "seeded"]
)
def test_generate_dp2_pp2_tokens_equal_single_rank(sampling: list[str]) -> None:
    # prompts 0, 2 on DP rank 0 (11 tokens: prefilled over 2 steps of 8), prompt 1 on DP rank 1: rank 1 finishes
    # first and idles (IDLE down its pipeline) while rank 0 still steps
    prompts = prompts_for([11, 4, 6], seed=8)
    argv = ["generate", "--model", str(tiny_path(ARCH)), *POOL, "--max-new-tokens", "6", "--ignore-eos", "--json"]
    argv += sampling
    for q in prompts:
        argv += ["--prompt-ids", ",".join(map(str, q))]
    mark = uuid.uuid4().hex
    r = subprocess.run(
        dsakv_cmd(*argv, *GRID, "--stats"), capture_output=True, text=True, timeout=600, env=marked_env(mark)
    )  # every rank and stage dies with its parent (parent-death signal) should it time out
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(r.stdout)
    sp = {"temperature": 0.9, "top_k": 40, "seed": 5} if sampling else {}
    assert [row["output_ids"] for row in rows] == _single(prompts, 6, **sp)
    assert [row["dp_rank"] for row in rows] == [0, 1, 0]  # as the rank that ran each reports it
    stats = [json.loads(line) for line in r.stderr.splitlines() if line.startswith('{"page_size"')]
    assert [(s["pages_used"], s["pages_free"], s["generated_tokens"]) for s in stats] == [(0, 40, 12)]  # rank 0
    ranks = [json.loads(line)["ranks"] for line in r.stderr.splitlines() if line.startswith('{"ranks"')]
    assert [(f["dp"], f["ep"], f["generated_tokens"]) for f in ranks] == [(2, 2, 18)]
    # 8 rounds: rank 0 steps in each (2 prompts, 17 prompt tokens in chunks of 8), rank 1 in 6 (prefill + 5 decodes)
    # and sends IDLE down its pipeline in the other 2, so both stages' all-to-alls stay matched
    assert (ranks[0]["steps_per_rank"], ranks[0]["idle_rounds_per_rank"]) == ([8, 6], [0, 2])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert marked(mark) == []


def _health(url: str) -> dict[str, Any]:
    return dict(httpx.get(f"{url}/health", timeout=30).json())


def _in_flight(url: str) -> list[int]:
    try:
        return [row["in_flight"] for row in _health(url).get("dp_ranks", [])]
    except (httpx.HTTPError, ValueError):
        return []


def _post(url: str, body: dict[str, Any], into: dict[str, httpx.Response], name: str) -> threading.Thread:
    def run() -> None:
        into[name] = httpx.post(f"{url}/v1/completions", json=body, timeout=300)

    t = threading.Thread(target=run, name=f"post-{name}", daemon=True)
    t.start()
    return t


def _start(tmp_path: Path) -> tuple[Any, str, str]:
    port = free_ports(1)
    argv = ["serve", "--model", str(tiny_path(ARCH)), "--port", str(port), *POOL, *GRID, "--stage-timeout", "120"]
    p, mark = start_marked("serve-dp2-pp2", argv, tmp_path / "serve.log", port)
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: http_up(url), 300, "serve DP 2 x PP 2", [p])
    return p, url, mark


LONG = 100  # tokens of the request that must still run on DP rank 0 when the next one is placed


def test_serve_dp2_pp2_tokens_equal_single_rank_then_a_clean_stop(tmp_path: Path) -> None:
    p, url, mark = _start(tmp_path)
    try:
        h = _health(url)
        assert [(r["dp_rank"], r["pages_total"]) for r in h["dp_ranks"]] == [(0, 40), (1, 40)], h
        prompts = prompts_for([11, 4], seed=21)
        got: dict[str, httpx.Response] = {}
        # A runs on rank 0 (both idle, ties to the lowest); B, placed while A runs, on rank 1 (fewest in flight)
        a = _post(url, {"prompt": prompts[0], "max_tokens": LONG, "temperature": 0, "ignore_eos": True}, got, "A")
        wait_for(lambda: _in_flight(url) == [1, 0] or "A" in got, 120, "A placed", [p])
        b = _post(url, {"prompt": prompts[1], "max_tokens": 6, "temperature": 0, "ignore_eos": True}, got, "B")
        b.join(300)
        assert "A" not in got, f"A ({LONG} tokens) finished before B was placed: the machine is too slow for this test"
        a.join(300)
        seeded = {"prompt": prompts[1], "max_tokens": 6, "temperature": 0.8, "seed": 17, "ignore_eos": True}
        _post(url, seeded, got, "C").join(300)  # both idle again: rank 0
        assert {k: r.status_code for k, r in got.items()} == {"A": 200, "B": 200, "C": 200}, {
            k: r.text for k, r in got.items()
        }
        body = {k: r.json() for k, r in got.items()}
        assert {k: b["dp_rank"] for k, b in body.items()} == {"A": 0, "B": 1, "C": 0}
        toks = {k: b["choices"][0]["token_ids"] for k, b in body.items()}
        assert toks["A"] == _single(prompts[:1], LONG)[0]
        assert toks["B"] == _single(prompts[1:], 6)[0]
        assert toks["C"] == _single(prompts[1:], 6, temperature=0.8, seed=17)[0]
        h = _health(url)
        rows = [(r["dp_rank"], r["pages_used"], r["in_flight"], r["requests_total"]) for r in h["dp_ranks"]]
        assert rows == [(0, 0, 0, 2), (1, 0, 0, 1)] and h["pages_used"] == 0, h
        assert [r["generated_tokens"] for r in h["dp_ranks"]] == [LONG + 6, 6], h
        os.kill(p.pid, signal.SIGTERM)  # to rank 0 alone: it stops rank 1; each DP rank's stage 0 its stage 1
        wait_for(lambda: not p.alive(), 120, "serve to stop", [])
        assert p.poll() == -signal.SIGTERM  # the server re-raises the signal after its clean stop (test_serve_stop)
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    for d in (0, 1):
        assert f"pipeline stopped: dp rank {d} pipeline stage 1 exited 0" in log, log[-3000:]
    assert "DP group stopped: dp rank 1 exited 0" in log and "Traceback" not in log, log[-3000:]
    wait_for(lambda: marked(mark) == [], 60, "every process of the grid to be gone", [])


def test_serve_dp2_pp2_a_killed_stage_is_named(tmp_path: Path) -> None:
    p, url, mark = _start(tmp_path)
    try:
        victim = marked_pid(mark, {PP_RANK_ENV: "1", TP_RANK_ENV: "1"})  # DP rank 1's stage 1
        prompts = prompts_for([5, 6], seed=3)
        got: dict[str, httpx.Response] = {}
        _post(url, {"prompt": prompts[0], "max_tokens": 150, "ignore_eos": True}, got, "A")
        wait_for(lambda: _in_flight(url) == [1, 0] or "A" in got, 120, "A placed", [p])
        b = _post(url, {"prompt": prompts[1], "max_tokens": 150, "ignore_eos": True}, got, "B")
        wait_for(lambda: _in_flight(url) == [1, 1] or "B" in got, 120, "B placed on rank 1", [p])
        assert not got, f"a {150}-token request finished before both ran: the machine is too slow for this test"
        os.kill(victim, signal.SIGKILL)
        b.join(120)
        wait_for(lambda: "A" in got, 120, "A to fail too", [p])
        who = f"dp rank 1 pipeline stage 1 (pid {victim})"
        for name in ("A", "B"):
            assert got[name].status_code != 200 and who in got[name].text, (name, got[name].text)
        # the requests may fail in the round that saw the break; the instance is down from the next round (the
        # serve loop's next step raises RankDown within its 0.5 s wake): health is polled, not read once (ciP)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=30).status_code == 503, 60, "health to say down", [p])
        r = httpx.get(f"{url}/health", timeout=30)
        assert r.status_code == 503 and who in r.json()["error"], r.json()
        assert r.json()["error"].startswith("RankDown: DP rank down: dp rank "), r.json()
        r2 = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=60)
        assert r2.status_code == 503 and who in r2.json()["error"]["message"], r2.text
        os.kill(p.pid, signal.SIGTERM)  # a bounded stop: what is down is killed, the rest told to stop
        wait_for(lambda: not p.alive(), 120, "serve to stop", [])
    finally:
        p.kill()
    wait_for(lambda: marked(mark) == [], 60, "every process of the grid to be gone", [])
