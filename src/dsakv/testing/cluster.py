"""Test support for the disaggregated-serving tests: real `dsakv serve --role ...` processes on 127.0.0.1.

Processes and ports come from dsakv.util.procs (Proc, free_ports: the launcher the demo and benches use too).
Every process runs in its own session (process group), logs to a file, and is killed with its group by
`Cluster.close()` (a fixture finalizer), so nothing outlives a test even when it fails. Worker options are the
configuration tree rendered to argv (dsakv.engine.argv.engine_argv).
"""

from __future__ import annotations

import functools
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsakv.config import (
    Config,
    EngineConfig,
    LayoutConfig,
    PipelineConfig,
    PoolConfig,
    RouterConfig,
    SchedulerConfig,
    TransferConfig,
)
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.protocol.rpc import RpcClient, RpcError
from dsakv.disagg.router.backend import RouterBackend
from dsakv.engine.argv import engine_argv
from dsakv.engine.request import SamplingParams
from dsakv.testing.config import engine_config
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

__all__ = [
    "DP_ARGS",
    "MARK_ENV",
    "Cluster",
    "Proc",
    "assert_clean",
    "call",
    "free_ports",
    "http_up",
    "marked",
    "marked_env",
    "marked_pid",
    "role_config",
    "run_requests",
    "start_marked",
    "wait_for",
    "worker_config",
]

DP_ARGS = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]  # DP attention, 2 ranks
PAGE_SIZE = 16
NUM_PAGES = 96  # 1536 tokens per pool: small pools register fast


def worker_config(elide: bool) -> EngineConfig:
    """Every test worker's engine: exact fp32 rows, PAGE_SIZE x NUM_PAGES, 256 tokens per step."""
    return EngineConfig(
        layout=LayoutConfig(elide=elide, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE),
        pool=PoolConfig(num_pages=NUM_PAGES),
        scheduler=SchedulerConfig(max_batch_tokens=256),
    )


def role_config(
    engine: dict[str, Any] | None = None, backend: str = "local", pipeline: dict[str, Any] | None = None
) -> Config:
    """The configuration tree of an in-process role: `engine` in flat keywords (dsakv.testing.config.OPTIONS),
    the transfer backend, and the pipeline branch's fields (pp_size, pp_rank, partition, stage_timeout, ...)."""
    return Config(
        engine=engine_config(**(engine or {})),
        transfer=TransferConfig(backend=backend),
        pipeline=PipelineConfig(**(pipeline or {})),
    )


def call(addr: str, method: str, params: Any = None, timeout: float = 5.0) -> Any:
    c = RpcClient(addr, timeout=timeout, connect_timeout=min(2.0, timeout))
    try:
        return c.call(method, params)
    finally:
        c.close()


def _not_yet() -> tuple[type[BaseException], ...]:
    """What a predicate may raise while the thing it waits for is not up yet: an RPC or socket error, or an HTTP
    client's transport error (httpx's are not OSErrors: a server still starting refused the connection and ended
    the wait at once, ciH: test_disagg_listen's router under load)."""
    try:
        import httpx
    except ImportError:
        return (RpcError, OSError)
    return (RpcError, OSError, httpx.TransportError)


def wait_for(pred: Callable[[], Any], timeout: float, what: str, procs: Sequence[Proc] = ()) -> Any:
    end = time.monotonic() + timeout
    not_yet = _not_yet()
    procs = [p for p in procs if p.alive()]  # only those alive now must stay alive
    last: Any = None
    while time.monotonic() < end:
        try:
            last = pred()
            if last:
                return last
        except not_yet as e:
            last = e
        for p in procs:
            if not p.alive():
                raise AssertionError(f"{p.name} exited while waiting for {what}:\n{p.tail()}")
        time.sleep(0.1)
    logs = "\n".join(f"--- {p.name}\n{p.tail(25)}" for p in procs)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})\n{logs}")


