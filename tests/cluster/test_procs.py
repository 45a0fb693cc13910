"""dsakv.util.procs: the launcher of the demo, the PP stage supervisor, the tests' clusters and the benches."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dsakv.util import procs as procs_mod
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


def _dead(pid: int, timeout: float = 10.0) -> bool:
    """Whether `pid` is gone (or a zombie: dead, not yet reaped by whoever inherited it) within `timeout`."""
    end = time.monotonic() + timeout
    while True:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(0.05)


MIDDLE = (
    "import sys, time\n"
    "from dsakv.util.procs import Proc\n"
    "c = Proc('sleeper', [sys.executable, '-c', 'import time; time.sleep(120)'], quiet=True).start()\n"
    "print('grandchild', c.pid, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_procs_child_dies_with_its_parent_killed_minus_9(tmp_path):
    # the middle process starts its child with Proc (own session, so killing the middle's group would not reach it)
    p = Proc("middle", [sys.executable, "-c", MIDDLE], log=tmp_path / "middle.log", parent_death_signal=None).start()
    gc = _grandchild(p)
    assert not _dead(gc, timeout=0.2) and os.getpgid(gc) == gc  # alive, in a session of its own
    os.kill(p.pid, signal.SIGKILL)  # the middle alone (not its group): only the death signal can end the child
    p.wait(timeout=10)
    try:
        assert _dead(gc)
    finally:
        if not _dead(gc, timeout=0):
            os.kill(gc, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_a_child_whose_parent_died_before_it_armed_the_signal_exits_at_once():
    # the race: re-parented before prctl -> getppid() is not the parent that started it -> exit 128 + SIGTERM
    code = "from dsakv.util.procs import arm_parent_death\narm_parent_death(1, 15)\nprint('still running')"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (128 + signal.SIGTERM, "")
    code = "import os\nfrom dsakv.util.procs import arm_parent_death\nprint(arm_parent_death(os.getppid(), 15))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert (r.returncode, r.stdout) == (0, "True\n")  # the live parent: armed, running on


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_store_master_killed_minus_9_leaves_no_mooncake_master(tmp_path):
    pytest.importorskip("mooncake.store")
    port = free_ports(3)
    cmd = dsakv_cmd("store-master", "--port", str(port), "--size", "16MiB")
    p = Proc("store-master", cmd, log=tmp_path / "store-master.log", parent_death_signal=None).start()
    end = time.monotonic() + 60
    while not (m := re.search(r"store master ready: .* mooncake_master pid (\d+)\)", p.tail())):
        assert p.alive() and time.monotonic() < end, p.tail()
        time.sleep(0.1)
    master = int(m.group(1))
    assert not _dead(master, timeout=0.2)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=10)
    try:
        assert _dead(master), f"mooncake_master pid {master} outlived its store-master"
    finally:
        if not _dead(master, timeout=0):
            os.kill(master, signal.SIGKILL)  # leave no orphan behind when the assertion fails
    end = time.monotonic() + 10
    while True:  # nothing listens on its RPC port any more (once the kernel has torn its threads down)
        try:
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        except ConnectionRefusedError:
            break
        except OSError:  # reset: the listener is closing
            pass
        assert time.monotonic() < end, f"port {port} still accepts after mooncake_master pid {master} died"
        time.sleep(0.1)


PICKER = (
    "import os, random, sys, time\n"
    "from dsakv.util import procs\n"
    "random.seed(1234)  # both pickers draw the same candidates: only the shared ledger keeps them apart\n"
    "procs._bindable = lambda port, host='127.0.0.1': True  # no bind check: it would race the other picker's\n"
    "open(sys.argv[2], 'w').close()  # ready\n"
    "while not os.path.exists(sys.argv[1]): time.sleep(0.005)\n"
    "print(' '.join(str(procs.free_ports(3)) for _ in range(40)), flush=True)\n"
    "sys.stdin.read()  # alive (its ledger entries with it) until the test closes stdin\n"
)


def _pick_concurrently(tmp_path, ledger: str, on_picked=None) -> list[list[int]]:
    """Two pickers started together and released at once (each says it is ready, then waits for `go`), so their
    picks interleave; each returns the bases of its 40 spans of 3 ports. Both stay alive until both have picked and
    on_picked() has run (a picker that exited early would have its entries dropped by the other's next read).
    Their bind checks are off: what keeps the two apart is the ledger alone, and without it they draw the very same
    spans (the control), whatever else runs on the machine (a bind check would make two racing pickers diverge on
    a port the other is probing)."""
    go = tmp_path / "go"
    go.unlink(missing_ok=True)
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    for r in ready:
        r.unlink(missing_ok=True)
    env = {**os.environ, "DSAKV_PORT_LEDGER": ledger}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PICKER, str(go), str(r)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in ready
    ]
    while not all(r.exists() for r in ready):
        assert all(p.poll() is None for p in procs), [p.communicate() for p in procs]
        time.sleep(0.01)
    go.touch()
    lines = ["", ""]
    try:
        lines = [p.stdout.readline() for p in procs]  # both picked; both still alive
        if on_picked is not None:
            on_picked()
    finally:
        outs = [line + p.communicate(timeout=120)[0] for line, p in zip(lines, procs, strict=True)]
    assert [p.returncode for p in procs] == [0, 0], outs
    return [[int(b) for b in out.split()] for out in outs]


def test_free_ports_two_processes_at_once_get_disjoint_ports(tmp_path, monkeypatch):
    ledger = tmp_path / "ports.ledger"
    held: list[str] = []
    a, b = _pick_concurrently(tmp_path, str(ledger), lambda: held.extend(ledger.read_text().splitlines()))
    spans_a = {p for base in a for p in range(base, base + 3)}
    spans_b = {p for base in b for p in range(base, base + 3)}
    assert len(spans_a) == len(spans_b) == 120 and not spans_a & spans_b
    assert {int(line.split()[0]) for line in held} == spans_a | spans_b  # while both pickers lived
    monkeypatch.setenv("DSAKV_PORT_LEDGER", str(ledger))
    mine = free_ports(1)  # the pickers exited: the next reader drops their entries and leaves only its own
    assert [line.split()[:2] for line in ledger.read_text().splitlines()] == [[str(mine), str(os.getpid())]]
    # the control: without a usable ledger (a directory), the same seed hands both processes the same 40 spans
    a2, b2 = _pick_concurrently(tmp_path, str(tmp_path))
    assert a2 == b2 and len(set(a2)) == 40
    # ... which under the ledger went to whichever picker locked it first, and to that one only: the first of them
    # (both pickers' first draw) is in exactly one of the two racing pickers' picks
    assert (a2[0] in a) != (a2[0] in b)


def test_the_port_ledger_drops_expired_dead_garbled_and_forged_entries(tmp_path, monkeypatch):
    ledger = tmp_path / "ports.ledger"
    monkeypatch.setenv("DSAKV_PORT_LEDGER", str(ledger))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    now, me = time.time(), os.getpid()
    ledger.write_text(
        f"25000 {me} {now + 100:.0f}\n25001 {dead.pid} {now + 100:.0f}\n25002 {me} {now - 1:.0f}\nnot a line\n"
        f"25003 {me} {now + 10 * procs_mod.PORT_HOLD_S:.0f}\n"  # held longer than any hold: forged
    )
    with procs_mod._Ledger() as led:
        assert led.ok and led.held == {25000: (me, float(f"{now + 100:.0f}"))}
        assert led.taken(range(24999, 25001)) and not led.taken(range(25001, 25004))
        led.hold(range(25005, 25007))
    lines = ledger.read_text().splitlines()
    assert [line.split()[:2] for line in lines] == [["25000", str(me)], ["25005", str(me)], ["25006", str(me)]]
    assert abs(float(lines[1].split()[2]) - (time.time() + procs_mod.PORT_HOLD_S)) < 5


RANK_MAIN = (
    "import atexit, sys\n"
    "atexit.register(print, 'finalized', flush=True)\n"
    "from dsakv.cli.main import main\n"
    "sys.argv = ['dsakv', 'generate', '--model', sys.argv[1], '--prompt-ids', '1']\n"
    "print('rc', main(), flush=True)\n"
)


@pytest.mark.parametrize("env", [{}, {"DSAKV_TP_RANK": "1"}, {"DSAKV_PP_RANK": "2"}, {"DSAKV_TP_RANK": "0"}])
def test_a_rank_process_leaves_without_interpreter_teardown(tmp_path, env):
    """A TP rank / PP stage process (its rank env set, >= 1) returns from `dsakv` with util.procs.exit_now: the
    status is the command's (2: a refused --model), its error is printed, and nothing of the interpreter's teardown
    runs (no atexit: where gloo once aborted a rank that had stopped cleanly). Any other process returns normally."""
    clean = {k: v for k, v in os.environ.items() if k not in ("DSAKV_TP_RANK", "DSAKV_PP_RANK")}
    got = subprocess.run(
        [sys.executable, "-c", RANK_MAIN, str(tmp_path / "missing")],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "has no config.json" in got.stderr
    rank = any(v != "0" for v in env.values())
    assert (got.returncode, got.stdout) == ((2, "") if rank else (0, "rc 2\nfinalized\n")), got.stderr
