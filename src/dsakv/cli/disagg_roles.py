"""`dsakv serve --role prefill|decode|router`: the disaggregated roles (called by dsakv.cli.serve_cmd with the
configuration tree it read from argv; this module never imports serve_cmd).

    dsakv serve --role decode  --model DIR --port 9100 [--transfer-backend mooncake|nixl] [--no-elide]
    dsakv serve --role prefill --model DIR --port 9200 --pp-size 2 [--pp-partition 7,5] [--pp-rank K]
    dsakv serve --role router  --port 8000 --prefill 127.0.0.1:9200 --decode 127.0.0.1:9100 [--model DIR]

serve_cmd adds the shared options (--model --host --port and the tree's layout / pool / cache / engine groups);
this module adds the transfer and pipeline groups (dsakv.cli.options) and the router's. The decode and prefill
roles take the tree itself (DecodeConfig / PrefillConfig: the tree + this process's address, name, peers and
backend options); the router's RouterConfig is its own (addresses, timeouts, affinity). Heavy imports (torch,
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
from collections.abc import Callable
from typing import Any

from dsakv.cli import options
from dsakv.config import CacheConfig, Config, disk_tier_refusal, prefill_cache_error
from dsakv.disagg.protocol.auth import SECRET_ENV
from dsakv.errors import ConfigError
from dsakv.util.procs import TP_RANK_ENV, Proc, dsakv_cmd, exit_now, stop_all

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
        "--max-kv-timeout",
        type=float,
        default=120.0,
        help="decode: the longest --kv-timeout a router may ask it to hold a request's pages for (default 120 s); "
        "a longer one is refused with an error naming both",
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
        "--debug-fail-transfer",
        default=None,
        metavar="J:N",
        help="prefill, testing: this stage's N-th transfer to decode stage J fails before it starts (its request "
        "fails; everything else is served)",
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


def _stage_and_count(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        j, n = (int(v) for v in text.split(":"))
    except ValueError:
        raise ConfigError(f"--debug-fail-transfer {text!r}: give DECODE_STAGE:N, e.g. 1:2") from None
    if j < 0 or n < 1:
        raise ConfigError(f"--debug-fail-transfer {text!r}: the decode stage must be >= 0 and N >= 1")
    return j, n


def _install_sigterm(stop: Any) -> None:
    def handler(signum: int, frame: Any) -> None:
        stop()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)


def _start_or_exit(worker: Any, **kw: Any) -> None:
    """worker.start(); on a startup error print it, stop what started and exit 2 (no finalization: nixl segfaults
    in its teardown, util/procs.exit_now)."""
    try:
        worker.start(**kw)
    except Exception as e:
        print(f"dsakv serve: error: {e}", file=sys.stderr)
        try:
            worker.stop()
        finally:
            exit_now(2)


def _serve_worker(worker: Any, ready_line: Callable[[], str], follower: bool = False, **start: Any) -> int:
    """The life of a decode worker or prefill stage process: SIGTERM/SIGINT ask it to stop; start it (a startup
    error: exit 2); say it is ready (log + stdout: launchers wait for the line); serve until asked to stop.
    `follower`: a DP rank >= 1 ignores SIGTERM/SIGINT (its rank 0 stops it; SIGKILL if rank 0 dies)."""
    if follower:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_IGN)
    else:
        _install_sigterm(worker.request_stop)
    _start_or_exit(worker, **start)
    line = ready_line()
    log.info("%s", line)
    print(line, flush=True)
    try:
        worker.serve_forever()
    finally:
        worker.stop()
    exit_now(0)


def _threads(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads if args.threads is not None else 1)


def _is_v4(args: argparse.Namespace) -> bool:
    from dsakv.spec.v4 import is_v4

    return bool(args.model) and is_v4(str(options.model_dir_of(args)))


def run_decode(args: argparse.Namespace, cfg: Config) -> int:
    pipe = cfg.pipeline
    if _is_v4(args):
        return run_v4_decode(args, cfg)
    if pipe.pp_size > 1 and pipe.pp_rank is None:
        return _launch_stages(args, pipe.pp_size, "decode")
    from dsakv.disagg.decode.stage_worker import DecodeStageWorker
    from dsakv.disagg.decode.worker import DecodeWorker

    _threads(args)
    dcfg = decode_config(args, cfg)
    pcfg = dcfg.pipeline  # the tree's one pipeline config when pipelined (its rank: --pp-rank)
    if dcfg.dp_size > 1 and pcfg is not None:  # DP attention x PP: cell (DP rank, stage) (decode/dp_pipe.py)
        from dsakv.disagg.decode import dp_pipe
        from dsakv.engine.dp import check_experts

        check_experts(dcfg.model, dcfg.dp_size)  # before any rank starts
        rank = int(os.environ.get(TP_RANK_ENV) or 0)
        cell: Any = dp_pipe.DPStageWorker(dcfg) if pcfg.rank > 0 else DecodeWorker(dp_pipe.cell_config(dcfg, rank))
        line = f"dsakv decode DP rank {rank}/{dcfg.dp_size} stage {pcfg.rank}/{pcfg.pp_size} ready on {{}} (pid {{}})"
        # only (0, 0) stops on SIGTERM: its stop round, then STOP down every DP rank's pipeline, stops the rest
        return _serve_worker(cell, lambda: line.format(cell.address, os.getpid()), follower=rank > 0 or pcfg.rank > 0)
    if dcfg.dp_size > 1:  # DP attention: every rank a DecodeWorker of its own on --port + rank (decode/dp.py)
        from dsakv.engine.dp import check_experts, dp_rank_config

        check_experts(dcfg.model, dcfg.dp_size)  # before any rank starts
        rank = int(os.environ.get(TP_RANK_ENV) or 0)
        dp_worker = DecodeWorker(dp_rank_config(dcfg, rank))
        line = f"dsakv decode DP rank {rank}/{dcfg.dp_size} ready on {{}} (pid {os.getpid()})"
        return _serve_worker(dp_worker, lambda: line.format(dp_worker.address), follower=rank > 0)
    if dcfg.tp_size > 1 and os.environ.get(TP_RANK_ENV) is not None and pcfg is not None:  # decode/grid.py
        from dsakv.disagg.decode.grid import follow_stage, follow_stage0

        exit_now(follow_stage(dcfg) if pcfg.rank > 0 else follow_stage0(dcfg))
    if dcfg.tp_size > 1 and os.environ.get(TP_RANK_ENV) is not None:  # a follower rank (decode/ranks.py)
        from dsakv.disagg.decode.ranks import follow_decode

        exit_now(follow_decode(dcfg))
    worker: Any = DecodeStageWorker(dcfg) if pcfg is not None and pcfg.rank > 0 else DecodeWorker(dcfg)
    stage = f" stage {pcfg.rank}/{pcfg.pp_size}" if pcfg is not None else ""
    return _serve_worker(worker, lambda: f"dsakv decode{stage} ready on {worker.address} (pid {os.getpid()})")


def _launch_stages(args: argparse.Namespace, pp_size: int, role: str = "prefill", restart: bool = True) -> int:
    """Start every stage of the prefill (or decode) worker as a child process and supervise them: a stage that dies is
    started again (it rejoins the pipeline), unless it dies again within 30 s three times in a row (then all
    stop and the exit code is its), or `restart` is off (DP attention x PP: the instance is not re-formed, all
    stop at once). SIGTERM / SIGINT stop them all; each stage's exit status is logged."""
    argv = list(sys.argv[1:])
    procs = [Proc(f"stage {k}", dsakv_cmd(*argv, "--pp-rank", str(k)), env=dict(os.environ)) for k in range(pp_size)]
    for k, p in enumerate(procs):
        p.new_session = False  # one process group with this supervisor: Ctrl-C reaches every stage
        p.start()
        log.info("%s: started stage %d (pid %d)", role, k, p.pid)
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
                if not restart:
                    log.error("%s: stage %d exited with code %s (DP attention x PP is not re-formed): stopping", role,
                              k, code)  # fmt: skip
                    rc = code or 1
                    stopping.append(True)
                    break
                if quick_deaths[k] >= 3:
                    log.error("%s: stage %d exited with code %s three times in a row: stopping", role, k, code)
                    rc = code or 1
                    stopping.append(True)
                    break
                log.warning("%s: stage %d (pid %d) exited with code %s: starting it again", role, k, p.pid, code)
                time.sleep(1.0)
                p.start()
    finally:
        stop_all(procs, timeout=15 if restart else 90)  # DP x PP: each stage's EP group closes first (bounded)
        log.info("%s: stopped: %s", role, ", ".join(f"stage {k} exited {p.poll()}" for k, p in enumerate(procs)))
    return rc


