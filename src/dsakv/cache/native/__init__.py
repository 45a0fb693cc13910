"""Small C loops for the host and disk tiers (page_native.c here), compiled with the system C compiler on first use.

    copy_runs(geo, runs, stream) page_copy.copy_page_set: every run of every buffer, one memmove each (or one
                                 copy with non-temporal SSE2 stores when `stream`: large copies)
    sum64(segs)                  storage.base.page_checksum: wrapping sum of the payload's little-endian u64 words
                                 (AVX2 where the CPU has it)
    read_pages(...)              FileStore.get: a whole batch of page files in one call, the GIL released: per
                                 file openat (non-blocking, no symlinks), fstat (regular, exact size), the record
                                 compared with the expected one, the payload copied into the host segments and
                                 word-summed (map_sum or read_sum), the LRU stamp (utimensat); stops at the first
                                 page that fails and says why (status, errno/size/bytes); every record as read
                                 comes back (the caller checks each page's MAC in the segments)
    map_sum(fd, offset, segs)    copy from a read-only shared mapping of the page cache, the checksum words
                                 added in the same pass, streaming stores (the destination is not read first); a
                                 SIGBUS (the file truncated under the mapping) reads as -EFAULT
    read_sum(fd, offset, segs)   the same with preadv in 256 KiB windows, each summed after it is read
                                 (DSAKV_DISK_READ=preadv)
    write_pages(...)             FileStore.put: a batch of page files in one call: per file a temporary (its
                                 directory made if missing), checksum into the record, record + payload in one
                                 pwritev (or windows, each summed just before it is written), rename; a failure
                                 leaves a written prefix (other threads' pages undone)

Python pays ~1 us per buffer and run (ctypes.memmove, memoryview, numpy view): 99 buffers x 16 pages is ~2-3 ms
on a 53 MiB copy that memcpy does in ~8 ms. These loops do the same work once per call. The library is built
into ~/.cache/dsakv (or the temp dir) as page_native-<source and flags hash>.so by an atomic rename
(dsakv.util.cbuild.load_or_build, as small_gemm.c is), with -Wall -Wextra (and -Werror in `make lint`).
Without a compiler, if the build fails, or with DSAKV_NO_NATIVE=1, `lib()` is None after one warning and the
callers run their Python loops (same bytes, same files, same refusals). Standard library only (no torch, no
numpy): storage/base.py imports it.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

from dsakv.util.cbuild import CSource, load_or_build

log = logging.getLogger(__name__)

SOURCE = CSource(Path(__file__).with_name("page_native.c"), flags=("-O3", "-pthread"))  # built from disk

_LIB: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable (warned once)


def _load(path: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.dsakv_copy_runs.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int]
    lib.dsakv_copy_runs.restype = None
    lib.dsakv_sum64.argtypes = [ctypes.c_int64, ctypes.c_void_p]
    lib.dsakv_sum64.restype = ctypes.c_uint64
    lib.dsakv_read_sum.argtypes = [
        ctypes.c_int,
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_uint64),
    ]
    lib.dsakv_read_sum.restype = ctypes.c_int64
    p = ctypes.c_void_p
    i64 = ctypes.c_int64
    lib.dsakv_read_pages.argtypes = [ctypes.c_int, i64, p, i64, p, i64, i64, i64, ctypes.c_uint64, p, p]
    lib.dsakv_read_pages.argtypes += [ctypes.c_int, ctypes.c_int, ctypes.c_int, p, p, p, p]
    lib.dsakv_map_sum.argtypes = [ctypes.c_int, i64, i64, p, ctypes.POINTER(ctypes.c_uint64)]
    lib.dsakv_map_sum.restype = i64
    lib.dsakv_write_pages.argtypes = [ctypes.c_int, i64, p, i64, p, i64, p, i64, i64, i64, ctypes.c_uint64, p, p]
    lib.dsakv_write_pages.argtypes += [i64, ctypes.c_int, p]
    lib.dsakv_write_pages.restype = i64
    lib.dsakv_read_pages.restype = i64
    return lib


def _build() -> ctypes.CDLL | None:
    lib, why = load_or_build(SOURCE, f"page_native-{SOURCE.tag()}.so", _load)
    if lib is None:
        log.warning("host/disk tier copies run in Python (same bytes, ~1 us per buffer and page): %s", why)
    return lib


def lib() -> ctypes.CDLL | None:
    """The compiled loops (built on first use), or None (callers use their Python loops; warned once)."""
    global _LIB
    if _LIB is None:
        _LIB = False if os.environ.get("DSAKV_NO_NATIVE") else (_build() or False)
    return _LIB if isinstance(_LIB, ctypes.CDLL) else None


def seg_table(segs: list[tuple[int, int]]) -> ctypes.Array[ctypes.c_int64]:
    """Segments [(addr, bytes), ...] as the flat int64 table the C loops take."""
    flat = [v for seg in segs for v in seg]
    return (ctypes.c_int64 * len(flat))(*flat)


__all__ = ["SOURCE", "lib", "seg_table"]
