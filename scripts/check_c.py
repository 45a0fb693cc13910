"""`make lint`'s check of the package's C: every .c under src/dsakv is described by a CSource (no C escapes the
check), and each is built with its own flags plus -Wall -Wextra -Werror (a warning fails CI). Exit 1 on either."""

from __future__ import annotations

import sys
from pathlib import Path

from dsakv.cache.native import SOURCE
from dsakv.disagg.transfer.backends.bind_shim import SHIM_SOURCE
from dsakv.model.native import SOURCE as GEMM_SOURCE
from dsakv.util.cbuild import CSource, build

SOURCES: tuple[CSource, ...] = (SOURCE, SHIM_SOURCE, GEMM_SOURCE)


def main() -> int:
    pkg = Path(__file__).resolve().parents[1] / "src" / "dsakv"
    on_disk = {p.resolve() for p in pkg.rglob("*.c")}
    known = {s.path.resolve() for s in SOURCES}
    failed = 0
    for p in sorted(on_disk - known):
        print(f"check_c: {p} has no CSource in scripts/check_c.py SOURCES: add it there (and build it where used)")
        failed += 1
    for s in SOURCES:
        err = build(s, strict=True)
        print(f"check_c: {s.path.relative_to(pkg)}: {'ok' if err is None else err}")
        failed += err is not None
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
