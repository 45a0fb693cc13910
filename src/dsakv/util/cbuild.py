"""The package's C sources (cache/native/page_native.c, disagg/transfer/backends/bind_shim.c) built into shared
libraries with the system C compiler: one description per source (CSource: path, flags, libraries), one set of
warnings for all of them, one cache of built libraries.

    src = CSource(Path(__file__).with_name("x.c"), flags=("-O3", "-pthread"))
    src.argv(cc, out)       [cc, -O3, -pthread, -Wall, -Wextra, -shared, -fPIC, -o, out, x.c]
    src.tag()               12 hex digits of the source and the flags: the built library's name (x-<tag>.so)
    build(src, strict=True) the compiler's error text, or None once built (scripts/check_c.py, `make lint`)

A library is built on first use into ~/.cache/dsakv (or the temp dir) by an atomic rename, named by its tag, so
concurrent processes may build it at once and an edited source is rebuilt. The warnings are on at every build and
`make lint` builds every source with -Werror too (CI fails on a warning); a runtime build does not add -Werror, so
a newer compiler's new warning cannot turn the fast path off on a user's machine. Standard library only.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

WARNINGS = ("-Wall", "-Wextra")
STRICT = ("-Werror",)  # added by build(strict=True): `make lint` / CI


@dataclass(frozen=True)
class CSource:
    path: Path
    flags: tuple[str, ...] = ("-O2",)  # optimisation, threads (before the warnings)
    libs: tuple[str, ...] = ()  # after the source: -ldl, ...

    @property
    def name(self) -> str:
        return self.path.stem

    def argv(self, cc: str, out: Path, strict: bool = False) -> list[str]:
        warn = (*WARNINGS, *STRICT) if strict else WARNINGS
        return [cc, *self.flags, *warn, "-shared", "-fPIC", "-o", str(out), str(self.path), *self.libs]

    def tag(self) -> str:
        h = hashlib.sha256(self.path.read_bytes())
        h.update("\0".join((*self.flags, *WARNINGS, *self.libs)).encode())
        return h.hexdigest()[:12]


def compiler() -> str | None:
    """$CC, else cc, gcc or clang on PATH (None when there is none)."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def cache_roots() -> list[Path]:
    """Where built libraries go: ~/.cache/dsakv ($XDG_CACHE_HOME), else a per-user folder in the temp dir."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return [Path(base) / "dsakv", Path(tempfile.gettempdir()) / f"dsakv-{os.getuid()}"]


def compile_into(src: CSource, out: Path, cc: str, strict: bool = False, timeout: float = 60.0) -> str | None:
    """Build `src` as `out` (through a temporary in out's folder, then an atomic rename); the compiler's error
    text, or None on success. OSError / SubprocessError (no folder, a hung compiler) propagate."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        obj = Path(tmp) / f"{src.name}.so"
        r = subprocess.run(src.argv(cc, obj, strict), capture_output=True, text=True, timeout=timeout)
        if r.returncode != 0:
            return f"{cc} failed: {r.stderr.strip()[:300]}"
        os.replace(obj, out)  # atomic: concurrent processes may build it at once
    return None


def load_or_build(src: CSource, name: str, load: Callable[[Path], ctypes.CDLL]) -> tuple[ctypes.CDLL | None, str]:
    """(`load` of the library `name` in the first cache root that has it or can build it, "") or (None, why not)."""
    cc = compiler()
    why = "no C compiler (cc, gcc or clang) on PATH"
    for root in cache_roots():
        out = root / name
        try:
            if not out.is_file():
                if cc is None:
                    break
                err = compile_into(src, out, cc)
                if err is not None:
                    return None, err
            return load(out), ""
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            why = f"cannot build or load it in {root}: {e}"
    return None, why


def build(src: CSource, strict: bool = False) -> str | None:
    """Build `src` into a temporary folder and throw it away (the check of `make lint`); the error text or None."""
    cc = compiler()
    if cc is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    with tempfile.TemporaryDirectory() as tmp:
        return compile_into(src, Path(tmp) / f"{src.name}.so", cc, strict)
