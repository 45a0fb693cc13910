"""`dsakv store-master`: a Mooncake Store for the shared L3 tier on this machine, until interrupted.

Starts `mooncake_master` (RPC on --port, its HTTP metadata server on port + 1, metrics on port + 2, all on
--host) and mounts --size of this process's memory into the store, so pages written by any server outlive it.
Servers join with `--hicache-storage mooncake --mooncake-master HOST:PORT` and the deployment's secret, which keys
the pages' MACs (`--hicache-storage-secret-file PATH`, or $DSAKV_CLUSTER_SECRET_FILE). No torch.
"""

from __future__ import annotations

import argparse
import logging
import signal
import threading

from dsakv.cli.logs import setup_logging
from dsakv.errors import ConfigError
from dsakv.plan.units import parse_size

log = logging.getLogger(__name__)
MIN_STORE_BYTES = 16 << 20  # the smallest segment a Mooncake Store client mounts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "example:\n"
        "  dsakv cluster-secret /tmp/cluster.secret\n"
        "  dsakv store-master --port 50051 --size 8GiB &\n"
        "  dsakv serve --model /tmp/tiny --hicache-ratio 2 --hicache-storage mooncake --mooncake-master "
        "127.0.0.1:50051 --hicache-storage-secret-file /tmp/cluster.secret\n"
    )
    p.add_argument("--host", default="127.0.0.1", help="address every listener binds to (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=50051, help="master RPC port; metadata on port+1, metrics on port+2")
    p.add_argument(
        "--size", default="1GiB", help="store memory this process provides, e.g. 8GiB (default 1GiB; 16MiB at least)"
    )
    p.add_argument("--log-level", default="info", help="debug | info | warning")
    p.add_argument("--master-log", default=None, metavar="FILE", help="append mooncake_master's output to FILE")


def run(args: argparse.Namespace) -> int:
    from dsakv.cache.storage.master import MasterProcess, StoreHolder

    setup_logging(args.log_level)
    if not 0 < args.port < 65533:
        raise ConfigError(f"--port {args.port}: needs port, port + 1 and port + 2 in 1..65535")
    size = parse_size(args.size, "--size")
    if size < MIN_STORE_BYTES:
        raise ConfigError(f"--size {args.size}: Mooncake mounts at least 16MiB of store memory: give --size 16MiB+")
    from dsakv.disagg.transfer.backends.bind_shim import ensure_bound_to_host

    ensure_bound_to_host(args.host, "the mooncake store (master metadata + store memory)")  # it binds every interface
    master = MasterProcess(args.port, args.host, args.master_log)
    try:
        master.start()
    except RuntimeError as e:
        raise ConfigError(f"{e}: pick another --port") from e
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    holder = None
    try:
        holder = StoreHolder(master.address, size, master.metadata_url, args.host)
        print(
            f"store master ready: --mooncake-master {master.address} (metadata {master.metadata_url}, "
            f"{size} B of store memory, mooncake_master pid {master.pid})",
            flush=True,
        )
        while not stop.is_set():
            if not master.alive():
                log.error("mooncake_master exited (%s); shutting down", master.proc.returncode if master.proc else "?")
                return 1
            stop.wait(0.5)
        return 0
    finally:
        if holder is not None:
            holder.close()
        master.stop()
