"""Three small C loops for the host and disk tiers, compiled with the system C compiler on first use.

    copy_runs(geo, runs, stream) page_copy.copy_page_set: every run of every buffer, one memmove each (or one
                                 copy with non-temporal SSE2 stores when `stream`: large copies)
    sum64(segs)                  storage.base.page_checksum: wrapping sum of the payload's little-endian u64 words
    read_sum(fd, offset, segs)   the disk tier's read: preadv straight into the segments in 256 KiB windows, each
                                 summed (sum64) while it is still in cache: one pass over memory, not two

Python pays ~1 us per buffer and run (ctypes.memmove, memoryview, numpy view): 99 buffers x 16 pages is ~2-3 ms
on a 53 MiB copy that memcpy does in ~8 ms. These loops do the same work once per call. The library is built
into ~/.cache/dsakv (or the temp dir) as page_native-<source hash>.so by an atomic rename, as
disagg/backends/bind_shim.py builds its shim. Without a compiler, if the build fails, or with
DSAKV_NO_NATIVE=1, `lib()` is None after one warning and the callers run their Python loops (same bytes).
Standard library only (no torch, no numpy): storage/base.py imports it.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <string.h>
#include <sys/types.h>
#include <sys/uio.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

/* dst <- src, n bytes, with non-temporal (streaming) stores where the CPU has them and the ranges do not
   overlap: what glibc's memcpy does for one large copy, so the destination is not read first (no RFO). */
static void copy_stream(char *dst, const char *src, size_t n) {
#if defined(__SSE2__)
    if (n >= 256 && (dst + n <= src || src + n <= dst)) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head; src += head; n -= head;
        for (; n >= 64; n -= 64, dst += 64, src += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
        memcpy(dst, src, n);
        return;
    }
#endif
    memmove(dst, src, n);
}

/* geo: nbuf rows of (dst addr, dst row stride, src addr, src row stride, row bytes);
   runs: nruns rows of (dst page, src page, pages). Every buffer gets every run. stream: non-temporal stores
   (for copies larger than the cache, as the caller decides). */
void dsakv_copy_runs(int64_t nbuf, const int64_t *geo, int64_t nruns, const int64_t *runs, int stream) {
    void *(*mv)(void *, const void *, size_t) = memmove;
    for (int64_t b = 0; b < nbuf; b++) {
        const int64_t *g = geo + 5 * b;
        char *da = (char *)(intptr_t)g[0];
        const char *sa = (const char *)(intptr_t)g[2];
        int64_t ds = g[1], ss = g[3], w = g[4];
        for (int64_t r = 0; r < nruns; r++) {
            int64_t d = runs[3 * r], s = runs[3 * r + 1], k = runs[3 * r + 2];
            if (ds == w && ss == w) {
                if (stream) copy_stream(da + d * w, sa + s * w, (size_t)(k * w));
                else mv(da + d * w, sa + s * w, (size_t)(k * w));
            } else {
                for (int64_t i = 0; i < k; i++) {
                    if (stream) copy_stream(da + (d + i) * ds, sa + (s + i) * ss, (size_t)w);
                    else mv(da + (d + i) * ds, sa + (s + i) * ss, (size_t)w);
                }
            }
        }
    }
#if defined(__SSE2__)
    if (stream) _mm_sfence();
#endif
}

/* Adds the little-endian u64 words of n bytes at p, the first at stream position *pos (so segments laid end to
   end sum as one stream, the last word zero padded), to *total. */
static void sum_into(const unsigned char *p, uint64_t n, uint64_t *pos, uint64_t *total) {
    uint64_t t = *total, q = *pos;
    while (n && (q & 7)) { t += (uint64_t)*p++ << (8 * (q & 7)); q++; n--; }
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
    for (; n >= 32; n -= 32, p += 32, q += 32) {
        uint64_t w[4];
        memcpy(w, p, 32);
        a0 += w[0]; a1 += w[1]; a2 += w[2]; a3 += w[3];
    }
    for (; n >= 8; n -= 8, p += 8, q += 8) { uint64_t w; memcpy(&w, p, 8); a0 += w; }
    t += a0 + a1 + a2 + a3;
    while (n) { t += (uint64_t)*p++ << (8 * (q & 7)); q++; n--; }
    *total = t;
    *pos = q;
}

/* Wrapping sum of the little-endian u64 words of the segments laid end to end. segs: nseg rows of (addr, bytes). */
uint64_t dsakv_sum64(int64_t nseg, const int64_t *segs) {
    uint64_t total = 0, pos = 0;
    for (int64_t i = 0; i < nseg; i++)
        sum_into((const unsigned char *)(intptr_t)segs[2 * i], (uint64_t)segs[2 * i + 1], &pos, &total);
    return total;
}

/* preadv(fd, segs) from `offset` in windows of at most 256 KiB, each summed (dsakv_sum64) right after it is
   read, while it is still in cache. Returns the bytes read (short at end of file) or -errno; *sum the sum of
   the bytes read. */
int64_t dsakv_read_sum(int fd, int64_t offset, int64_t nseg, const int64_t *segs, uint64_t *sum) {
    enum { WINDOW = 256 * 1024, MAXIOV = 256 };
    struct iovec iov[MAXIOV];
    int64_t got = 0, i = 0;
    uint64_t skip = 0, pos = 0, total = 0; /* skip: bytes of segs[i] already read */
    while (i < nseg) {
        int cnt = 0;
        uint64_t want = 0;
        for (int64_t j = i; j < nseg && cnt < MAXIOV && want < WINDOW; j++, cnt++) {
            uint64_t off = (j == i) ? skip : 0, len = (uint64_t)segs[2 * j + 1] - off;
            if (len > WINDOW - want) len = WINDOW - want;
            char *base = (char *)(intptr_t)segs[2 * j] + off;
            want += len;
            if (cnt && (char *)iov[cnt - 1].iov_base + iov[cnt - 1].iov_len == base) { /* adjacent: one iovec */
                iov[cnt - 1].iov_len += (size_t)len;
                cnt--;
                continue;
            }
            iov[cnt].iov_base = base;
            iov[cnt].iov_len = (size_t)len;
        }
        ssize_t r = preadv(fd, iov, cnt, (off_t)(offset + got));
        if (r < 0) {
            if (errno == EINTR) continue;
            return -(int64_t)errno;
        }
        if (r == 0) break;
        got += r;
        uint64_t left = (uint64_t)r;
        for (int c = 0; c < cnt && left; c++) {
            uint64_t n = iov[c].iov_len < left ? iov[c].iov_len : left;
            sum_into((const unsigned char *)iov[c].iov_base, n, &pos, &total);
            left -= n;
        }
        left = (uint64_t)r;
        while (i < nseg && left >= (uint64_t)segs[2 * i + 1] - skip) {
            left -= (uint64_t)segs[2 * i + 1] - skip;
            skip = 0;
            i++;
        }
        skip += left;
    }
    *sum = total;
    return got;
}
"""

