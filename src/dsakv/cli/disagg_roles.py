"""`dsakv serve --role prefill|decode|router`: the disaggregated roles (called by dsakv.cli.serve_cmd).

    dsakv serve --role decode  --model DIR --port 9100 [--transfer-backend mooncake|nixl] [--no-elide]
    dsakv serve --role prefill --model DIR --port 9200 --pp-size 2 [--pp-partition 7,5] [--pp-rank K]
    dsakv serve --role router  --port 8000 --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 [--model DIR]

serve_cmd adds the shared options (--model --host --port --elide --kv-format --index-format --page-size
--kv-budget/--num-pages/--max-tokens --max-batch-tokens --max-running-requests --dtype --threads --seed ...);
this module adds only role-specific ones. Heavy imports (torch, the engine) happen inside run_role.
Without --pp-rank, a prefill with --pp-size N > 1 starts its N stages as child processes and waits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import time
from typing import Any

from dsakv.errors import ConfigError

log = logging.getLogger("dsakv.disagg")

BACKEND_CHOICES = ("mooncake", "nixl", "local")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated serving (--role prefill | decode | router)")
    g.add_argument(
        "--transfer-backend",
        choices=BACKEND_CHOICES,
        default="mooncake",
        help="KV transfer engine (default mooncake; both peers must use the same)",
    )
    g.add_argument("--pp-size", type=int, default=1, help="prefill: pipeline stages, one process each (default 1)")
    g.add_argument(
        "--pp-rank",
        type=int,
        default=None,
        help="prefill: run only this stage (default: start all --pp-size stages as child processes)",
    )
    g.add_argument(
        "--pp-partition",
        default=None,
        metavar="N,N,..",
        help="prefill: layers per stage, e.g. 5,3,2,2 (default: even split, earlier stages larger)",
    )
    g.add_argument(
        "--dist-port", type=int, default=None, help="prefill: stage 0's gloo rendezvous port (default --port + pp-size)"
    )
    g.add_argument("--stage0-host", default=None, help="prefill: host of stage 0 (default --host)")
    g.add_argument(
        "--stage-timeout",
        type=float,
        default=10.0,
        help="prefill: bound on every activation send/receive between stages; a stage silent this long is "
        "dropped and the pipeline re-forms (default 10 s)",
    )
    g.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="router: a prefill worker's stage-0 address (repeat for several)",
    )
    g.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="router: a decode worker (repeat); prefill: handshake with it at startup (optional)",
    )
    g.add_argument(
        "--kv-timeout",
        type=float,
        default=30.0,
        help="router: seconds from dispatch until a request's prefill + KV transfer must be done (default 30)",
    )
    g.add_argument("--rpc-timeout", type=float, default=5.0, help="bound on every control-plane call (default 5 s)")
    g.add_argument(
        "--queue-timeout", type=float, default=60.0, help="router: how long a request may wait for a free pair (60 s)"
    )
    g.add_argument("--health-interval", type=float, default=0.5, help="router: seconds between health polls (0.5)")
    g.add_argument(
        "--affinity-min-gain-pages",
        type=int,
        default=1,
        help="router: send a request to the prefill that caches most of its prompt only when that saves at least "
        "this many whole pages over the least loaded prefill (1); otherwise route by load",
    )
    g.add_argument(
        "--affinity-max-imbalance",
        type=int,
        default=4,
        help="router: ... and only when that prefill has at most this many more requests in flight (4)",
    )
    g.add_argument("--worker-name", default=None, help="prefill/decode: name in logs and handshakes")
    g.add_argument(
        "--mooncake-timeout",
        type=int,
        default=None,
        help="mooncake's own per-transfer timeout in seconds (MC_TRANSFER_TIMEOUT, min 5; default 30)",
    )
    g.add_argument(
        "--startup-wait",
        type=float,
        default=60.0,
        help="prefill: how long the startup handshake with --decode workers waits for them to come up (60 s)",
    )
    g.add_argument("--debug-transfer-delay", type=float, default=0.0, help=argparse.SUPPRESS)


def _partition(args: argparse.Namespace) -> tuple[int, ...] | None:
    from dsakv.plan.capacity import parse_partition

    return parse_partition(str(args.pp_partition)) if args.pp_partition else None


def _backend_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.transfer_backend == "mooncake":
        opts: dict[str, Any] = {"hostname": args.host}
        if args.mooncake_timeout is not None:
            opts["engine_timeout_s"] = args.mooncake_timeout
        return opts
    if args.transfer_backend == "nixl":
        from dsakv.disagg.backends.nixl import LOOPBACK_UCX_ENV

        return {"env": LOOPBACK_UCX_ENV} if args.host in ("127.0.0.1", "localhost") else {}
    return {}


def _install_sigterm(stop: Any) -> None:
    def handler(signum: int, frame: Any) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _exit_now(rc: int) -> int:
    """Leave without interpreter finalization: nixl-cu12 1.5.1 segfaults in its agent's teardown at exit
    (even a bare nixl_agent does), which would turn a clean stop into exit code 139."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def _start_or_exit(worker: Any, **kw: Any) -> None:
    """worker.start(); on a startup error print it, stop what started and exit 2 (no finalization: see _exit_now)."""
    try:
        worker.start(**kw)
    except Exception as e:
        print(f"dsakv serve: error: {e}", file=sys.stderr)
        try:
            worker.stop()
        finally:
            _exit_now(2)