@dataclass
class Cluster:
    """Worker processes of one test module; close() kills them all."""

    model: Path
    logdir: Path
    procs: list[Proc] = field(default_factory=list)
    routers: list[RouterBackend] = field(default_factory=list)

    def _serve(self, name: str, addr: str, args: list[str]) -> Proc:
        cmd = dsakv_cmd("serve", "--model", str(self.model), *args)
        p = Proc(name, cmd, self.logdir / f"{name}.log", addr).start()
        self.procs.append(p)
        return p

    def decode(self, name: str, backend: str, elide: bool, port: int | None = None, extra: Sequence[str] = ()) -> Proc:
        port = port or free_ports(1)
        args = ["--role", "decode", "--port", str(port), "--transfer-backend", backend]
        args += [*engine_argv(worker_config(elide)), *extra]
        return self._serve(name, f"127.0.0.1:{port}", args)

    def prefill(
        self,
        name: str,
        backend: str,
        elide: bool,
        partition: Sequence[int],
        port: int | None = None,
        ranks: Sequence[int] | None = None,
        extra: Sequence[str] = (),
    ) -> list[Proc]:
        n = len(partition)
        port = port or free_ports(n + 1)
        args = ["--role", "prefill", "--port", str(port), "--transfer-backend", backend, "--pp-size", str(n)]
        args += ["--pp-partition", ",".join(map(str, partition)), "--worker-name", name]
        args += [*engine_argv(worker_config(elide)), *extra]
        out = []
        for k in ranks if ranks is not None else range(n):
            out.append(self._serve(f"{name}-s{k}", f"127.0.0.1:{port + k}", [*args, "--pp-rank", str(k)]))
        return out

    def dp_ranks(self, rank0: Proc, size: int, timeout: float = 90.0) -> list[str]:
        """The RPC addresses of the `size` DP ranks of the instance (prefill or decode, `DP_ARGS`) whose rank 0 is
        `rank0` (rank r listens on rank 0's port + r), once every rank answers its health ok."""
        host, port = rank0.addr.rsplit(":", 1)
        addrs = [f"{host}:{int(port) + r}" for r in range(size)]
        for a in addrs:
            wait_for(functools.partial(_healthy, a), timeout, f"DP rank {a} healthy", self.procs)
        return addrs

    def decode_pp(
        self, name: str, backend: str, partition: Sequence[int], port: int | None = None, extra: Sequence[str] = ()
    ) -> list[Proc]:
        """Every stage of a pipelined decode (as `--pp-size N` without --pp-rank starts them), stage k at port + k;
        `extra` e.g. --tp-size T (each stage's rank 0 starts its ranks 1..T-1)."""
        n = len(partition)
        port = port or free_ports(n + 1)
        args = ["--role", "decode", "--port", str(port), "--transfer-backend", backend, "--pp-size", str(n)]
        args += ["--pp-partition", ",".join(map(str, partition)), "--worker-name", name]
        args += [*engine_argv(worker_config(True)), *extra]
        return [self._serve(f"{name}-s{k}", f"127.0.0.1:{port + k}", [*args, "--pp-rank", str(k)]) for k in range(n)]

    def router(self, prefill: Sequence[str], decode: Sequence[str], **kw: Any) -> RouterBackend:
        kw.setdefault("kv_timeout", 20.0)
        kw.setdefault("rpc_timeout", 3.0)
        kw.setdefault("health_interval", 0.2)
        r = RouterBackend(RouterConfig(prefill=tuple(prefill), decode=tuple(decode), **kw))
        r.start()
        self.routers.append(r)
        return r

    def wait_healthy(self, procs: Sequence[Proc], timeout: float = 120.0) -> None:
        for p in procs:
            wait_for(functools.partial(_healthy, p.addr), timeout, f"{p.name} healthy", procs)

    def close(self) -> None:
        for r in self.routers:
            try:
                r.stop()
            except Exception:
                pass
        for p in self.procs:
            p.signal(signal.SIGKILL)
        for p in self.procs:
            p.kill()


def run_requests(
    router: RouterBackend,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    prefix: str,
    timeout: float = 60.0,
) -> list[tuple[list[int], str | None, str | None]]:
    """Submit all, then collect (tokens, finish_reason, error) of each, in order."""
    rids = [f"{prefix}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        router.submit(rid, list(p), params)
    out = []
    for rid in rids:
        toks: list[int] = []
        reason = error = None
        for ev in router.events(rid, timeout):
            toks += ev.new_token_ids
            if ev.finished:
                reason, error = ev.finish_reason, ev.error
        out.append((toks, reason, error))
    return out


def pages_and_integrity(addr: str) -> tuple[int, str]:
    h = fetch_health(addr, timeout=3.0)
    return h.pages_used, h.integrity


def _healthy(addr: str) -> Any:
    return call(addr, "health", timeout=2.0).get("ok")


def _clean(addr: str) -> bool:
    return pages_and_integrity(addr) == (0, "ok")


def assert_clean(addrs: Sequence[str], timeout: float = 20.0, procs: Sequence[Proc] = ()) -> None:
    """Every worker at addrs holds no page and its books balance (waits for in-flight work to settle)."""
    for a in addrs:
        wait_for(functools.partial(_clean, a), timeout, f"{a}: no page held, integrity ok", procs)


# ---- a colocated world (rank, stage processes one command starts), marked so a test finds each process ------------

MARK_ENV = "DSAKV_TEST_RUN"  # a test run's mark, inherited by every process the command starts


def marked(mark: str, env: dict[str, str] | None = None) -> list[int]:
    """The pids of live processes whose environment holds MARK_ENV=mark and every `env` pair (e.g. a grid's stage
    and rank: {PP_RANK_ENV: "1", TP_RANK_ENV: "1"})."""
    want = {f"{MARK_ENV}={mark}".encode(), *(f"{k}={v}".encode() for k, v in (env or {}).items())}
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            have = set((d / "environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if want <= have:
            out.append(int(d.name))
    return out


def marked_pid(mark: str, env: dict[str, str]) -> int:
    """The one live process of run `mark` whose environment holds every `env` pair."""
    pids = marked(mark, env)
    assert len(pids) == 1, f"{len(pids)} processes of this run hold {env}, not 1: {pids}"
    return pids[0]


def marked_env(mark: str) -> dict[str, str]:
    """The environment of a command of run `mark` (this one's, CHILD_ENV, MARK_ENV=mark)."""
    import os

    from dsakv.util.procs import CHILD_ENV

    return {**os.environ, **CHILD_ENV, MARK_ENV: mark}


def start_marked(name: str, argv: Sequence[str], log: Path, port: int) -> tuple[Proc, str]:
    """`dsakv *argv` serving on 127.0.0.1:`port` with a fresh mark every process it starts inherits (`marked`):
    (the process, the mark)."""
    import uuid

    mark = uuid.uuid4().hex
    return Proc(name, dsakv_cmd(*argv), log, f"127.0.0.1:{port}", env=marked_env(mark)).start(), mark


def http_up(url: str) -> bool:
    """GET url/health answers 200."""
    import httpx

    try:
        return httpx.get(f"{url}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False
