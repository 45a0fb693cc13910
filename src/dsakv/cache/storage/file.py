"""`file` storage backend: one file per page on local disk (the disk tier), surviving a restart.

    <dir>/.dsakv-page-key                 the tier's MAC key (64 hex digits, mode 600; made on first use)
    <dir>/<layout_id>/<h[:2]>/<h>.page
    | magic "DSAKVPG4" | layout_id 16 B | h 64 B | payload bytes u64 | word sum u64 | nonce 24 B | tag 16 B | payload |

The payload is the page's buffers in layout order (page_copy's page row); the MAC is base.PageMac's under the
directory's key (a fresh nonce per write; tag: Poly1305 under HMAC-SHA256(key, nonce | identity) over the
payload). Writes go to a temporary file renamed into place, so a crash never leaves a torn page. A read opens
the file non-blocking, refuses anything that is not a regular file of exactly `file_bytes`, checks the header
(identity, size), the payload's word sum and then its MAC over the bytes as loaded into the host segments; a page
that fails is deleted and counted (corrupt_pages / junk_deleted), and reads as a miss. Files of an older format
(another size) are refused as "old format", never read, and deleted at start-up.

Size cap (max_bytes, None = unbounded): the page files of this layout directory never total more than max_bytes;
a write evicts the least recently used files first. A use (write or read) touches a file's mtime, the earlier
pages of a chain last, so a chain loses its deepest pages first; a restart rebuilds the LRU order from mtimes.
Start-up deletes junk (temporaries, files of another size or format, FIFOs and other non-regular files named
like pages); a directory named like a page is skipped and never counted.

With a C compiler a batch read (get) and a batch write (put) are one native call each (cache/native.py
read_pages / write_pages, the GIL released), doing what the Python loops below do, page for page: the same checks
in the same order, the same reason strings and counters, the same files. A read copies each payload from a
read-only mapping of the file straight into the host segments with its word sum added in the same pass
(DSAKV_DISK_READ=preadv: preadv windows instead); a file truncated under the mapping is refused ("the file shrank
while it was read"), not a crash; the MACs are then checked here over the segments (Poly1305 holds the GIL: on
base.MAC_THREADS threads a chunk's MACs overlap the native read of the next), as a write computes them first.
DSAKV_DISK_READ_THREADS / DSAKV_DISK_WRITE_THREADS spread a batch's copies over threads (default 1);
DSAKV_DISK_READ_ADVISE=1 adds a posix_fadvise(WILLNEED) of the next page file during a read (off by default: it
measured slower, warm and cold).
Imports numpy and dsakv.spec/cache.
"""

from __future__ import annotations

import ctypes
import logging
import os
import stat
import time
import uuid
from collections import OrderedDict
from concurrent.futures import Future
from itertools import chain
from pathlib import Path

import numpy as np

from dsakv.cache import native
from dsakv.cache.storage.base import (
    CHECKSUM_MIX,
    MAC_THREADS,
    META,
    META_ID_BYTES,
    META_MAC_AT,
    META_SUM_AT,
    STORAGE_BACKENDS,
    PageLayout,
    ReadResult,
    Segments,
    StorageBackend,
    StorageError,
    directory_key,
    finish_checksum,
    mac_pool,
    mview,
    old_format,
    page_checksum,
)
from dsakv.cache.storage.file_index import FileStoreIndex
from dsakv.config import StorageConfig
from dsakv.errors import ConfigError

log = logging.getLogger(__name__)

