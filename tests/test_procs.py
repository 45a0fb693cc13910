"""dsakv.util.procs: the launcher of the demo, the PP stage supervisor, the tests' clusters and the benches."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time

from dsakv.util.procs import Proc, dsakv_cmd, ephemeral_range, free_ports

GRANDCHILD = (
    "import signal, subprocess, sys, time\n"
    "if sys.argv[1] == 'stubborn': signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print('grandchild', c.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def test_free_ports_never_overlap_and_stay_below_the_ephemeral_range():
    lo, _hi = ephemeral_range()
    bases = [free_ports(3) for _ in range(30)]
    ports = [p for b in bases for p in range(b, b + 3)]
    assert len(set(ports)) == 90  # nothing handed out twice in this process
    if lo > 20000 + 4:
        assert all(20000 <= p < lo for p in ports)
    for p in ports[:6]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))  # free when handed out


def _grandchild(p: Proc) -> int:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        for line in p.tail().splitlines():
            if line.startswith("grandchild "):
                return int(line.split()[1])
        time.sleep(0.05)
    raise AssertionError(p.tail())


def _gone(pid: int, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_stop_ends_the_whole_process_group(tmp_path):
    p = Proc("polite", [sys.executable, "-c", GRANDCHILD, "polite"], log=tmp_path / "polite.log").start()
    gc = _grandchild(p)
    assert p.alive() and os.getpgid(gc) == p.pid  # its own session: the grandchild is in the child's group
    assert p.stop(timeout=10) == -signal.SIGTERM
    assert not p.alive() and _gone(gc)


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path):
    p = Proc("stubborn", [sys.executable, "-c", GRANDCHILD, "stubborn"], log=tmp_path / "stubborn.log").start()
    gc = _grandchild(p)
    t0 = time.monotonic()
    assert p.stop(timeout=1.0) == -signal.SIGKILL
    assert time.monotonic() - t0 >= 1.0 and _gone(gc)
    assert p.stop() == -signal.SIGKILL  # stopping again is a no-op that reports the exit code
    assert dsakv_cmd("plan", "--help") == [sys.executable, "-m", "dsakv", "plan", "--help"]