def prefill_cache_config(args: argparse.Namespace) -> CacheConfig:
    """The tree's cache branch for a prefill worker, from argv: --prefix-cache (device-only prefix cache on every
    pipeline stage), the host tier (--hicache-ratio | --hicache-size, --hicache-layout, --hicache-write-policy,
    --hicache-selective-threshold: stage 0's page copies are replayed on every stage) and, with --pp-size 1 only,
    the shared storage tier (--hicache-storage mooncake --mooncake-master HOST:PORT, on stage 0's HiCache as on a
    colocated server). The local disk tier (--hicache-disk-dir, --hicache-storage file) is refused. Called by
    cli/validate.py before anything starts; each stage's PrefillConfig checks its tree the same way."""
    if getattr(args, "hicache_storage", None) == "file":  # the file tier is the local disk tier
        raise ConfigError(disk_tier_refusal(["--hicache-storage file"]))
    cache = options.cache_config(args)
    refusal = prefill_cache_error(cache, int(getattr(args, "pp_size", 1) or 1))
    if refusal is not None:
        raise ConfigError(refusal)
    return cache


def prefill_config(args: argparse.Namespace, cfg: Config, model_dir: str, tp: bool = False) -> Any:
    """This stage's PrefillConfig: the tree, plus the process's address, name and --decode peers (`tp`: and its
    --tp-size, with the argv its rank processes re-run)."""
    from dsakv.config import PrefillConfig

    ranks: dict[str, Any] = {}
    if tp:
        ranks = {
            "tp_size": getattr(args, "tp_size", 1),
            "rank_argv": tuple(getattr(args, "_argv", None) or sys.argv[1:]),
            "dp_size": args.dp_size if getattr(args, "enable_dp_attention", False) else 1,
        }
    return PrefillConfig(
        model=model_dir,
        config=cfg,
        host=args.host,
        port=args.port,
        name=args.worker_name,
        decode=tuple(args.decode),
        backend_options=cfg.transfer.backend_options(args.host),
        debug_fail_transfer=_stage_and_count(args.debug_fail_transfer),
        **ranks,
    )


