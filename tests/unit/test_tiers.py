"""The test tiers hold what their names say: no file under tests/unit/ or tests/inproc/ starts a process (those
belong in tests/cluster/, which `make test-fast` skips), and every test file sits in one tier. Read with ast."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
# what starts a process: the standard library's ways, and the harnesses in dsakv.testing / dsakv.util.procs
STARTERS = {"subprocess", "multiprocessing", "Popen", "Proc", "PeerProcess", "Cluster", "dsakv_cmd", "fork"}


def starters(path: Path) -> set[str]:
    """The process-starting names a file imports or calls (os.fork, subprocess.run, Cluster(...), ...)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names} & STARTERS
        elif isinstance(node, ast.ImportFrom):
            found |= ({(node.module or "").split(".")[0]} | {a.name for a in node.names}) & STARTERS
        elif isinstance(node, ast.Attribute) and node.attr in STARTERS:
            found.add(node.attr)
    return found


def test_no_unit_or_inproc_test_starts_a_process():
    bad = {
        str(p.relative_to(TESTS)): sorted(starters(p))
        for tier in ("unit", "inproc")
        for p in sorted((TESTS / tier).rglob("test_*.py"))
        if starters(p)
    }
    assert not bad, f"these start processes: move them to tests/cluster/: {bad}"


def test_every_test_file_is_in_a_tier_and_basenames_are_unique():
    files = sorted(TESTS.rglob("test_*.py"))
    outside = [
        str(p.relative_to(TESTS)) for p in files if p.relative_to(TESTS).parts[0] not in ("unit", "inproc", "cluster")
    ]
    assert not outside, f"test files outside tests/{{unit,inproc,cluster}}/: {outside}"
    names = [p.name for p in files]
    assert len(names) == len(set(names)), sorted({n for n in names if names.count(n) > 1})


def test_the_scan_sees_each_way_of_starting_a_process(tmp_path):
    f = tmp_path / "test_x.py"
    f.write_text("import subprocess\nfrom dsakv.testing.cluster import Cluster\nimport os\nos.fork()\n")
    assert starters(f) == {"subprocess", "Cluster", "fork"}
    f.write_text("import os\nfrom dsakv.testing.engines import tiny_model\n")
    assert starters(f) == set()