_OPEN_READ = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0)
# native read_pages' per-page status codes (native.py)
_PG_MISSING, _PG_OPEN, _PG_NOTREG, _PG_SIZE, _PG_HEADER, _PG_SHORT, _PG_CHECKSUM, _PG_IOERR, _PG_SHRANK = range(1, 10)
READ_THREADS = int(os.environ.get("DSAKV_DISK_READ_THREADS", "1"))  # threads of one batch read (C path)
WRITE_THREADS = int(os.environ.get("DSAKV_DISK_WRITE_THREADS", "1"))  # threads of one batch write (C path)
# > 0: a batch write's payload in windows of this many file bytes, each summed just before it is written (writes
# measured ~10% faster at 256 KiB, but the page cache gets smaller folios and the next read ~15% dearer); 0: the
# checksum first, then record + payload in one pwritev
WRITE_WINDOW = int(os.environ.get("DSAKV_DISK_WRITE_WINDOW", "0"))
READ_MAP = os.environ.get("DSAKV_DISK_READ", "mmap") != "preadv"  # copy from a mapping (one pass) or preadv
# posix_fadvise(WILLNEED) of the next page file while one is read: off, it measured slower warm and cold
READ_ADVISE = os.environ.get("DSAKV_DISK_READ_ADVISE", "0") == "1"
READ_CHUNKS = 8  # with MAC threads, a batch read in this many C calls, each chunk's MACs checked during the next