def _threads(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads if args.threads is not None else 1)


def run_decode(args: argparse.Namespace) -> int:
    from dsakv.cli.serve_cmd import engine_kwargs, model_dir_of
    from dsakv.disagg.decode_worker import DecodeConfig, DecodeWorker
    from dsakv.spec.model import ModelSpec

    model_dir = model_dir_of(args)
    _threads(args)
    spec = ModelSpec.from_path(model_dir)
    cfg = DecodeConfig(
        model=str(model_dir),
        host=args.host,
        port=args.port,
        name=args.worker_name,
        engine=engine_kwargs(args, spec),
        backend=args.transfer_backend,
        backend_options=_backend_options(args),
        rpc_timeout=args.rpc_timeout,
    )
    worker = DecodeWorker(cfg)
    _install_sigterm(worker.request_stop)
    _start_or_exit(worker)
    log.info("decode worker %s ready on %s", worker.name, worker.address)
    print(f"dsakv decode ready on {worker.address}", flush=True)
    try:
        worker.serve_forever()
    finally:
        worker.stop()
    return _exit_now(0)


def _stage_pages(args: argparse.Namespace, spec: Any, ranges: list[tuple[int, int]]) -> int | None:
    """Every stage of a worker has the same page count: the minimum over stages for --kv-budget."""
    from dsakv.cli.serve_cmd import num_pages_for

    if args.kv_budget is not None:
        return min(int(num_pages_for(args, spec, a, b) or 0) for a, b in ranges)
    if args.num_pages is not None:
        return int(args.num_pages)
    if args.max_tokens is not None:
        return -(-int(args.max_tokens) // args.page_size)
    return None


def _launch_stages(args: argparse.Namespace) -> int:
    """Start every stage of the prefill worker as a child process and supervise them: a stage that dies is
    started again (it rejoins the pipeline), unless it dies again within 30 s three times in a row (then all
    stop and the exit code is its). SIGTERM / SIGINT stop them all."""
    argv = list(sys.argv[1:])
    cmds = [[sys.executable, "-m", "dsakv", *argv, "--pp-rank", str(k)] for k in range(args.pp_size)]
    procs = [subprocess.Popen(c) for c in cmds]
    for k, p in enumerate(procs):
        log.info("prefill: started stage %d (pid %d)", k, p.pid)
    started = [time.monotonic()] * len(procs)
    quick_deaths = [0] * len(procs)
    stopping: list[bool] = []
    _install_sigterm(lambda: stopping.append(True))
    rc = 0
    try:
        while not stopping:
            time.sleep(0.2)
            for k, p in enumerate(procs):
                code = p.poll()
                if code is None:
                    continue
                quick_deaths[k] = quick_deaths[k] + 1 if time.monotonic() - started[k] < 30 else 1
                if quick_deaths[k] >= 3:
                    log.error("prefill: stage %d exited with code %s three times in a row: stopping", k, code)
                    rc = code or 1
                    stopping.append(True)
                    break
                log.warning("prefill: stage %d (pid %d) exited with code %s: starting it again", k, p.pid, code)
                time.sleep(1.0)
                procs[k] = subprocess.Popen(cmds[k])
                started[k] = time.monotonic()
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
    return rc


def _prefill_prefix_cache(args: argparse.Namespace) -> dict[str, Any]:
    """PrefillConfig keywords for --prefix-cache (device-only prefix cache on every pipeline stage), the host
    tier (--hicache-ratio | --hicache-size, --hicache-layout, --hicache-write-policy, --hicache-selective-threshold:
    stage 0's page copies are replayed on every stage) and, with --pp-size 1 only, the shared storage tier
    (--hicache-storage mooncake --mooncake-master HOST:PORT, on stage 0's HiCache as on a colocated server).
    The local disk tier is refused."""
    from dsakv.cli.hicache_options import storage_config, storage_pp_error
    from dsakv.plan.units import parse_size

    storage = getattr(args, "hicache_storage", None)
    disk = [
        flag
        for flag, val in (
            ("--hicache-disk-dir", getattr(args, "hicache_disk_dir", None)),
            ("--hicache-disk-size", getattr(args, "hicache_disk_size", None)),
            ("--hicache-storage file", "file" if storage == "file" else None),
        )
        if val is not None
    ]
    if disk:
        raise ConfigError(
            f"--role prefill does not support {', '.join(disk)} (the local disk tier of the prefix cache) yet: "
            "use --prefix-cache, optionally with --hicache-ratio or --hicache-size (host tier), and with "
            "--pp-size 1 --hicache-storage mooncake (the shared storage tier)"
        )
    pp_size = int(getattr(args, "pp_size", 1) or 1)
    if storage is not None and pp_size > 1:
        raise ConfigError(storage_pp_error(storage, pp_size))
    size = getattr(args, "hicache_size", None)
    return {
        "prefix_cache": bool(getattr(args, "prefix_cache", False)),
        "hicache_ratio": getattr(args, "hicache_ratio", None),
        "hicache_size": parse_size(size, "--hicache-size") if size else None,
        "hicache_layout": getattr(args, "hicache_layout", "layer_first"),
        "hicache_write_policy": getattr(args, "hicache_write_policy", "write_through"),
        "hicache_selective_threshold": getattr(args, "hicache_selective_threshold", 2),
        "hicache_storage": storage_config(args),
    }


def run_prefill(args: argparse.Namespace) -> int:
    prefix_cache = _prefill_prefix_cache(args)
    if args.pp_size > 1 and args.pp_rank is None:
        return _launch_stages(args)
    from dsakv.cli.serve_cmd import model_dir_of
    from dsakv.disagg.prefill_worker import PrefillConfig, PrefillStage, split_layers
    from dsakv.spec.model import ModelSpec

    model_dir = model_dir_of(args)
    _threads(args)
    spec = ModelSpec.from_path(model_dir)
    partition = _partition(args)
    ranges = split_layers(spec.num_layers, args.pp_size, partition)
    cfg = PrefillConfig(
        model=str(model_dir),
        pp_size=args.pp_size,
        pp_rank=args.pp_rank or 0,
        partition=partition,
        host=args.host,
        port=args.port,
        stage0_host=args.stage0_host,
        dist_port=args.dist_port,
        name=args.worker_name,
        elide=args.elide,
        kv_format=args.kv_format,
        index_format=args.index_format,
        page_size=args.page_size,
        num_pages=_stage_pages(args, spec, ranges),
        max_batch_tokens=args.max_batch_tokens,
        max_running_requests=args.max_running_requests,
        dtype=args.dtype,
        backend=args.transfer_backend,
        backend_options=_backend_options(args),
        stage_timeout=args.stage_timeout,
        rpc_timeout=args.rpc_timeout,
        decode=tuple(args.decode),
        debug_transfer_delay=args.debug_transfer_delay,
        **prefix_cache,
    )
    stage = PrefillStage(cfg)
    _install_sigterm(stage.request_stop)
    _start_or_exit(stage, startup_wait=args.startup_wait)
    print(f"dsakv prefill stage {cfg.pp_rank}/{cfg.pp_size} ready on {stage.address} (pid {os.getpid()})", flush=True)
    try:
        stage.serve_forever()
    finally:
        stage.stop()
    return _exit_now(0)


def run_router(args: argparse.Namespace) -> int:
    from dsakv.cli.serve_cmd import serve_http
    from dsakv.disagg.router import RouterBackend, RouterConfig
    from dsakv.serve.app import create_app
    from dsakv.serve.tokenizer import load_tokenizer

    vocab = None
    name = args.served_model_name or "dsakv"
    if args.model:
        from dsakv.cli.serve_cmd import model_dir_of
        from dsakv.spec.model import ModelSpec

        model_dir = model_dir_of(args)
        vocab = ModelSpec.from_path(model_dir).vocab_size
        name = args.served_model_name or model_dir.resolve().name
    backend = RouterBackend(
        RouterConfig(
            prefill=tuple(args.prefill),
            decode=tuple(args.decode),
            kv_timeout=args.kv_timeout,
            rpc_timeout=args.rpc_timeout,
            health_interval=args.health_interval,
            queue_timeout=args.queue_timeout,
            seed=args.seed,
            affinity_min_gain_pages=args.affinity_min_gain_pages,
            affinity_max_imbalance=args.affinity_max_imbalance,
        )
    )
    app = create_app(backend, name, load_tokenizer(args.model, vocab), request_timeout=args.request_timeout)
    return serve_http(app, args)


def run_role(args: argparse.Namespace) -> int:
    if args.role == "decode":
        return run_decode(args)
    if args.role == "prefill":
        return run_prefill(args)
    if args.role == "router":
        return run_router(args)
    raise ConfigError(f"--role {args.role} is not a disaggregated role: use prefill, decode or router")
