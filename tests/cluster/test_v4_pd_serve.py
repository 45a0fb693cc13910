"""DeepSeek-V4 through the serve roles a user starts: `dsakv serve --role decode` and `--role prefill` (PP 1, and PP 2
whose stage 1 is a child process with its own pool and engine) as real processes over mooncake and nixl, the router
in this process. Tokens == a colocated V4Engine (itself == transformers, test_v4_engine); the KV bytes the decode
took == per request pages x the layout's bytes per page + its state bytes (the stages' keys partition the decode's);
seeded sampling draws the colocated tokens; every pool ends empty with its books balanced; logprobs are refused
naming the parameter; a prefill started against a decode of another page size exits naming the kind and both sizes."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from dsakv.disagg.protocol.messages import decode_health, prefill_health  # noqa: E402
from dsakv.engine.request import SamplingParams  # noqa: E402
from dsakv.engine.v4_engine import V4Engine  # noqa: E402
from dsakv.model.deepseek_v4 import load_v4  # noqa: E402
from dsakv.model.deepseek_v4_tiny import make_tiny_v4  # noqa: E402
from dsakv.spec.v4 import V4Spec  # noqa: E402
from dsakv.spec.v4_layout import V4Layout  # noqa: E402
from dsakv.testing.cluster import Cluster, Proc, assert_clean, run_requests, wait_for  # noqa: E402
from dsakv.util import ceil_div  # noqa: E402
from dsakv.util.procs import free_ports  # noqa: E402

NEW = 8
PAGE = 16
LENGTHS = (5, 17, 24, 40)  # up to 5x the window (8), several CSA (4) and HCA (16) groups
ROLE_ARGS = ["--page-size", str(PAGE), "--num-pages", "48", "--max-running-requests", "4", "--kv-timeout", "60"]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4pdserve") / "flash", "flash")


@pytest.fixture(scope="module")
def colocated(ckpt: Path) -> list[list[int]]:
    eng = V4Engine(load_v4(ckpt), num_pages=64, max_running=4)
    return [r.output for r in eng.generate(_prompts(), NEW)]


@functools.cache
def _sampled_cached(ckpt: Path, temperature: float, top_p: float, seed: int) -> list[list[int]]:
    eng = V4Engine(load_v4(ckpt), num_pages=64, max_running=4)
    sp = SamplingParams(max_new_tokens=NEW, temperature=temperature, top_p=top_p, seed=seed)
    ids = [eng.add_request(p, NEW, sampling=sp, seed=seed) for p in _prompts()]
    while eng.has_unfinished():
        eng.step()
    return [eng.finished[i].output for i in ids]


def _sampled(ckpt: Path, sp: SamplingParams) -> list[list[int]]:
    """A colocated V4Engine's seeded draws of the module's prompts."""
    return _sampled_cached(ckpt, sp.temperature, sp.top_p, int(sp.seed or 0))


def _figure(ckpt: Path, prompt_len: int) -> int:
    """The layout figure of one request to a whole decode: its prompt pages x bytes per page + its state bytes."""
    lay = V4Layout(V4Spec.from_path(ckpt), kv_format="fp32", index_format="fp32", page_size=PAGE)
    per_page = sum(b.page_bytes for b in lay.paged)
    return ceil_div(prompt_len, PAGE) * per_page + lay.state_bytes_per_request


def _role(cluster: Cluster, name: str, role: str, backend: str, extra: list[str], ports: int = 1) -> Proc:
    port = free_ports(ports)
    args = ["--role", role, "--port", str(port), "--transfer-backend", backend, "--worker-name", name]
    return cluster._serve(name, f"127.0.0.1:{port}", [*args, *ROLE_ARGS, *extra])


@pytest.fixture(scope="module", params=["mooncake", "nixl"])
def world(request: pytest.FixtureRequest, ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    backend = request.param
    cluster = Cluster(ckpt, tmp_path_factory.mktemp(f"v4pd-{backend}"))
    try:
        decode = _role(cluster, "v4-decode", "decode", backend, [])
        pp1 = _role(cluster, "v4-pp1", "prefill", backend, ["--prefix-cache"])
        pp2 = _role(cluster, "v4-pp2", "prefill", backend, ["--pp-size", "2", "--pp-partition", "3,3"])
        cluster.wait_healthy([decode, pp1, pp2], timeout=180)
        yield {"backend": backend, "cluster": cluster, "decode": decode, "pp1": pp1, "pp2": pp2}
    finally:
        cluster.close()


@pytest.mark.parametrize("prefill", ["pp1", "pp2"])
def test_v4_pd_roles_tokens_bytes_and_clean_pools(
    world: dict, ckpt: Path, colocated: list[list[int]], prefill: str
) -> None:
    cluster, decode, pre = world["cluster"], world["decode"], world[prefill]
    router = cluster.router([pre.addr], [decode.addr], kv_timeout=60.0)
    before = decode_health(decode.addr).counters["kv_bytes"]
    prompts = _prompts()
    got = run_requests(router, prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0), f"v4-{prefill}", 120)
    assert [t for t, _, _ in got] == colocated
    assert [(r, e) for _, r, e in got] == [("length", None)] * len(prompts)
    h = decode_health(decode.addr)
    assert h.counters["kv_bytes"] - before == sum(_figure(ckpt, len(p)) for p in prompts)
    assert sorted(s.stage for s in h.stages if s.prefill == f"v4-{prefill}") == list(
        range(2 if prefill == "pp2" else 1)
    )
    if prefill == "pp1":  # the same prompts again: the prefill's prefix cache supplies their whole pages
        again = run_requests(router, prompts, SamplingParams(max_new_tokens=NEW, temperature=0.0), "v4-again", 120)
        assert [t for t, _, _ in again] == colocated
    hot = SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=13)
    sampled = run_requests(router, prompts, hot, f"v4-s-{prefill}", 120)
    assert [t for t, _, _ in sampled] == _sampled(ckpt, hot)  # token 0 drawn on the prefill, 1.. on the decode
    bad = run_requests(router, [prompts[0]], SamplingParams(max_new_tokens=4, logprobs=2), f"v4-lp-{prefill}")
    assert bad[0][0] == [] and bad[0][1] == "error" and "does not take logprobs 2" in (bad[0][2] or "")
    assert router.features == frozenset()  # the decode's health says so: the HTTP layer answers 400 up front
    assert_clean([decode.addr] + ([pre.addr] if prefill == "pp2" else []), timeout=30, procs=cluster.procs)
    if prefill == "pp1":  # what it holds is its prefix cache's pages, nothing of a request
        wait_for(lambda: _cache_only(pre.addr), 30, "v4-pp1: only cached pages held, integrity ok", cluster.procs)


def _cache_only(addr: str) -> bool:
    h = prefill_health(addr)
    return h.pages_used == h.cache_pages > 0 and h.integrity == "ok" and h.jobs == 0


def test_v4_prefill_refuses_a_decode_of_another_page_size(world: dict, ckpt: Path) -> None:
    cluster, backend = world["cluster"], world["backend"]
    if backend != "mooncake":
        pytest.skip("the handshake is the backend's business only after the keys pair: one backend shows it")
    other = _role(cluster, "v4-decode32", "decode", backend, ["--page-size", "32"])
    cluster.wait_healthy([other], timeout=120)
    port = free_ports(1)
    cmd = [
        sys.executable, "-m", "dsakv", "serve", "--role", "prefill", "--model", str(ckpt), "--port", str(port),
        "--transfer-backend", backend, "--decode", other.addr, *ROLE_ARGS, "--startup-wait", "30",
    ]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert r.returncode == 2, r.stderr[-3000:]
    assert "csa_kv" in r.stderr and "16" in r.stderr and "32" in r.stderr, r.stderr[-3000:]
    r = subprocess.run([*cmd[:-4], "--pp-size", "2", "--pp-rank", "1"], capture_output=True, text=True, timeout=180)
    assert r.returncode == 2 and "a DeepSeek-V4 prefill starts its stages itself" in r.stderr, r.stderr[-3000:]


def test_a_dead_stage_takes_the_pp2_prefill_out_of_service(world: dict) -> None:
    """Runs last in the module: stage 1 of the PP 2 prefill is killed; its health says so (the router then routes
    elsewhere), and a submit is refused as unavailable, nothing held on the decode."""
    cluster, pre, decode = world["cluster"], world["pp2"], world["decode"]
    h = prefill_health(pre.addr)
    stage1 = next(s for s in h.stages if s.stage == 1)
    assert h.ok and stage1.pid is not None and stage1.pid != h.pid and stage1.layers == [3, 5]
    os.kill(stage1.pid, signal.SIGKILL)
    down = wait_for(lambda: prefill_health(pre.addr).down, 30, "pp2 down", cluster.procs)
    assert down == f"stage 1 (pid {stage1.pid}) exited with code -9: restart this prefill"
    assert not prefill_health(pre.addr).ok
    assert_clean([decode.addr], timeout=30, procs=cluster.procs)


@pytest.mark.parametrize("partition", ["1,2,3"])
def test_v4_generate_with_pipeline_stages_equals_one_process(
    ckpt: Path, colocated: list[list[int]], partition: str
) -> None:
    """`dsakv generate --pp-size N` on a V4 checkpoint: stages 1.. are child processes holding their layers'
    kinds only; greedy and seeded tokens == one process's."""
    n = len(partition.split(","))
    base = [sys.executable, "-m", "dsakv", "generate", "--model", str(ckpt), "--max-new-tokens", str(NEW),
            "--page-size", str(PAGE), "--json", "--ignore-eos"]  # fmt: skip
    for p in _prompts():
        base += ["--prompt-ids", ",".join(map(str, p))]
    staged = [*base, "--pp-size", str(n), "--pp-partition", partition]
    r = subprocess.run(staged, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [row["output_ids"] for row in json.loads(r.stdout)] == colocated
    hot = ["--temperature", "0.8", "--top-p", "0.9", "--seed", "13"]
    one, piped = (
        subprocess.run(c, capture_output=True, text=True, timeout=300) for c in ([*base, *hot], [*staged, *hot])
    )
    assert one.returncode == piped.returncode == 0, piped.stderr[-3000:]
    assert json.loads(one.stdout) == json.loads(piped.stdout)
    assert [row["output_ids"] for row in json.loads(piped.stdout)] == _sampled(
        ckpt, SamplingParams(max_new_tokens=NEW, temperature=0.8, top_p=0.9, seed=13)
    )
    bad = subprocess.run([*staged, "--prefix-cache"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "no prefix cache or host / L3 tier yet" in bad.stderr, bad.stderr[-3000:]
