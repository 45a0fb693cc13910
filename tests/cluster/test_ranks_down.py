"""A TP rank that dies (kill -9) fails its requests with a clear error naming it and its exit status instead of
hanging: under `serve --tp-size 2` the streamed request in flight ends with that error, its pages are freed,
/health is 503 naming the rank, new requests get 503; `generate --tp-size 2` exits 2 with it, before the group
is joined as well as after. The group is not re-formed (the server must be restarted)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import httpx

from dsakv.testing.cluster import wait_for
from dsakv.testing.engines import prompts_for, tiny_path
from dsakv.testing.listen import child_pids, listening_sockets
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

ARCH = "glm_moe_dsa"


def _rank1(pid: int) -> int | None:
    """The pid of TP rank 1 among `pid`'s children (DSAKV_TP_RANK=1 in its environment), None before it runs."""
    for kid in child_pids(pid):
        try:
            env = Path(f"/proc/{kid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"DSAKV_TP_RANK=1" in env:
            return kid
    return None


def _up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


def test_serve_tp2_rank_killed_fails_request_in_flight(tmp_path) -> None:
    port = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    cmd = dsakv_cmd(
        "serve", "--model", str(tiny_path(ARCH)), "--port", str(port), "--page-size", "4", "--max-tokens", "512",
        "--threads", "1", "--tp-size", "2",
    )  # fmt: skip
    p = Proc("serve-tp2", cmd, tmp_path / "serve.log", f"127.0.0.1:{port}").start()
    try:
        wait_for(lambda: _up(url), 240, "serve --tp-size 2", [p])
        pid1 = _rank1(p.pid)
        assert pid1 is not None
        body = {"prompt": prompts_for([9], seed=3)[0], "max_tokens": 400, "temperature": 0, "ignore_eos": True}
        chunks: list[dict] = []
        with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=300) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunks.append(json.loads(line[6:]))
                if len(chunks) == 1:  # the request is in flight (399 tokens to go): kill rank 1
                    assert chunks[0]["choices"][0]["token_ids"]
                    os.kill(pid1, signal.SIGKILL)
        why = f"tp rank 1 (pid {pid1}) was killed by signal 9 (SIGKILL)"
        assert chunks[-1]["error"]["message"].startswith(f"generation failed: engine step failed: RankDown: TP rank "
                                                         f"down: {why}"), chunks[-1]  # fmt: skip
        assert sum(len(c["choices"][0]["token_ids"]) for c in chunks[:-1]) < 400  # it ended early, with the error
        h = httpx.get(f"{url}/health", timeout=30)
        assert h.status_code == 503
        assert h.json()["ok"] is False and why in h.json()["error"]
        assert (h.json()["pages_used"], h.json()["running"], h.json()["waiting"]) == (0, 0, 0)  # its pages freed
        r2 = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r2.status_code == 503
        msg = r2.json()["error"]["message"]
        assert msg.startswith("the engine is stopped after an internal error (RankDown: TP rank down: ") and why in msg
        assert msg.endswith("restart the server")
    finally:
        p.kill()
    assert f"TP rank down: {why}" in (tmp_path / "serve.log").read_text()


def _generate(tmp_path: Path, name: str) -> Proc:
    prompts = prompts_for([7, 12], seed=4)
    argv = ["generate", "--model", str(tiny_path(ARCH)), "--max-new-tokens", "300", "--ignore-eos", "--page-size",
            "4", "--threads", "1", "--max-tokens", "1024", "--json", "--tp-size", "2"]  # fmt: skip
    for q in prompts:
        argv += ["--prompt-ids", ",".join(map(str, q))]
    return Proc(name, dsakv_cmd(*argv), tmp_path / f"{name}.log").start()


def _kill_rank1_when(p: Proc, ready) -> int:  # noqa: ANN001 (a predicate on rank 1's pid)
    box: list[int] = []

    def found() -> bool:
        pid = _rank1(p.pid)
        if pid is not None and ready(pid):
            box.append(pid)
            return True
        return False

    wait_for(found, 240, "TP rank 1", [p])
    os.kill(box[0], signal.SIGKILL)
    return box[0]


def test_generate_tp2_rank_killed_before_joining_fails_at_once(tmp_path) -> None:
    p = _generate(tmp_path, "gen-early")
    try:
        pid1 = _kill_rank1_when(p, lambda pid: True)  # at once: it has not imported torch yet
        assert p.wait(240) == 2
    finally:
        p.kill()
    log = (tmp_path / "gen-early.log").read_text()
    want = f"dsakv generate: error: tp rank 1 (pid {pid1}) was killed by signal 9 (SIGKILL) before joining the TP "
    assert want + "group of 2 ranks" in log, log[-2000:]


def test_generate_tp2_rank_killed_in_group_fails_with_its_status(tmp_path) -> None:
    p = _generate(tmp_path, "gen-late")
    try:
        # rank 1 listens for its gloo pairs once the group's store let it in: killed from then on
        pid1 = _kill_rank1_when(p, lambda pid: bool(listening_sockets(pid, with_children=False)))
        assert p.wait(240) == 2
    finally:
        p.kill()
    log = (tmp_path / "gen-late.log").read_text()
    assert f"tp rank 1 (pid {pid1}) was killed by signal 9 (SIGKILL)" in log, log[-2000:]
    assert "dsakv generate: error: " in log and '"output_ids"' not in log
