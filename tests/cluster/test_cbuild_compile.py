"""The strict build `make lint` runs (scripts/check_c.py) fails on a warning and passes clean C: the system
compiler runs (a process), on a source with an unused variable and on the package's own sources."""

from __future__ import annotations

import pytest

from dsakv.cache.native import SOURCE
from dsakv.disagg.transfer.backends.bind_shim import SHIM_SOURCE
from dsakv.util.cbuild import CSource, build, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler on PATH")


def test_a_warning_fails_the_strict_build_only(tmp_path):
    c = tmp_path / "warns.c"
    c.write_text("int f(int x) { int unused = x; return 0; }\n")
    err = build(CSource(c), strict=True)
    assert err is not None and "unused" in err and "-Werror" in err
    assert build(CSource(c)) is None  # a runtime build warns but builds


@pytest.mark.parametrize("src", [SOURCE, SHIM_SOURCE], ids=lambda s: s.path.name)
def test_the_package_c_builds_with_werror(src):
    assert build(src, strict=True) is None