@STORAGE_BACKENDS.register("file")
class FileStore(FileStoreIndex, StorageBackend):
    """Page files in a directory; the index, eviction and directory figures are in file_index.py."""

    name = "file"
    synchronous = True

    def __init__(self, layout: PageLayout, model_hash: str | None, config: StorageConfig) -> None:
        super().__init__(layout, model_hash, config)
        assert config.dir is not None
        self.dir = Path(config.dir) / self.layout_id
        self.file_bytes = META.size + self.page_bytes  # one page file on disk
        max_bytes = config.max_bytes
        if max_bytes is not None and max_bytes < self.file_bytes:
            raise ConfigError(
                f"disk tier size cap {max_bytes} B cannot hold one page file of {self.file_bytes} B "
                f"({layout.page_size} tokens x {layout.bytes_per_token} B/token + {META.size} B header): "
                f"give at least {self.file_bytes} B, or no cap"
            )
        self.max_bytes = max_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.corrupt_pages = 0  # pages whose header or checksum failed on read (deleted)
        self.junk_deleted = 0  # files that were not page files of this layout (deleted)
        self._last_ns = 0
        self._lru: OrderedDict[str, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._used = 0
        self._rebuild_index()

    def tier_key(self) -> bytes:
        """The directory's key file (base.directory_key): every server sharing the directory shares the key."""
        assert self.config.dir is not None
        root = Path(self.config.dir)
        if root.exists() and not root.is_dir():
            raise ConfigError(f"disk tier directory {root} is not a directory: give a directory (--hicache-disk-dir)")
        root.mkdir(parents=True, exist_ok=True)
        return directory_key(root)

    # ---- data ----------------------------------------------------------------------

    def put(self, hashes: list[str], pages: list[Segments], protect: list[str] | None = None) -> int:
        """Write pages (skipping those already on disk); `protect` (the chain's earlier pages) is never evicted to
        make room. Under the cap, a page that only fits by evicting the chain's own pages is not written, nor are
        the pages after it."""
        if len(pages) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        keep = set(protect or ()) | set(hashes)
        ext = native.lib()
        if ext is not None and all(len(h) == 64 for h in hashes):
            written = self._put_native(ext, hashes, pages, keep)
            if written is not None:
                self.touch(list(protect or ()) + hashes)
                return written
        written = 0
        for h, segs in zip(hashes, pages, strict=True):
            if h in self._lru:
                continue
            if self.max_bytes is not None:
                over = self.used_bytes + self.file_bytes - self.max_bytes
                if over > 0 and self._evict(over, keep) < over:
                    log.debug("disk tier full of this chain's pages: pages not written")
                    break
            p = self.path(h)
            try:
                p.parent.mkdir(exist_ok=True)
                tmp = p.with_name(f".{h}.{uuid.uuid4().hex[:8]}.tmp")
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                try:
                    self._write_one(fd, h, segs, tmp)
                finally:
                    os.close(fd)
                os.replace(tmp, p)
            except OSError as e:
                log.warning("disk tier: cannot write %s (%s)", p, e)
                break
            self._lru[h] = self.file_bytes
            self._used += self.file_bytes
            written += 1
        self.touch(list(protect or ()) + hashes)
        return written

    def _put_native(self, ext: ctypes.CDLL, hashes: list[str], pages: list[Segments], keep: set[str]) -> int | None:
        """put's writes in one C call (native.py's write_pages, the GIL released): the same pages as the Python
        loop (the cap's evictions decided first, page by page, as it does), their MACs computed here into the
        records, then in C each a temporary file written (the word sum, then record + payload in one pwritev;
        WRITE_WINDOW > 0: windows) and renamed into place. Pages written, or None (no directory: the Python
        path)."""
        todo: list[int] = []
        seen: set[str] = set()
        for i, h in enumerate(hashes):
            if h in self._lru or h in seen:
                continue
            if self.max_bytes is not None:
                over = self.used_bytes + (len(todo) + 1) * self.file_bytes - self.max_bytes
                if over > 0 and self._evict(over, keep) < over:
                    log.debug("disk tier full of this chain's pages: pages not written")
                    break
            todo.append(i)
            seen.add(h)
        if not todo:
            return 0
        try:
            dirfd = os.open(self.dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return None
        n = len(todo)
        try:
            tag = uuid.uuid4().hex[:8]
            names = b"".join(f"{hashes[i][:2]}/{hashes[i]}.page\0".encode() for i in todo)
            tmps = b"".join(f"{hashes[i][:2]}/.{hashes[i]}.{tag}.tmp\0".encode() for i in todo)
            macs = self.page_macs([hashes[i] for i in todo], [pages[i] for i in todo])
            heads = bytearray(b"".join(self.meta(hashes[i], 0, m) for i, m in zip(todo, macs, strict=True)))
            counts = [len(pages[i]) for i in todo]
            segoff = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(counts, out=segoff[1:])
            flat = np.fromiter(
                chain.from_iterable(chain.from_iterable(pages[i] for i in todo)), np.int64, 2 * int(segoff[-1])
            )
            err = ctypes.c_int64()
            hb = (ctypes.c_char * len(heads)).from_buffer(heads)
            k = int(
                ext.dsakv_write_pages(
                    dirfd, n, names, len(names) // n, tmps, len(tmps) // n, hb, META_SUM_AT, META.size,
                    self.page_bytes, CHECKSUM_MIX, segoff.ctypes.data, flat.ctypes.data, WRITE_WINDOW, WRITE_THREADS,
                    ctypes.byref(err),
                )
            )  # fmt: skip
        finally:
            os.close(dirfd)
        if k < 0:
            raise StorageError(f"disk tier: native batch write failed: {os.strerror(-k)}")
        for i in todo[:k]:
            self._lru[hashes[i]] = self.file_bytes
            self._used += self.file_bytes
        if k < n:
            e = int(err.value)
            log.warning("disk tier: cannot write %s ([Errno %d] %s)", self.path(hashes[todo[k]]), e, os.strerror(e))
        return k

    def _write_one(self, fd: int, h: str, segs: Segments, tmp: Path) -> None:
        """Page h's file (header + payload) to the new file fd."""
        bufs: list[bytes | memoryview] = [self.meta(h, page_checksum(segs), self.page_macs([h], [segs])[0])]
        bufs += [mview(a, n) for a, n in segs]
        want = sum(len(b) for b in bufs)
        if os.writev(fd, bufs) != want:
            raise OSError(f"short write of {tmp}")

    def get(self, hashes: list[str], pages: list[Segments]) -> ReadResult:
        if len(pages) != len(hashes):
            raise ValueError(f"{len(hashes)} hashes but {len(pages)} pages")
        ext = native.lib()
        res = ReadResult(0)
        if ext is not None and hashes and all(len(h) == 64 for h in hashes):
            done = self._get_native(ext, hashes, pages)
            if done is not None:
                res.n, why = done
                if why:
                    self._refused(hashes[res.n], why, res)
                return res
        for h, segs in zip(hashes, pages, strict=True):
            why = self._read_one(h, segs)
            if why:
                self._refused(h, why, res)
                break
            res.n += 1
        self.touch(hashes[: res.n])
        return res

    def _refused(self, h: str, why: str, res: ReadResult) -> None:
        """Count page `h`, which read as `why` (its file already deleted unless missing), in `res`."""
        self._forget(h)
        res.reason = why
        if why.startswith(("checksum", "MAC")):
            res.corrupt = 1
            self.corrupt_pages += 1
        elif why != "missing":
            res.refused = 1
        else:
            res.missing = 1

    def _get_native(self, ext: ctypes.CDLL, hashes: list[str], pages: list[Segments]) -> tuple[int, str] | None:
        """The whole batch in one C call (native.py's read_pages, the GIL released): per page open, the same checks
        as _read_one (regular file, size, header, word sum) on the payload copied into the segments (from a
        mapping, or preadv), and the LRU stamp of the pages read; then the MAC of each page read, here, over its
        segments (the records come back from C). With MAC threads the batch goes in READ_CHUNKS calls instead,
        each chunk's MACs checked on a MAC thread while C reads the next (the first failure wins, as in one
        call). (pages read and verified, why the next one was not) or None (no directory: the Python path)."""
        n = len(hashes)
        try:
            dirfd = os.open(self.dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            return None
        # with MAC threads, the batch in chunks: chunk i's MACs are checked on them while C reads chunk i + 1
        chunk = n if MAC_THREADS <= 1 else max(1, -(-n // READ_CHUNKS))
        checks: list[Future[int] | int] = []  # per chunk: its first forged page (index in the batch), or n if none
        k = 0

        def first_forged(lo: int, hi: int, tags: list[bytes], threads: int = 0) -> int:
            f = lo + self.first_forged(hashes[lo:hi], pages[lo:hi], tags, threads)
            return f if f < hi else n

        try:
            names = b"".join(f"{h[:2]}/{h}.page\0".encode() for h in hashes)
            expect = b"".join(self.meta(h, 0)[:META_ID_BYTES] for h in hashes)
            name_len, id_len = len(names) // n, META_ID_BYTES
            counts = [len(segs) for segs in pages]
            segoff = np.zeros(n + 1, dtype=np.int64)
            np.cumsum(counts, out=segoff[1:])
            flat = np.fromiter(chain.from_iterable(chain.from_iterable(pages)), np.int64, 2 * int(segoff[-1]))
            now = max(time.time_ns(), self._last_ns + 1)
            stamps = np.array([now + n - 1 - i if h in self._lru else 0 for i, h in enumerate(hashes)], np.int64)
            ok_stamp = np.zeros(n, dtype=np.uint8)
            detail = np.zeros(2, dtype=np.int64)
            heads = np.zeros((n, META.size), dtype=np.uint8)
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                off = np.ascontiguousarray(segoff[lo : hi + 1] - segoff[lo])
                got = int(
                    ext.dsakv_read_pages(
                        dirfd, hi - lo, names[lo * name_len : hi * name_len], name_len,
                        expect[lo * id_len : hi * id_len], META_ID_BYTES, META.size, self.file_bytes, CHECKSUM_MIX,
                        off.ctypes.data, flat[2 * int(segoff[lo]) :].ctypes.data, int(READ_ADVISE), int(READ_MAP),
                        READ_THREADS, stamps[lo:hi].ctypes.data, ok_stamp[lo:hi].ctypes.data, detail.ctypes.data,
                        heads[lo:hi].ctypes.data,
                    )
                )  # fmt: skip
                if got < 0:
                    raise StorageError(f"disk tier: native batch read failed: {os.strerror(-got)}")
                k = lo + got
                if got:
                    tags = [bytes(heads[i, META_MAC_AT:]) for i in range(lo, k)]
                    if chunk == n:
                        checks.append(first_forged(lo, k, tags))
                    else:  # one thread a chunk (a task on the pool must not wait on the pool), MAC_THREADS at once
                        busy = [c for c in checks if isinstance(c, Future) and not c.done()]
                        if len(busy) >= MAC_THREADS:
                            busy[0].result()
                        checks.append(mac_pool().submit(first_forged, lo, k, tags, 1))
                if got < hi - lo or any(isinstance(c, Future) and c.done() and c.result() < n for c in checks):
                    break
        finally:
            os.close(dirfd)
            forged = [c if isinstance(c, int) else c.result() for c in checks]  # every MAC task done, even on error
        if k:
            self._last_ns = max(self._last_ns, now + n - 1)
        for i in range(k - 1, -1, -1):  # the LRU order touch() gives: the chain's first page most recent
            h = hashes[i]
            if h in self._lru:
                self._lru.move_to_end(h)
                if not ok_stamp[i]:
                    self._forget(h)
        good = min([k, *forged])  # the first page whose word sum held but its MAC did not (k: none)
        if good < k:
            self._junk(self.path(hashes[good]), "MAC mismatch")
            return good, "MAC mismatch"
        if k == n:
            return n, ""
        status, aux = int(detail[0]), int(detail[1])
        why = {
            _PG_MISSING: "missing",
            _PG_OPEN: f"cannot open: {os.strerror(aux)}",
            _PG_NOTREG: "not a regular file",
            _PG_SIZE: old_format(aux, self.page_bytes) or f"size {aux} B, not {self.file_bytes}",
            _PG_SHORT: f"short read ({aux} of {self.page_bytes} B)",
            _PG_CHECKSUM: "checksum mismatch",
            _PG_IOERR: f"read error: {os.strerror(aux)}",
            _PG_SHRANK: "read error: the file shrank while it was read",
        }.get(status)
        if status == _PG_HEADER:
            why = self.check_meta(hashes[k], heads[k, :aux])[0] or "header mismatch"
        if why is None:
            raise StorageError(f"disk tier: native batch read returned status {status} for page {k}")
        if why != "missing":
            self._junk(self.path(hashes[k]), why)
        return k, why

    def _read_one(self, h: str, segs: Segments) -> str:
        p = self.path(h)
        try:
            fd = os.open(p, _OPEN_READ)
        except FileNotFoundError:
            return "missing"
        except OSError as e:  # a symlink (O_NOFOLLOW), a directory opened for writing, permissions
            why = f"cannot open: {e.strerror}"
            self._junk(p, why)
            return why
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                why = "not a regular file"
            elif st.st_size != self.file_bytes:
                why = old_format(st.st_size, self.page_bytes) or f"size {st.st_size} B, not {self.file_bytes}"
            else:
                head = os.read(fd, META.size)
                why, checksum, tag = self.check_meta(h, head)
                if not why:
                    ext = native.lib()
                    if ext is not None:  # preadv into the segments + the checksum's word sum, in C
                        word_sum = ctypes.c_uint64()
                        got = ext.dsakv_read_sum(fd, META.size, len(segs), native.seg_table(segs), word_sum)
                        if got < 0:
                            raise OSError(-got, os.strerror(-got))
                        actual = finish_checksum(word_sum.value, self.page_bytes)
                    else:
                        got = os.readv(fd, [mview(a, n) for a, n in segs])
                        actual = page_checksum(segs) if got == self.page_bytes else 0
                    if got != self.page_bytes:
                        why = f"short read ({got} of {self.page_bytes} B)"
                    elif actual != checksum:
                        why = "checksum mismatch"
                    elif self.first_forged([h], [segs], [tag]) == 0:
                        why = "MAC mismatch"
        except OSError as e:
            why = f"read error: {e.strerror}"
        finally:
            os.close(fd)
        if why:
            self._junk(p, why)
        return why

    def describe(self) -> str:
        cap = f", cap {self.max_bytes} B" if self.max_bytes is not None else ""
        return f"file {self.dir}{cap}"
