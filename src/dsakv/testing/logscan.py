"""No Python traceback in the output of any process the test suite starts (issue 26).

Every `Proc` started with a log file (dsakv.util.procs.ON_START), every log a fixture names with `watch` /
`watch_dir`, and (for the cluster tier) every `*.log` / `*.out` under the test's own tmp_path is scanned at the
end of each test (tests/conftest.py: the teardown report). A log is read from where the last scan stopped, so a
traceback fails the test during which it was written, with the log's path, line number and the block. A known
failure (a peer gone, a rank down, a bad request) must be logged in one line; a traceback means an unexpected
error, or a known one logged with log.exception.

The pytest plugin is this module (tests/conftest.py: pytest_plugins); `python -m pytest -p dsakv.testing.logscan`
runs it anywhere.

In-process servers, roles and engines of the cluster and inproc tiers log into pytest's captured log records,
which are scanned too; a test that injects an unexpected error on purpose (so that the code under test logs its
traceback, as it must for a bug) says so with `@pytest.mark.expect_traceback(reason)`.

ALLOWED is the narrow list of third-party output we cannot change, each entry with its reason. Native (C++) lines
of NIXL or Mooncake are not Python tracebacks and never match.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Generator, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dsakv.util import procs

__all__ = ["ALLOWED", "TRACEBACK", "Allowed", "Found", "LogWatch", "WATCH", "find_tracebacks", "watch", "watch_dir"]

TRACEBACK = "Traceback (most recent call last)"
LOG_SUFFIXES = (".log", ".out")
MAX_EXCERPT_LINES = 30


@dataclass(frozen=True)
class Allowed:
    """A traceback block matching `pattern` (re.search over the block) is third-party output we cannot change."""

    pattern: str
    reason: str


ALLOWED: tuple[Allowed, ...] = ()


@dataclass(frozen=True)
class Found:
    path: str
    line: int  # 1-based line number of the "Traceback (most recent call last):" line in the file
    excerpt: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: a Python traceback in a server log:\n{self.excerpt}"


def _allowed(block: str, allowed: Iterable[Allowed]) -> bool:
    return any(re.search(a.pattern, block) for a in allowed)


def find_tracebacks(text: str, first_line: int = 1, allowed: Iterable[Allowed] = ALLOWED) -> list[tuple[int, str]]:
    """(line number, excerpt) of every traceback in `text` not in `allowed`; the excerpt is the line before the
    header (the log message), the header and the block up to its exception line (the first unindented line)."""
    lines = text.splitlines()
    allowed = tuple(allowed)
    out = []
    i = 0
    while i < len(lines):
        if TRACEBACK not in lines[i]:
            i += 1
            continue
        j = i + 1
        while j < len(lines) and (lines[j][:1] in (" ", "\t") or not lines[j].strip()):
            j += 1
        end = min(j + 1, len(lines))  # the exception line ends the block
        block = lines[max(i - 1, 0) : end]
        if len(block) > MAX_EXCERPT_LINES:
            block = [*block[:3], f"    ... ({len(block) - 6} lines)", *block[-3:]]
        text_block = "\n".join(block)
        if not _allowed(text_block, allowed):
            out.append((first_line + i, text_block))
        i = end
    return out


class LogWatch:
    """Logs to scan: each read from the offset (and line count) where its last scan stopped, up to its last whole
    line, so a block is attributed to the scan during which it was written."""

    def __init__(self) -> None:
        self._files: dict[str, tuple[int, int]] = {}  # path -> (byte offset, lines before it)
        self._dirs: set[str] = set()
        self._lock = threading.Lock()

    def watch(self, path: str | os.PathLike[str]) -> None:
        with self._lock:
            self._files.setdefault(os.path.abspath(path), (0, 0))

    def watch_dir(self, path: str | os.PathLike[str]) -> None:
        """Every *.log / *.out directly in `path`, now and later (a launcher's log directory)."""
        with self._lock:
            self._dirs.add(os.path.abspath(path))

    def scan(self, extra_trees: Iterable[str | os.PathLike[str]] = ()) -> list[Found]:
        """New tracebacks in every watched log, and in every log under `extra_trees` (walked, then watched)."""
        for tree in extra_trees:
            for root, _dirs, files in os.walk(tree):
                for name in files:
                    if name.endswith(LOG_SUFFIXES):
                        self.watch(os.path.join(root, name))
        with self._lock:
            for d in self._dirs:
                try:
                    names = os.listdir(d)
                except OSError:
                    continue
                for name in names:
                    if name.endswith(LOG_SUFFIXES):
                        self._files.setdefault(os.path.join(d, name), (0, 0))
            paths = sorted(self._files)
        found = []
        for p in paths:
            found += self._scan_file(p)
        return found

    def _scan_file(self, path: str) -> list[Found]:
        with self._lock:
            offset, lineno = self._files[path]
        try:
            size = os.stat(path).st_size
            if size < offset:  # rewritten from the start
                offset, lineno = 0, 0
            elif size == offset:  # most logs, most of the time: nothing new
                return []
            with open(path, "rb") as f:
                f.seek(offset)
                data = f.read()
        except OSError:  # not written yet, or removed with its tmp dir (then nothing more will be)
            if offset:
                with self._lock:
                    self._files.pop(path, None)
            return []
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            return []
        chunk = data[:cut].decode(errors="replace")
        with self._lock:
            self._files[path] = (offset + cut, lineno + chunk.count("\n"))
        return [Found(path, n, ex) for n, ex in find_tracebacks(chunk, lineno + 1)]


WATCH = LogWatch()


def watch(path: str | os.PathLike[str]) -> Path:
    """Scan this log at the end of every test (returns the path)."""
    WATCH.watch(path)
    return Path(path)


def watch_dir(path: str | os.PathLike[str]) -> Path:
    WATCH.watch_dir(path)
    return Path(path)


# ---- the pytest plugin


def _watch_proc_log(p: procs.Proc) -> None:
    if p.log is not None:
        WATCH.watch(p.log)


def pytest_configure(config: pytest.Config) -> None:
    if _watch_proc_log not in procs.ON_START:
        procs.ON_START.append(_watch_proc_log)


def _report_tracebacks(item: pytest.Item, report: pytest.TestReport) -> list[str]:
    """What the teardown of `item` must fail for: new tracebacks in every watched log; for a cluster-tier test also
    in the logs under its tmp_path (a launcher's) and in its captured stderr (children that inherit it); for a
    cluster or in-process test in its captured log records too (the servers, roles and engines it runs in this
    process log there: a log.exception of theirs is a traceback in a server log)."""
    cluster = item.get_closest_marker("cluster") is not None
    inproc = item.get_closest_marker("inproc") is not None
    # a test injecting an unexpected error on purpose: its own process's log.exception is what it checks (the
    # processes it starts, and for a cluster test its captured stderr, are still scanned)
    own_log = item.get_closest_marker("expect_traceback") is None
    funcargs = getattr(item, "funcargs", {})
    tmp = funcargs.get("tmp_path") if cluster else None
    out = [str(f) for f in WATCH.scan([tmp] if tmp is not None else [])]
    if cluster or inproc:
        for name, text in report.sections:
            if (own_log and name.startswith("Captured log")) or (cluster and name.startswith("Captured stderr")):
                out += [f"{name}, line {n}: a Python traceback:\n{ex}" for n, ex in find_tracebacks(text)]
    return out


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Generator[None, Any, Any]:
    report = yield
    if call.when == "teardown":
        found = _report_tracebacks(item, report)
        if found:
            head = f"{len(found)} Python traceback(s) in the output of processes this test ran (dsakv.testing.logscan)"
            text = "\n\n".join([head, *found[:5]])
            if report.longrepr:
                text = f"{report.longreprtext}\n\n{text}"
            report.outcome = "failed"
            report.longrepr = text
    return report
