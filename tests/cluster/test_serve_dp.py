"""`dsakv serve --tp-size 2 --dp-size 2 --enable-dp-attention --ep-size 2` (colocated): rank 0 serves HTTP and
places each request on the DP rank with the fewest in flight (ties to the lowest); both ranks step in lockstep (the
MoE expert-parallel over both), each with its own pool; each response names its rank (`dp_rank`). Tokens == the
single-rank engine, greedy and seeded; /health and /metrics show per-rank rows; 0 pages used after on both."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import httpx

from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import wait_for
from dsakv.testing.engines import engine, prompts_for, tiny_path
from dsakv.testing.listen import child_pids
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

ARCH = "glm_moe_dsa"
DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]
LONG, LONGER = 240, 400  # tokens of the requests that must still run while later ones are placed


def _health(url: str) -> dict | None:
    try:
        r = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def _environ(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return []


def _rows(url: str) -> list[dict]:
    return (_health(url) or {}).get("dp_ranks", [])  # none while /health does not answer 200 (then polled again)


def _in_flight(url: str) -> list[int]:
    return [row["in_flight"] for row in _rows(url)]


def test_serve_dp2_places_by_load_tokens_equal_single_rank(tmp_path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(tiny_path(ARCH)), "--port", str(port), "--page-size", "4", "--max-tokens", "512",
        "--threads", "1", *DP,
    )  # fmt: skip
    p = Proc("serve-dp2", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    got: dict[str, dict] = {}

    def post(name: str, body: dict) -> None:
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        got[name] = r.json()

    def stream(name: str, body: dict) -> None:
        chunks = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
        got[name] = {
            "dp_rank": {c["dp_rank"] for c in chunks},
            "choices": [{"token_ids": [t for c in chunks for t in c["choices"][0]["token_ids"]]}],
        }

    try:
        wait_for(lambda: _health(url) is not None, 240, "serve DP 2", [p])
        h = _health(url)
        assert h is not None and [r["dp_rank"] for r in h["dp_ranks"]] == [0, 1], h
        assert [r["pages_total"] for r in h["dp_ranks"]] == [128, 128] and h["pages_total"] == 256, h
        prompts = prompts_for([9, 4, 13, 6], seed=21)
        # long enough (rounds) that A still runs while C and D are admitted, whatever the machine's load (B may end
        # first: C or D then takes rank 1 either way); A runs LONGER: under load 12 a 240-token A ended while B was
        # being placed and C and D both went to rank 0 (ciP)
        long = [
            {"prompt": q, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            for q, n in zip(prompts[:2], (LONGER, LONG), strict=True)
        ]
        short = [
            {"prompt": prompts[2], "max_tokens": 8, "temperature": 0, "ignore_eos": True},
            {"prompt": prompts[3], "max_tokens": 8, "temperature": 0.8, "seed": 17, "ignore_eos": True},
        ]
        threads = [threading.Thread(target=post, args=("a", long[0]))]
        threads[0].start()
        wait_for(lambda: _in_flight(url) == [1, 0] or "a" in got, 60, "A placed", [p])
        threads.append(threading.Thread(target=stream, args=("b", long[1])))
        threads[1].start()
        wait_for(lambda: _in_flight(url) == [1, 1] or "b" in got, 60, "B placed", [p])
        assert "a" not in got and "b" not in got, "A or B finished before C and D came: placement untestable"
        for name, body in zip("cd", short, strict=True):  # concurrent: the first placed goes to rank 0
            threads.append(threading.Thread(target=post, args=(name, body)))
            threads[-1].start()
        for t in threads:
            t.join(300)
        assert got["a"]["dp_rank"] == 0 and got["b"]["dp_rank"] == {1}
        assert sorted([got["c"]["dp_rank"], got["d"]["dp_rank"]]) == [0, 1]
        one = engine(ARCH, page_size=4, max_tokens=512)
        want = one.generate(prompts[:1], SamplingParams(max_new_tokens=LONGER, ignore_eos=True))
        want += one.generate(prompts[1:2], SamplingParams(max_new_tokens=LONG, ignore_eos=True))
        want += one.generate(prompts[2:3], SamplingParams(max_new_tokens=8, ignore_eos=True))
        want += one.generate(prompts[3:], SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=17))
        assert [got[n]["choices"][0]["token_ids"] for n in "abcd"] == want

        def settled() -> bool:
            rows = _rows(url)
            return [(r["pages_used"], r["in_flight"], r["running"], r["waiting"]) for r in rows] == [(0, 0, 0, 0)] * 2

        wait_for(settled, 60, "both DP ranks idle with 0 pages used", [p])
        rows = _rows(url)
        assert [r["requests_total"] for r in rows] == [2, 2]
        assert [r["generated_tokens"] for r in rows] == [LONGER + 8, LONG + 8]
        metrics = httpx.get(f"{url}/metrics", timeout=30).text
        for r in (0, 1):
            assert f'dsakv_dp_requests_total{{dp_rank="{r}"}} 2' in metrics, metrics
            assert f'dsakv_dp_pages_used{{dp_rank="{r}"}} 0' in metrics, metrics

        # rank 1 next (loads 1, 0): a request that can never fit is refused at add by rank 0's checks (413), placing
        # nothing; n = 2 choices both run on rank 1 (seed + i each); a client leaving a stream on rank 1 aborts it
        # there and frees its pages
        g = threading.Thread(target=post, args=("g", {**long[0], "max_tokens": LONGER}))  # runs through H and I
        g.start()
        wait_for(lambda: _in_flight(url) == [1, 0] or "g" in got, 60, "G placed", [p])
        big = {"prompt": prompts[2], "max_tokens": 600, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=big, timeout=60)
        assert r.status_code == 413 and "600" in r.json()["error"]["message"], r.text
        assert _in_flight(url) in ([1, 0], [0, 0])
        post("h", {"prompt": prompts[3], "max_tokens": 8, "temperature": 0.8, "seed": 5, "n": 2, "ignore_eos": True})
        assert got["h"]["dp_rank"] == 1 and "g" not in got
        seeds = [SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=5 + i) for i in range(2)]
        assert [c["token_ids"] for c in got["h"]["choices"]] == one.generate([prompts[3]] * 2, seeds)
        leave = {"prompt": prompts[1], "max_tokens": 400, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=leave, timeout=300) as resp:
            lines = resp.iter_lines()  # held: a dropped iterator closes the response (the client leaves)
            first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
            assert first["dp_rank"] == 1
            wait_for(lambda: [r["pages_used"] > 0 for r in _rows(url)][1:] == [True], 60, "I holds pages", [p])
        g.join(300)
        want_g = one.generate(prompts[:1], SamplingParams(max_new_tokens=LONGER, ignore_eos=True))[0]
        assert got["g"]["choices"][0]["token_ids"] == want_g == want[0]  # G is A again (both LONGER)
        wait_for(settled, 60, "both DP ranks idle with 0 pages used after the abort", [p])
        assert [r["requests_total"] for r in _rows(url)] == [3, 4]
        assert p.stop(timeout=60) in (0, -15), p.tail()
    finally:
        p.kill()
    log = (tmp_path / "serve.log").read_text()
    assert "DP group stopped: dp rank 1 exited 0" in log and "RankDown" not in log, log


def test_serve_dp2_rank_killed_fails_requests_by_name(tmp_path) -> None:
    """kill -9 of DP rank 1 with a request running on each rank: every MoE layer needs both ranks' experts, so both
    requests fail at once naming the dead rank and its signal (no hang), /health and new requests answer 503, and
    rank 0's own pages are freed."""
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(tiny_path(ARCH)), "--port", str(port), "--page-size", "4", "--max-tokens", "4096",
        "--threads", "1", *DP,
    )  # fmt: skip
    p = Proc("serve-dp2-kill", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    got: dict[int, httpx.Response] = {}

    def post(i: int) -> None:
        body = {"prompt": [5, 6, 7 + i], "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        got[i] = httpx.post(f"{url}/v1/completions", json=body, timeout=300)

    try:
        wait_for(lambda: _health(url) is not None, 240, "serve DP 2", [p])
        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: [r["running"] for r in _rows(url)] == [1, 1], 60, "a request running on each rank", [p])
        (rank1,) = [k for k in child_pids(p.pid) if b"DSAKV_TP_RANK=1" in _environ(k)]
        os.kill(rank1, signal.SIGKILL)
        for t in threads:
            t.join(120)
        dead = f"DP rank down: dp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
        for i in range(2):
            assert got[i].status_code == 500 and dead in got[i].json()["error"]["message"], got[i].text
        h = httpx.get(f"{url}/health", timeout=10)
        assert h.status_code == 503 and dead in h.json()["error"], h.text
        assert h.json()["dp_ranks"][0]["pages_used"] == 0, h.text
        r = httpx.post(f"{url}/v1/completions", json={"prompt": [5], "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and dead in r.text, r.text
    finally:
        p.kill()
