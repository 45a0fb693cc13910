"""Child processes and ports on 127.0.0.1: the one launcher used by `dsakv demo`, the PP prefill's stage
supervisor, the tests' clusters and the benches.

    port = free_ports(3)                      # 3 consecutive free ports, never handed out twice in this process
    p = Proc("decode", dsakv_cmd("serve", "--role", "decode", "--port", str(port)), log=Path("decode.log")).start()
    p.alive(); p.tail(20); p.stop()           # SIGTERM to its process group, SIGKILL after the timeout

Ports: the kernel hands port 0 binds (and so Mooncake's and UCX's own listeners) ports from its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), so a port picked there can be taken between the pick and its use.
`free_ports` picks below that range, checks every port by binding it, and remembers what it handed out in a
process-wide set, so two picks in one process never overlap (a test module that starts several clusters).

Processes: each child runs in its own session (process group) unless `new_session=False`, so stopping it stops
whatever it started (a PP prefill's stages); `stop()` sends SIGTERM to the group, waits, then SIGKILLs it and
reaps the child. Imports nothing from dsakv but errors (it sits below every layer).

Parent death: on Linux every child started here (and mooncake_master, and the transfer tests' peer processes) gets
a parent-death signal (prctl PR_SET_PDEATHSIG; SIGTERM for dsakv processes, which then stop their own children the
same way, SIGKILL for mooncake_master), so a `kill -9` of a server, of `dsakv store-master` or of a test run
leaves no orphan behind. `die_with_parent(sig)` is the `preexec_fn` that sets it; `arm_parent_death(parent, sig)`
is the same for a child already running (a multiprocessing child). A parent that died before the child armed
the signal is caught by checking getppid() afterwards (the child exits at once). The kernel sends the signal
when the *thread* that started the child exits, so start children from a long-lived thread (the main one).
Elsewhere (macOS) both are no-ops.
"""

from __future__ import annotations

import ctypes
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import IO, Any

from dsakv.errors import ConfigError

CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "WARNING"}
LOWEST_PORT = 20000

_handed_out: set[int] = set()
_ports_lock = threading.Lock()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _load_prctl() -> Callable[..., int] | None:
    """libc's prctl, looked up once in the parent (a forked child must not dlopen), or None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_int
    return fn


_prctl = _load_prctl()


def arm_parent_death(parent: int, sig: int = SIGTERM) -> bool:
    """In a child of process `parent`: ask the kernel for `sig` when the parent dies. If the parent is already
    gone (the child was re-parented before the request), exit now with 128 + sig. False where unsupported."""
    if _prctl is None:
        return False
    if _prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if os.getppid() != parent:  # died between fork and prctl: nobody will send the signal
        os._exit(128 + int(sig))
    return True


def die_with_parent(sig: int = SIGTERM) -> Callable[[], None] | None:
    """A `preexec_fn` for subprocess.Popen that gives the child `sig` when this process dies (None off Linux,
    where Popen runs nothing). Called in the parent, so it knows the pid the child must see as its parent."""
    if _prctl is None:
        return None
    parent = os.getpid()

    def arm() -> None:
        arm_parent_death(parent, sig)

    return arm


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (32768..60999 where /proc does not say)."""
    try:
        lo, hi = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def _bindable(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_ports(n: int = 1, attempts: int = 500, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive ports on `host` that are free now, below the ephemeral range, and not handed
    out before by this process (they are remembered, and never handed out again)."""
    if n < 1:
        raise ValueError(f"free_ports: n = {n} must be >= 1")
    lo, _hi = ephemeral_range()
    top = min(lo, 32768) - n - 1
    with _ports_lock:
        if top > LOWEST_PORT:
            for _ in range(attempts):
                base = random.randint(LOWEST_PORT, top)
                span = range(base, base + n)
                if any(p in _handed_out for p in span) or not all(_bindable(p, host) for p in span):
                    continue
                _handed_out.update(span)
                return base
        # no room below the ephemeral range: fall back to what the kernel gives a port-0 bind
        for _ in range(attempts):
            with socket.socket() as s:
                s.bind((host, 0))
                base = int(s.getsockname()[1])
            span = range(base, base + n)
            if base + n < 65535 and not any(p in _handed_out for p in span) and all(_bindable(p, host) for p in span):
                _handed_out.update(span)
                return base
    raise ConfigError(f"found no {n} consecutive free ports on {host}")


def port_free(port: int) -> bool:
    """Whether `port` on 127.0.0.1 can be bound now."""
    return _bindable(port)


def dsakv_cmd(*args: str) -> list[str]:
    """argv of a `dsakv ...` child running this interpreter (so it inherits PYTHONPATH and the venv)."""
    return [sys.executable, "-m", "dsakv", *args]


class Proc:
    """One child process: environment `env` (default: this one plus CHILD_ENV), output to `log` (appended), to
    /dev/null (log=None, quiet) or inherited (log=None), in its own process group unless `new_session=False`; it
    gets `parent_death_signal` (SIGTERM; None: none) when this process dies (Linux)."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        log: Path | None = None,
        addr: str = "",
        env: dict[str, str] | None = None,
        new_session: bool = True,
        quiet: bool = False,
        parent_death_signal: int | None = SIGTERM,
    ) -> None:
        self.name, self.cmd, self.log, self.addr = name, list(cmd), log, addr
        self.env = {**os.environ, **CHILD_ENV} if env is None else dict(env)
        self.new_session, self.quiet = new_session, quiet
        self.parent_death_signal = parent_death_signal
        self.popen: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    def start(self) -> Proc:
        """Start (or start again, once the previous run exited)."""
        if self.alive():
            raise RuntimeError(f"{self.name} (pid {self.pid}) is already running")
        out: IO[Any] | int | None = subprocess.DEVNULL if self.quiet else None
        f = open(self.log, "ab") if self.log is not None else None  # noqa: SIM115 (the child holds it)
        try:
            self.popen = subprocess.Popen(
                self.cmd,
                stdout=f if f is not None else out,
                stderr=subprocess.STDOUT if f is not None or self.quiet else None,
                env=self.env,
                start_new_session=self.new_session,
                preexec_fn=die_with_parent(self.parent_death_signal) if self.parent_death_signal else None,
            )
        finally:
            if f is not None:
                f.close()
        self.started_at = time.monotonic()
        return self

    @property
    def pid(self) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.popen.pid

    def poll(self) -> int | None:
        return None if self.popen is None else self.popen.poll()

    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` to the child's process group (to the child alone without a session of its own)."""
        if not self.alive():
            return
        try:
            if self.new_session:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float | None = None) -> int:
        if self.popen is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.popen.wait(timeout=timeout)

    def stop(self, timeout: float = 15.0, sig: int = SIGTERM) -> int | None:
        """`sig` (SIGTERM), wait up to `timeout`, then SIGKILL; the child is reaped. Returns its exit code."""
        if self.popen is None:
            return None
        if self.alive():
            self.signal(sig)
            try:
                return self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int | None:
        """SIGKILL the (live) child's group and reap it."""
        if self.popen is None:
            return None
        self.signal(SIGKILL)
        try:
            return self.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            return None

    def tail(self, n: int = 40) -> str:
        """The last `n` lines of the log."""
        if self.log is None:
            return ""
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def stop_all(procs: Sequence[Proc], timeout: float = 15.0) -> None:
    """SIGTERM every live one first, then wait for each (SIGKILL after `timeout`), in reverse start order."""
    for p in procs:
        p.signal(SIGTERM)
    for p in reversed(procs):
        p.stop(timeout)