_LIB: ctypes.CDLL | None | bool = None  # None: not tried yet; False: unavailable (warned once)


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsakv"


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
    return lib


def _build() -> ctypes.CDLL | None:
    tag = hashlib.sha256(SOURCE.encode()).hexdigest()[:12]
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    why = "no C compiler (cc, gcc or clang) on PATH"
    for root in (_cache_dir(), Path(tempfile.gettempdir()) / f"dsakv-{os.getuid()}"):
        out = root / f"page_native-{tag}.so"
        try:
            if not out.is_file():
                if cc is None:
                    break
                root.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=root) as tmp:
                    src = Path(tmp) / "page_native.c"
                    src.write_text(SOURCE)
                    obj = Path(tmp) / "page_native.so"
                    r = subprocess.run(
                        [cc, "-O3", "-shared", "-fPIC", "-o", str(obj), str(src)],
                        capture_output=True,
                        text=True,
                        timeout=60,
                    )
                    if r.returncode != 0:
                        why = f"{cc} failed: {r.stderr.strip()[:300]}"
                        break
                    os.replace(obj, out)  # atomic: concurrent processes may build it at once
            return _load(out)
        except (OSError, AttributeError, subprocess.SubprocessError) as e:
            why = f"cannot build or load it in {root}: {e}"
            continue
    log.warning("host/disk tier copies run in Python (same bytes, ~1 us per buffer and page): %s", why)
    return None


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
