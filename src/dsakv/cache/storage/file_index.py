"""The disk tier's page-file index (a mixin of storage.file.FileStore): the LRU book of the page files in the
directory (rebuilt from it at start, junk deleted), the size cap's eviction, and the directory's figures."""

from __future__ import annotations

import logging
import os
import stat
import time
from collections import OrderedDict
from pathlib import Path

from dsakv.cache.storage.base import old_format

log = logging.getLogger("dsakv.cache.storage.file")


class FileStoreIndex:
    """Needs (set by FileStore.__init__ and StorageBackend.__init__) the attributes below."""

    dir: Path
    file_bytes: int
    page_bytes: int
    max_bytes: int | None
    junk_deleted: int
    evicted_pages: int
    evicted_bytes: int
    _last_ns: int
    _lru: OrderedDict[str, int]
    _used: int

    # ---- index ---------------------------------------------------------------------

    def _unlink(self, p: Path) -> bool:
        try:
            p.unlink(missing_ok=True)
            return True
        except OSError as e:  # a directory, a permission problem: never fatal
            log.warning("disk tier: cannot delete %s (%s)", p, e)
            return False

    def _rebuild_index(self) -> None:
        """Index the page files already on disk, oldest mtime first; delete junk."""
        found: list[tuple[int, str, int]] = []
        for p in self.dir.glob("*/.*.tmp"):
            if self._unlink(p):
                self.junk_deleted += 1
        for p in self.dir.glob("*/*.page"):
            try:
                st = p.lstat()
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode):
                log.warning("disk tier: %s is a directory, not a page file: skipped", p)
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size != self.file_bytes or len(p.stem) != 64:
                old = old_format(st.st_size, self.page_bytes) if stat.S_ISREG(st.st_mode) else ""
                what = f"of an {old}" if old else "not a page file of this layout"
                log.warning("disk tier: %s is %s (%d B): deleted", p, what, st.st_size)
                if self._unlink(p):
                    self.junk_deleted += 1
                continue
            found.append((st.st_mtime_ns, p.stem, st.st_size))
        found.sort()
        for mtime, h, size in found:
            self._lru[h] = size
            self._used += size
            self._last_ns = max(self._last_ns, mtime)
        if found:
            log.info("disk tier %s: %d pages, %d B on disk", self.dir, len(found), self.used_bytes)
        if self.max_bytes is not None and self.used_bytes > self.max_bytes:
            self._evict(self.used_bytes - self.max_bytes, protect=set())

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed page files (what the cap limits)."""
        return self._used

    def _forget(self, h: str) -> None:
        self._used -= self._lru.pop(h, 0)

    def _stamp(self, h: str) -> None:
        self._lru.move_to_end(h)
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(self.path(h), ns=(self._last_ns, self._last_ns), follow_symlinks=False)
        except OSError:
            self._forget(h)

    def touch(self, hashes: list[str]) -> None:
        for h in reversed(hashes):
            if h in self._lru:
                self._stamp(h)

    def _evict(self, nbytes: int, protect: set[str]) -> int:
        freed = 0
        for h in list(self._lru):
            if freed >= nbytes:
                break
            if h in protect:
                continue
            size = self._lru[h]
            self._forget(h)
            self._unlink(self.path(h))
            freed += size
            self.evicted_pages += 1
            self.evicted_bytes += size
        if freed:
            log.debug("disk tier: evicted %d B to stay under %s B", freed, self.max_bytes)
        return freed

    def path(self, h: str) -> Path:
        return self.dir / h[:2] / f"{h}.page"

    def contains(self, h: str) -> bool:
        return h in self._lru

    def count_present(self, hashes: list[str]) -> int:
        for i, h in enumerate(hashes):
            if not self.contains(h):
                return i
        return len(hashes)

    def _junk(self, p: Path, why: str) -> None:
        log.warning("disk tier: %s is corrupt or not a page file (%s); deleting it and reading a miss", p, why)
        if not p.is_dir() and self._unlink(p):
            self.junk_deleted += 1

    # ---- directory figures ------------------------------------------------------------

    def num_pages(self) -> int:
        """Page files on disk (counted from the directory, not the index)."""
        return sum(1 for p in self.dir.glob("*/*.page") if p.is_file())

    def disk_bytes(self) -> int:
        """Bytes of the page files on disk (from the directory, not the index)."""
        return sum(p.stat().st_size for p in self.dir.glob("*/*.page") if p.is_file())
