"""The suite's traceback gate (dsakv.testing.logscan, issue 26): a Python traceback in the log of a process a test
starts fails that test's teardown with the log's path, line and block; native lines and one-line errors pass."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

from dsakv.testing.logscan import Allowed, LogWatch, find_tracebacks

LOG = """\
2026-12-02 05:00:00 INFO dsakv.serve: ready
2026-12-02 05:00:01 ERROR dsakv.engine: step failed
Traceback (most recent call last):
  File "/x/engine.py", line 10, in step
    run()
ValueError: boom
E20261202 05:00:02.000 transfer_engine.cpp:42] Traceback-free native error: connection reset
2026-12-02 05:00:03 WARNING dsakv.engine: TP rank 1 down: gloo connection closed
"""


def test_find_tracebacks_names_the_line_and_the_block_and_nothing_else():
    assert find_tracebacks(LOG, first_line=11) == [
        (
            13,
            "2026-12-02 05:00:01 ERROR dsakv.engine: step failed\n"
            "Traceback (most recent call last):\n"
            '  File "/x/engine.py", line 10, in step\n'
            "    run()\n"
            "ValueError: boom",
        )
    ]
    assert find_tracebacks(LOG, allowed=[Allowed(r"ValueError: boom", "a test of the allow-list")]) == []
    assert find_tracebacks(LOG.replace("Traceback (most recent call last):\n", "")) == []


def test_a_log_is_read_on_from_where_the_last_scan_stopped(tmp_path):
    log = tmp_path / "w.txt"  # not *.log: the gate itself would fail this test for the tracebacks it writes
    w = LogWatch()
    w.watch(log)
    assert w.scan() == []  # not written yet
    log.write_text(LOG + "Traceback (most recent call last):")  # a block still being written: up to its last line
    assert [(f.path, f.line) for f in w.scan()] == [(str(log), 3)]
    assert w.scan() == []  # the same block is reported once
    with log.open("a") as f:
        f.write("\n  File 'y'\nKeyError: 1\n")
    (found,) = w.scan()
    assert (found.line, found.excerpt.splitlines()[-1]) == (9, "KeyError: 1")
    assert str(found).startswith(f"{log}:9: a Python traceback in a server log:\n")


PLUGIN_TEST = """\
import sys
import pytest
from dsakv.util.procs import Proc

@pytest.mark.cluster
def test_child(tmp_path):
    code = {code!r}
    p = Proc("child", [sys.executable, "-c", code], tmp_path / "child.log").start()
    p.wait(60)
"""


def _run_plugin(tmp_path: Path, code: str) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "test_gate.py"
    f.write_text(PLUGIN_TEST.format(code=code))
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "dsakv.testing.logscan", "-p", "no:cacheprovider"]
    argv += ["-o", "markers=cluster: the tier", str(f)]
    return subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_a_traceback_in_a_child_log_fails_the_test_that_ran_it(tmp_path):
    code = textwrap.dedent("""\
        import sys
        print("E1202 native.cpp:1] not python", flush=True)
        print("TP rank 1 down: gloo", flush=True)
        raise ValueError("boom from the child")
    """)
    r = _run_plugin(tmp_path, code)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "1 passed, 1 error" in r.stdout, r.stdout
    assert "ERROR at teardown of test_child" in r.stdout, r.stdout
    assert "child.log:3: a Python traceback in a server log:" in r.stdout, r.stdout
    assert "ValueError: boom from the child" in r.stdout


def test_native_lines_and_one_line_errors_pass(tmp_path):
    code = 'print("E1202 transfer_engine.cpp:1] handshake failed"); print("ERROR stage 1 gone: connection reset")'
    r = _run_plugin(tmp_path, code)
    assert r.returncode == 0 and "1 passed" in r.stdout, r.stdout + r.stderr
