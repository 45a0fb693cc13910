"""How the package's C is built (dsakv.util.cbuild): one CSource per .c file, the warnings on every build, -Werror
in the strict build of `make lint`, the library named by a tag of the source and the flags. No compiler runs here
(tests/cluster/test_cbuild_compile.py builds)."""

from __future__ import annotations

from pathlib import Path

from dsakv.cache.native import SOURCE
from dsakv.disagg.transfer.backends.bind_shim import SHIM_SOURCE
from dsakv.model.native import SOURCE as GEMM_SOURCE
from dsakv.util.cbuild import CSource

PKG = Path(__file__).resolve().parents[3] / "src" / "dsakv"


def test_every_c_file_has_its_csource_and_none_is_inside_python():
    assert {p.relative_to(PKG).as_posix() for p in PKG.rglob("*.c")} == {
        "cache/native/page_native.c",
        "disagg/transfer/backends/bind_shim.c",
        "model/native/small_gemm.c",
    }
    assert {SOURCE.path.resolve(), SHIM_SOURCE.path.resolve(), GEMM_SOURCE.path.resolve()} == {
        p.resolve() for p in PKG.rglob("*.c")
    }
    for py in PKG.rglob("*.py"):  # no C program in a Python string any more
        assert "#include <" not in py.read_text(), py


def test_argv_has_the_warnings_and_strict_adds_werror():
    out = Path("/tmp/x.so")
    assert SOURCE.argv("cc", out) == [
        *("cc", "-O3", "-pthread", "-Wall", "-Wextra", "-shared", "-fPIC", "-o", "/tmp/x.so", str(SOURCE.path))
    ]
    assert SHIM_SOURCE.argv("cc", out, strict=True) == [
        *("cc", "-O2", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC", "-o", "/tmp/x.so", str(SHIM_SOURCE.path))
    ] + ["-ldl"]


def test_the_tag_follows_the_source_and_the_flags(tmp_path):
    c = tmp_path / "a.c"
    c.write_text("int f(void) { return 1; }\n")
    a = CSource(c, flags=("-O2",))
    assert a.tag() == CSource(c, flags=("-O2",)).tag() and len(a.tag()) == 12
    assert a.tag() != CSource(c, flags=("-O3",)).tag() != CSource(c, flags=("-O2",), libs=("-ldl",)).tag()
    before = a.tag()
    c.write_text("int f(void) { return 2; }\n")
    assert a.tag() != before