def decode_config(args: argparse.Namespace, cfg: Config) -> Any:
    """This decode's DecodeConfig: the tree, plus the process's address, name, KV-wait bound and ranks."""
    from dsakv.config import DecodeConfig

    return DecodeConfig(
        model=str(options.model_dir_of(args)),
        host=args.host,
        port=args.port,
        name=args.worker_name,
        config=cfg,
        backend_options=cfg.transfer.backend_options(args.host),
        max_kv_timeout=args.max_kv_timeout,
        tp_size=getattr(args, "tp_size", 1),
        rank_argv=tuple(getattr(args, "_argv", None) or sys.argv[1:]),
        dp_size=args.dp_size if getattr(args, "enable_dp_attention", False) else 1,
    )


def run_v4_decode(args: argparse.Namespace, cfg: Config) -> int:
    """A DeepSeek-V4 decode (disagg/decode/v4_worker.py): one process, one rank."""
    from dsakv.disagg.decode.v4_worker import V4DecodeWorker

    if getattr(args, "tp_size", 1) > 1:
        raise ConfigError(f"--tp-size {args.tp_size} with a DeepSeek-V4 decode is not supported yet: give TP 1")
    _threads(args)
    worker = V4DecodeWorker(decode_config(args, cfg))
    return _serve_worker(worker, lambda: f"dsakv decode (DeepSeek-V4) ready on {worker.address} (pid {os.getpid()})")


def run_v4_prefill(args: argparse.Namespace, cfg: Config) -> int:
    """A DeepSeek-V4 prefill (disagg/prefill/v4_worker.py): this process is stage 0 and the control plane; with
    --pp-size N it spawns stages 1..N-1 as its children (no --pp-rank processes)."""
    from dsakv.disagg.prefill.v4_worker import V4PrefillWorker

    if getattr(args, "tp_size", 1) > 1:
        raise ConfigError(f"--tp-size {args.tp_size} with a DeepSeek-V4 prefill is not supported yet: give TP 1")
    if cfg.pipeline.pp_rank is not None:
        raise ConfigError(
            f"--pp-rank {cfg.pipeline.pp_rank}: a DeepSeek-V4 prefill starts its stages itself (children of this "
            "process, one port); drop --pp-rank"
        )
    _threads(args)
    pcfg = prefill_config(args, cfg, str(options.model_dir_of(args)))
    worker = V4PrefillWorker(pcfg)
    n = pcfg.pipeline.pp_size
    ready = f"dsakv prefill (DeepSeek-V4, {n} stage{'s' if n > 1 else ''}) ready on {{}} (pid {os.getpid()})"
    return _serve_worker(worker, lambda: ready.format(worker.address), startup_wait=args.startup_wait)


