"""Child processes and ports on 127.0.0.1: the one launcher used by `dsakv demo`, the PP prefill's stage
supervisor, the tests' clusters and the benches.

    port = free_ports(3)                      # 3 consecutive free ports, not handed out to anyone else on this machine
    p = Proc("decode", dsakv_cmd("serve", "--role", "decode", "--port", str(port)), log=Path("decode.log")).start()
    p.alive(); p.tail(20); p.stop()           # SIGTERM to its process group, SIGKILL after the timeout

Ports: the kernel hands port 0 binds (and so Mooncake's and UCX's own listeners) ports from its ephemeral range
(/proc/sys/net/ipv4/ip_local_port_range), so a port picked there can be taken between the pick and its use.
`free_ports` picks below that range, checks every port by binding it, and remembers what it handed out twice:
in a process-wide set (two picks in one process never overlap: a test module that starts several clusters) and
in a ledger shared by every process on the machine (two test runs, a bench and the demo at once): a file under
the temp dir (`$DSAKV_PORT_LEDGER` to move it), locked with flock while a pick reads and extends it, one line
`port pid until` per port handed out. A port stays held there for PORT_HOLD_S (10 min, long enough for the
child it was meant for to bind it, after which the bind check keeps it out) or until the pid that took it exits
(its children die with it, below). The caller binds nothing: the port goes to a child that binds it later, so
holding a socket open until then is not an option. Without a usable ledger (read-only temp dir, no fcntl) a
warning is logged once and picks are race-free within the process only.

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

import contextlib
import ctypes
import logging
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from signal import SIGKILL, SIGTERM
from typing import IO, Any, NoReturn

from dsakv.errors import ConfigError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on Unix
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger(__name__)

CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MC_LOG_LEVEL": "WARNING"}
TP_RANK_ENV = "DSAKV_TP_RANK"  # set (1..T-1) in the rank processes a TP group's rank 0 starts (engine/ranks.py)
PP_RANK_ENV = "DSAKV_PP_RANK"  # set (1..P-1) in the stage processes a colocated pipeline starts (pipeline/colocated.py)
LOWEST_PORT = 20000
PORT_HOLD_S = 600.0  # how long the machine-wide ledger keeps a port handed out by a live process
LEDGER_ENV = "DSAKV_PORT_LEDGER"

_handed_out: set[int] = set()
_ports_lock = threading.Lock()
_ledger_warned = False


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


def ledger_path() -> Path:
    """The machine-wide ledger of handed-out ports ($DSAKV_PORT_LEDGER, else dsakv-ports.ledger in the temp dir)."""
    return Path(os.environ.get(LEDGER_ENV) or Path(tempfile.gettempdir()) / "dsakv-ports.ledger")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


class _Ledger:
    """The ledger, locked (flock) from __enter__ to __exit__: `held` maps port -> (pid, until) for the live
    entries; `hold(span)` adds this process's and __exit__ writes the file back. Lines that do not parse (a
    writer killed mid-write) are dropped. `ok` is False (and nothing is shared) when the file cannot be used."""

    def __init__(self) -> None:
        self.path = ledger_path()
        self.held: dict[int, tuple[int, float]] = {}
        self.fd = -1
        self.changed = False

    @property
    def ok(self) -> bool:
        return self.fd >= 0

    def __enter__(self) -> _Ledger:
        global _ledger_warned
        if fcntl is None:
            return self
        try:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o666)
            with contextlib.suppress(OSError):  # shared by every user (the umask took write access away)
                if os.fstat(self.fd).st_uid == os.getuid():
                    os.fchmod(self.fd, 0o666)
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            raw = b""
            while chunk := os.read(self.fd, 1 << 16):
                raw += chunk
        except OSError as e:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
            if not _ledger_warned:
                _ledger_warned = True
                log.warning(
                    "free_ports: cannot use the port ledger %s (%s): ports are unique in this process only "
                    "(set $%s to a writable file)",
                    self.path,
                    e,
                    LEDGER_ENV,
                )
            return self
        now, live = time.time(), dict[int, bool]()
        for line in raw.decode("ascii", "replace").splitlines():
            try:
                port_s, pid_s, until_s = line.split()
                port, pid, until = int(port_s), int(pid_s), float(until_s)
            except ValueError:
                self.changed = True
                continue
            live[pid] = live[pid] if pid in live else _pid_alive(pid)
            if now < until <= now + PORT_HOLD_S + 1 and live[pid]:  # never longer than a hold (forged lines)
                self.held[port] = (pid, until)
            else:
                self.changed = True  # expired, or its process (and so, with parent death, its children) is gone
        return self

    def taken(self, span: range) -> bool:
        return any(p in self.held for p in span)

    def hold(self, span: range) -> None:
        until = time.time() + PORT_HOLD_S
        for p in span:
            self.held[p] = (os.getpid(), until)
        self.changed = True

    def __exit__(self, *exc: object) -> None:
        if self.fd < 0:
            return
        try:
            if self.changed:
                body = "".join(f"{p} {pid} {until:.0f}\n" for p, (pid, until) in sorted(self.held.items()))
                os.lseek(self.fd, 0, os.SEEK_SET)
                os.ftruncate(self.fd, 0)
                os.write(self.fd, body.encode("ascii"))
        finally:
            os.close(self.fd)  # releases the lock
            self.fd = -1


def free_ports(n: int = 1, attempts: int = 500, host: str = "127.0.0.1") -> int:
    """The first of `n` consecutive ports on `host` that are free now, below the ephemeral range, and not handed
    out before by this process (they are remembered, and never handed out again) nor, within PORT_HOLD_S, by any
    other live process on this machine (the shared ledger)."""
    if n < 1:
        raise ValueError(f"free_ports: n = {n} must be >= 1")
    lo, _hi = ephemeral_range()
    top = min(lo, 32768) - n - 1

    def usable(span: range, ledger: _Ledger) -> bool:
        mine = any(p in _handed_out for p in span)
        return not mine and not ledger.taken(span) and all(_bindable(p, host) for p in span)

    with _ports_lock, _Ledger() as ledger:
        if top > LOWEST_PORT:
            for _ in range(attempts):
                base = random.randint(LOWEST_PORT, top)
                span = range(base, base + n)
                if usable(span, ledger):
                    _handed_out.update(span)
                    ledger.hold(span)
                    return base
        # no room below the ephemeral range: fall back to what the kernel gives a port-0 bind
        for _ in range(attempts):
            with socket.socket() as s:
                s.bind((host, 0))
                base = int(s.getsockname()[1])
            span = range(base, base + n)
            if base + n < 65535 and usable(span, ledger):
                _handed_out.update(span)
                ledger.hold(span)
                return base
    raise ConfigError(f"found no {n} consecutive free ports on {host}")


def port_free(port: int) -> bool:
    """Whether `port` on 127.0.0.1 can be bound now."""
    return _bindable(port)


def dsakv_cmd(*args: str) -> list[str]:
    """argv of a `dsakv ...` child running this interpreter (so it inherits PYTHONPATH and the venv)."""
    return [sys.executable, "-m", "dsakv", *args]


#: called with every Proc as it starts (the test suite watches their logs for tracebacks: dsakv.testing.logscan)
ON_START: list[Callable[[Proc], None]] = []


def rank_process() -> bool:
    """True in a rank or stage process that a dsakv command started as a copy of itself (TP rank, PP stage >= 1)."""
    return any(os.environ.get(k, "0") not in ("", "0") for k in (TP_RANK_ENV, PP_RANK_ENV))


def exit_now(rc: int) -> NoReturn:
    """Flush the logs and streams, then leave with `rc` without interpreter finalization. For processes whose work is
    done and whose teardown is known to fail: nixl-cu12 1.5.1 segfaults in its agent's teardown (even a bare
    nixl_agent: a clean stop became 139), and a torch.distributed (gloo) rank process, its group destroyed, sometimes
    aborted in teardown ("terminate called without an active exception", -6: a DP2/EP2 rank in CI)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


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
        for hook in ON_START:
            hook(self)
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
