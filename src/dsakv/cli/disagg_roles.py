"""`dsakv serve --role prefill|decode|router`: the disaggregated roles (called by dsakv.cli.serve_cmd with the
configuration tree it read from argv; this module never imports serve_cmd).

    dsakv serve --role decode  --model DIR --port 9100 [--transfer-backend mooncake|nixl] [--no-elide]
    dsakv serve --role prefill --model DIR --port 9200 --pp-size 2 [--pp-partition 7,5] [--pp-rank K]
    dsakv serve --role router  --port 8000 --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 [--model DIR]

serve_cmd adds the shared options (--model --host --port and the tree's layout / pool / cache / engine groups);
this module adds the transfer and pipeline groups (dsakv.cli.options) and the router's. The roles' own configs
(DecodeConfig, PrefillConfig, RouterConfig) are built from the tree here, at the boundary. Heavy imports (torch,
the engine) happen inside run_role.
Without --pp-rank, a prefill with --pp-size N > 1 starts its N stages as child processes and waits.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from typing import Any

from dsakv.cli import options
from dsakv.disagg.auth import SECRET_ENV
from dsakv.engine.config import CacheConfig, Config, TransferConfig
from dsakv.errors import ConfigError
from dsakv.util.procs import Proc, dsakv_cmd, stop_all

log = logging.getLogger("dsakv.disagg")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("disaggregated serving (--role prefill | decode | router)")
    options.add_transfer_arguments(g)
    options.add_pipeline_arguments(g)
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
    g.add_argument(
        "--cluster-secret-file",
        default=None,
        metavar="PATH",
        help="every role: the deployment's shared secret (>= 16 bytes, mode 600; create it with `dsakv "
        "cluster-secret PATH`). Every control-plane call is signed with a key derived from it and the caller's "
        f"role, and refused unsigned; a role will not start without it. Default: ${SECRET_ENV}",
    )
    g.add_argument("--worker-name", default=None, help="prefill/decode: name in logs and handshakes")
    g.add_argument(
        "--startup-wait",
        type=float,
        default=60.0,
        help="prefill: how long the startup handshake with --decode workers waits for them to come up (60 s)",
    )


def _backend_options(host: str, transfer: TransferConfig) -> dict[str, Any]:
    if transfer.backend == "mooncake":
        opts: dict[str, Any] = {"hostname": host}
        if transfer.mooncake_timeout is not None:
            opts["engine_timeout_s"] = transfer.mooncake_timeout
        return opts
    if transfer.backend == "nixl":
        from dsakv.disagg.backends.nixl import LOOPBACK_UCX_ENV

        return {"env": LOOPBACK_UCX_ENV} if host in ("127.0.0.1", "localhost") else {}
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


def run_decode(args: argparse.Namespace, cfg: Config) -> int:
    from dsakv.disagg.decode_worker import DecodeConfig, DecodeWorker

    model_dir = options.model_dir_of(args)
    _threads(args)
    worker = DecodeWorker(
        DecodeConfig(
            model=str(model_dir),
            host=args.host,
            port=args.port,
            name=args.worker_name,
            engine=cfg.engine.options(),
            backend=cfg.transfer.backend,
            backend_options=_backend_options(args.host, cfg.transfer),
            rpc_timeout=cfg.transfer.rpc_timeout,
        )
    )
    _install_sigterm(worker.request_stop)
    _start_or_exit(worker)
    log.info("decode worker %s ready on %s", worker.name, worker.address)
    print(f"dsakv decode ready on {worker.address}", flush=True)
    try:
        worker.serve_forever()
    finally:
        worker.stop()
    return _exit_now(0)


def _launch_stages(args: argparse.Namespace, pp_size: int) -> int:
    """Start every stage of the prefill worker as a child process and supervise them: a stage that dies is
    started again (it rejoins the pipeline), unless it dies again within 30 s three times in a row (then all
    stop and the exit code is its). SIGTERM / SIGINT stop them all."""
    argv = list(sys.argv[1:])
    procs = [Proc(f"stage {k}", dsakv_cmd(*argv, "--pp-rank", str(k)), env=dict(os.environ)) for k in range(pp_size)]
    for k, p in enumerate(procs):
        p.new_session = False  # one process group with this supervisor: Ctrl-C reaches every stage
        p.start()
        log.info("prefill: started stage %d (pid %d)", k, p.pid)
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
                quick_deaths[k] = quick_deaths[k] + 1 if time.monotonic() - p.started_at < 30 else 1
                if quick_deaths[k] >= 3:
                    log.error("prefill: stage %d exited with code %s three times in a row: stopping", k, code)
                    rc = code or 1
                    stopping.append(True)
                    break
                log.warning("prefill: stage %d (pid %d) exited with code %s: starting it again", k, p.pid, code)
                time.sleep(1.0)
                p.start()
    finally:
        stop_all(procs, timeout=15)
    return rc


def _disk_refusal(flags: list[str]) -> str:
    return (
        f"--role prefill does not support {', '.join(flags)} (the local disk tier of the prefix cache) yet: "
        "use --prefix-cache, optionally with --hicache-ratio or --hicache-size (host tier), and with "
        "--pp-size 1 --hicache-storage mooncake (the shared storage tier)"
    )


def _prefill_prefix_cache(args: argparse.Namespace) -> dict[str, Any]:
    """PrefillConfig keywords for the tree's cache branch, from argv (see prefill_cache_options)."""
    if getattr(args, "hicache_storage", None) == "file":  # the file tier is the local disk tier
        raise ConfigError(_disk_refusal(["--hicache-storage file"]))
    return prefill_cache_options(options.cache_config(args), int(getattr(args, "pp_size", 1) or 1))