def run_prefill(args: argparse.Namespace, cfg: Config) -> int:
    if _is_v4(args):
        return run_v4_prefill(args, cfg)
    if cfg.pipeline.pp_size > 1 and cfg.pipeline.pp_rank is None:
        return _launch_stages(args, cfg.pipeline.pp_size, restart=not getattr(args, "enable_dp_attention", False))
    from dsakv.disagg.prefill.worker import PrefillStage

    model_dir = options.model_dir_of(args)
    _threads(args)
    pcfg = prefill_config(args, cfg, str(model_dir), tp=True)
    if pcfg.dp_size > 1 and pcfg.pp_size > 1:  # DP attention x PP: process (DP rank d, stage s) (prefill/dp_pp.py)
        from dsakv.disagg.prefill.dp_pp import dp_pp_config

        rank = int(os.environ.get(TP_RANK_ENV) or 0)
        cell = PrefillStage(dp_pp_config(pcfg, rank))
        line = f"dsakv prefill DP rank {rank}/{pcfg.dp_size} stage {pcfg.pp_rank}/{pcfg.pp_size} ready on {{}} (pid "
        return _serve_worker(  # only (0, 0) stops on SIGTERM: its stop round stops every (d, 0), whose STOP, after
            # every round's message, stops its later stages (each stage's EP group leaves after the same rounds)
            cell, lambda: line.format(cell.address) + f"{os.getpid()})", follower=rank > 0 or pcfg.pp_rank > 0,
            startup_wait=args.startup_wait,
        )  # fmt: skip
    if pcfg.dp_size > 1:  # DP attention: every rank a one-stage prefill of its own on --port + rank (prefill/dp.py)
        from dsakv.engine.dp import check_experts, dp_rank_config

        check_experts(pcfg.model, pcfg.dp_size)  # before any rank starts
        rank = int(os.environ.get(TP_RANK_ENV) or 0)
        dp_stage = PrefillStage(dp_rank_config(pcfg, rank))
        line = f"dsakv prefill DP rank {rank}/{pcfg.dp_size} ready on {{}} (pid {os.getpid()})"
        return _serve_worker(
            dp_stage, lambda: line.format(dp_stage.address), follower=rank > 0, startup_wait=args.startup_wait
        )
    if pcfg.tp_size > 1 and os.environ.get(TP_RANK_ENV) is not None:  # a follower rank (prefill/ranks.py)
        from dsakv.disagg.prefill.grid import follow_stage
        from dsakv.disagg.prefill.ranks import follow_prefill

        exit_now(follow_stage(pcfg) if pcfg.pp_rank > 0 else follow_prefill(pcfg))  # a later stage: grid.py
    stage = PrefillStage(pcfg)
    ready = f"dsakv prefill stage {pcfg.pp_rank}/{pcfg.pp_size} ready on {{}} (pid {os.getpid()})"
    return _serve_worker(stage, lambda: ready.format(stage.address), startup_wait=args.startup_wait)


def run_router(args: argparse.Namespace, cfg: Config) -> int:
    from dsakv.cli.http_options import http_limits
    from dsakv.config import RouterConfig
    from dsakv.disagg.router.backend import RouterBackend
    from dsakv.serve.app import create_app
    from dsakv.serve.server import run_http
    from dsakv.serve.tokenizer import load_tokenizer

    if cfg.engine.speculative_num_steps:
        log.info("router: --speculative-num-steps is the workers' (the decode speculates); the router ignores it")
    vocab = None
    name = args.served_model_name or "dsakv"
    if args.model:
        from dsakv.engine.choose import checkpoint_vocab_size

        model_dir = options.model_dir_of(args)
        vocab = checkpoint_vocab_size(model_dir)  # DSA or DeepSeek-V4 config.json
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
            vocab_size=vocab,
        )
    )
    app = create_app(backend, name, load_tokenizer(args.model, vocab), request_timeout=args.request_timeout)
    return run_http(app, args.host, args.port, args.log_level, limits=http_limits(args))


def use_cluster_secret(args: argparse.Namespace) -> None:
    """Load the deployment's secret (--cluster-secret-file, else $DSAKV_CLUSTER_SECRET_FILE) and sign / check
    every control-plane call of this process with it as `args.role`; ConfigError if there is none or it is bad."""
    from dsakv.disagg.protocol import auth

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
