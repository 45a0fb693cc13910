"""A Mooncake Store deployment on this machine: the `mooncake_master` process (with its embedded HTTP metadata
server) and a holder that mounts the store's memory, so pages outlive the servers that wrote them.

    m = MasterProcess(port=50051, host="127.0.0.1").start()   # metadata on port + 1, metrics on port + 2
    holder = StoreHolder(m.address, segment_bytes=1 << 30)     # this process now serves 1 GiB of the store
    ...
    m.kill(); m.start()                                         # same ports: clients reconnect on their own

`dsakv store-master` runs both until interrupted. Everything binds to `host` (loopback by default).
Imports mooncake (lazily); must not import torch, model or engine.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from signal import SIGKILL
from typing import IO

from dsakv.errors import ConfigError
from dsakv.util.procs import die_with_parent, free_ports

log = logging.getLogger(__name__)


def master_binary() -> str:
    """Path of the mooncake_master executable shipped in the mooncake package (or on PATH)."""
    try:
        import mooncake

        p = Path(mooncake.__file__).parent / "mooncake_master"
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    except ImportError:
        pass
    for cand in (Path(sys.executable).parent / "mooncake_master", shutil.which("mooncake_master")):
        if cand and Path(cand).is_file():
            return str(cand)
    raise ConfigError("mooncake_master not found: install the mooncake package (pip install -e '.[transfer]')")


def free_port(host: str = "127.0.0.1", span: int = 3) -> int:
    """A port p with p .. p+span-1 free on `host` (the master, its metadata server and its metrics): below the
    ephemeral range, never handed out twice on this machine (dsakv.util.procs.free_ports)."""
    return free_ports(span, host=host)


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


class MasterProcess:
    """One mooncake_master child process: RPC on `port`, HTTP metadata on port + 1, metrics on port + 2."""

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_path: str | Path | None = None) -> None:
        self.host = host
        self.port = port if port is not None else free_port(host)
        if not 0 < self.port < 65533:
            raise ConfigError(f"--port {self.port}: the master needs port, port + 1 and port + 2 below 65536")
        self.log_path = Path(log_path) if log_path else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def metadata_url(self) -> str:
        return f"http://{self.host}:{self.port + 1}/metadata"

    def argv(self) -> list[str]:
        return [
            master_binary(),
            f"--rpc_port={self.port}",
            f"--rpc_address={self.host}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.port + 1}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.port + 2}",
        ]

    def start(self, timeout: float = 20.0) -> MasterProcess:
        if self.proc is not None and self.proc.poll() is None:
            return self
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's life
        out = self._log if self._log is not None else subprocess.DEVNULL
        self.proc = subprocess.Popen(  # SIGKILL when this process dies (Linux): no orphaned master holding the ports
            self.argv(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(SIGKILL),
        )
        deadline = time.monotonic() + timeout
        while not (_listening(self.host, self.port) and _listening(self.host, self.port + 1)):
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"mooncake_master exited with {self.proc.returncode} (ports {self.port}..{self.port + 2} taken?)"
                )
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mooncake_master did not listen on {self.address} within {timeout:.0f} s")
            time.sleep(0.05)
        log.info("mooncake master pid %d on %s (metadata %s)", self.proc.pid, self.address, self.metadata_url)
        return self

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the master (a crash, for fault tests) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        self.kill()


class StoreHolder:
    """A client that mounts `segment_bytes` of memory into the store (where other clients' objects land)."""

    def __init__(self, master: str, segment_bytes: int, metadata: str | None = None, host: str = "127.0.0.1") -> None:
        from mooncake.store import MooncakeDistributedStore

        from dsakv.cache.storage.mooncake import default_metadata_url

        self.store = MooncakeDistributedStore()
        meta = metadata or default_metadata_url(master)
        rc = self.store.setup(host, meta, segment_bytes, 0, "tcp", "", master)
        if rc != 0:
            raise RuntimeError(f"cannot mount {segment_bytes} B into the store at {master} ({meta}): setup {rc}")
        self.segment_bytes = segment_bytes

    def close(self) -> None:
        self.store.close()