def prefill_cache_options(cache: CacheConfig, pp_size: int = 1) -> dict[str, Any]:
    """PrefillConfig keywords for --prefix-cache (device-only prefix cache on every pipeline stage), the host
    tier (--hicache-ratio | --hicache-size, --hicache-layout, --hicache-write-policy, --hicache-selective-threshold:
    stage 0's page copies are replayed on every stage) and, with --pp-size 1 only, the shared storage tier
    (--hicache-storage mooncake --mooncake-master HOST:PORT, on stage 0's HiCache as on a colocated server).
    The local disk tier is refused."""
    disk = [
        flag
        for flag, val in (("--hicache-disk-dir", cache.disk_dir), ("--hicache-disk-size", cache.disk_size))
        if val is not None
    ]
    if disk:
        raise ConfigError(_disk_refusal(disk))
    if cache.storage is not None and pp_size > 1:
        raise ConfigError(options.storage_pp_error(cache.storage.backend, pp_size))
    return {
        "prefix_cache": cache.prefix_cache,
        "hicache_ratio": cache.hicache_ratio,
        "hicache_size": cache.hicache_size,
        "hicache_layout": cache.layout,
        "hicache_write_policy": cache.write_policy,
        "hicache_selective_threshold": cache.selective_threshold,
        "hicache_storage": cache.storage,
    }


def prefill_config(args: argparse.Namespace, cfg: Config, model_dir: str, spec: Any) -> Any:
    """The PrefillConfig of this stage from the tree (plus the process's address, name and --decode peers)."""
    from dsakv.disagg.prefill_worker import PrefillConfig, split_layers

    pipe, eng = cfg.pipeline, cfg.engine
    ranges = split_layers(spec.num_layers, pipe.pp_size, pipe.partition)
    drafts = [0] * (len(ranges) - 1) + [eng.draft_layers]  # MTP: the last stage holds the draft layer's keys
    layouts = [eng.layout.layout(spec, a, b, draft_layers=d) for (a, b), d in zip(ranges, drafts, strict=True)]
    return PrefillConfig(
        model=model_dir,
        pp_size=pipe.pp_size,
        pp_rank=pipe.pp_rank or 0,
        partition=pipe.partition,
        host=args.host,
        port=args.port,
        stage0_host=pipe.stage0_host,
        dist_port=pipe.dist_port,
        name=args.worker_name,
        elide=eng.layout.elide,
        kv_format=eng.layout.kv_format,
        index_format=eng.layout.index_format,
        page_size=eng.layout.page_size,
        num_pages=eng.pool.pages_given(layouts),
        max_batch_tokens=eng.scheduler.max_batch_tokens,
        max_running_requests=eng.scheduler.max_running_requests,
        dtype=eng.dtype,
        backend=cfg.transfer.backend,
        backend_options=_backend_options(args.host, cfg.transfer),
        stage_timeout=pipe.stage_timeout,
        rpc_timeout=cfg.transfer.rpc_timeout,
        decode=tuple(args.decode),
        debug_transfer_delay=cfg.transfer.debug_transfer_delay,
        speculative_num_steps=eng.speculative_num_steps,
        **prefill_cache_options(eng.cache, pipe.pp_size),
    )


def run_prefill(args: argparse.Namespace, cfg: Config) -> int:
    prefill_cache_options(cfg.engine.cache, cfg.pipeline.pp_size)  # refuse the disk tier before starting anything
    if cfg.pipeline.pp_size > 1 and cfg.pipeline.pp_rank is None:
        return _launch_stages(args, cfg.pipeline.pp_size)
    from dsakv.disagg.prefill_worker import PrefillStage
    from dsakv.spec.model import ModelSpec

    model_dir = options.model_dir_of(args)
    _threads(args)
    pcfg = prefill_config(args, cfg, str(model_dir), ModelSpec.from_path(model_dir))
    stage = PrefillStage(pcfg)
    _install_sigterm(stage.request_stop)
    _start_or_exit(stage, startup_wait=args.startup_wait)
    print(f"dsakv prefill stage {pcfg.pp_rank}/{pcfg.pp_size} ready on {stage.address} (pid {os.getpid()})", flush=True)
    try:
        stage.serve_forever()
    finally:
        stage.stop()
    return _exit_now(0)


def run_router(args: argparse.Namespace, cfg: Config) -> int:
    from dsakv.cli.http_options import http_limits
    from dsakv.disagg.router import RouterBackend, RouterConfig
    from dsakv.serve.app import create_app
    from dsakv.serve.server import run_http
    from dsakv.serve.tokenizer import load_tokenizer

    if cfg.engine.speculative_num_steps:
        log.info("router: --speculative-num-steps is the workers' (the decode speculates); the router ignores it")
    vocab = None
    name = args.served_model_name or "dsakv"
    if args.model:
        from dsakv.spec.model import ModelSpec

        model_dir = options.model_dir_of(args)
        vocab = ModelSpec.from_path(model_dir).vocab_size
        name = args.served_model_name or model_dir.resolve().name
    backend = RouterBackend(
        RouterConfig(
            prefill=tuple(args.prefill),
            decode=tuple(args.decode),
            kv_timeout=args.kv_timeout,
            rpc_timeout=cfg.transfer.rpc_timeout,
            health_interval=args.health_interval,
            queue_timeout=args.queue_timeout,
            seed=cfg.engine.seed,
            affinity_min_gain_pages=args.affinity_min_gain_pages,
            affinity_max_imbalance=args.affinity_max_imbalance,
        )
    )
    app = create_app(backend, name, load_tokenizer(args.model, vocab), request_timeout=args.request_timeout)
    return run_http(app, args.host, args.port, args.log_level, limits=http_limits(args))


def use_cluster_secret(args: argparse.Namespace) -> None:
    """Load the deployment's secret (--cluster-secret-file, else $DSAKV_CLUSTER_SECRET_FILE) and sign / check
    every control-plane call of this process with it as `args.role`; ConfigError if there is none or it is bad."""
    from dsakv.disagg import auth

    path = getattr(args, "cluster_secret_file", None) or os.environ.get(SECRET_ENV)
    if not path:
        raise ConfigError(
            f"--role {args.role} needs the deployment's cluster secret: create one with `dsakv cluster-secret "
            f"PATH` and pass --cluster-secret-file PATH (or set {SECRET_ENV}=PATH) to every role of the deployment"
        )
    try:
        keyring = auth.Keyring(auth.load_secret(path))
    except ValueError as e:
        raise ConfigError(str(e)) from None
    auth.use(auth.ClusterAuth(keyring, args.role, require=True))
    log.info("control plane: calls signed and checked as role %s (secret %s, fingerprint %s)", args.role, path,
             keyring.fingerprint)  # fmt: skip


def run_role(args: argparse.Namespace, cfg: Config | None = None) -> int:
    cfg = cfg if cfg is not None else options.config_from_args(args)
    if args.role in ("decode", "prefill", "router"):
        use_cluster_secret(args)
    if args.role == "decode":
        return run_decode(args, cfg)
    if args.role == "prefill":
        return run_prefill(args, cfg)
    if args.role == "router":
        return run_router(args, cfg)
    raise ConfigError(f"--role {args.role} is not a disaggregated role: use prefill, decode or router")
