"""DiskTier: a third cache tier on local disk that survives a restart. Off unless a directory is given.

One file per page, named by a chained hash of every token up to and including
that page, seeded with the layout identity (checkpoint hash, model shape, layer
range, formats, page size, elision, buffer keys), so a different model or
layout can never read another's pages:

    h[-1] = layout_id            h[i] = sha256(h[i-1] || int64 tokens of page i)
    <dir>/<layout_id>/<h[i][:2]>/<h[i]>.page

File: | magic "DSAKVPG1" | layout_id (16 B ascii) | h[i] (64 B ascii) | payload bytes (u64 LE) | page row |
The page row is page_copy's format (every buffer of the page, layout order).
Writes go to a temporary file renamed into place, so a crash never leaves a torn page;
a file that fails its header check is deleted and read as a miss.

Size cap (max_bytes, None = unbounded): the page files of this layout directory (header + payload each,
`file_bytes`) never total more than max_bytes; a write evicts the least recently used files first. A use
(write or read) touches a file's mtime, the earlier pages of a chain last, so a chain loses its deepest pages
first (a prefix stays readable); a restarted tier rebuilds its LRU order from the files' mtimes.
Imports torch, numpy and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import time
import uuid
from collections import OrderedDict
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout

log = logging.getLogger(__name__)

MAGIC = b"DSAKVPG1"
_HEADER = struct.Struct("<8s16s64sQ")


def layout_identity(layout: KVLayout, model_hash: str | None = None) -> str:
    """16 hex chars naming everything that shapes a cached page: checkpoint, model shape, layers, formats, keys."""
    ident = {
        "model_hash": model_hash or "",
        "spec": layout.spec.identity_hash(),
        "layers": [layout.layer_start, layout.end],
        "draft_layers": layout.draft_layers,
        "elide": layout.elide,
        "kv_format": layout.kv_format,
        "index_format": layout.index_format,
        "page_size": layout.page_size,
        "keys": [[b.key.layer, b.key.kind.value, b.page_bytes] for b in layout.buffers],
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


class DiskTier:
    def __init__(
        self, root: str | Path, layout: KVLayout, model_hash: str | None = None, max_bytes: int | None = None
    ) -> None:
        self.layout = layout
        self.layout_id = layout_identity(layout, model_hash)
        self.dir = Path(root) / self.layout_id
        self.page_bytes = layout.bytes_per_page
        self.file_bytes = _HEADER.size + self.page_bytes  # one page file on disk
        if max_bytes is not None and max_bytes < self.file_bytes:
            raise ConfigError(
                f"disk tier size cap {max_bytes} B cannot hold one page file of {self.file_bytes} B "
                f"({layout.page_size} tokens x {layout.bytes_per_token} B/token + {_HEADER.size} B header): "
                f"give at least {self.file_bytes} B, or no cap"
            )
        self.max_bytes = max_bytes
        self.dir.mkdir(parents=True, exist_ok=True)
        self.evicted_pages = 0  # page files deleted to stay under max_bytes
        self.evicted_bytes = 0
        self._last_ns = 0
        self._lru: OrderedDict[str, int] = OrderedDict()  # hash -> file bytes, least recently used first
        self._used = 0  # sum of self._lru's values
        self._rebuild_index()

    # ---- index ---------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Index the page files already on disk, oldest mtime first; drop leftover temporary files."""
        found: list[tuple[int, str, int]] = []
        for p in self.dir.glob("*/.*.tmp"):
            p.unlink(missing_ok=True)
        for p in self.dir.glob("*/*.page"):
            try:
                st = p.stat()
            except OSError:
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
        """Mark `h` most recently used, in memory and in its mtime (strictly increasing, for a restart)."""
        self._lru.move_to_end(h)
        self._last_ns = max(time.time_ns(), self._last_ns + 1)
        try:
            os.utime(self.path(h), ns=(self._last_ns, self._last_ns))
        except OSError:
            self._forget(h)

    def touch(self, hashes: list[str]) -> None:
        """Mark a used chain of pages: the first page ends most recent, so the deepest page is evicted first."""
        for h in reversed(hashes):
            if h in self._lru:
                self._stamp(h)

    def _evict(self, nbytes: int, protect: set[str]) -> int:
        """Delete least recently used page files (never one in `protect`) until `nbytes` are freed; bytes freed."""
        freed = 0
        for h in list(self._lru):
            if freed >= nbytes:
                break
            if h in protect:
                continue
            size = self._lru[h]
            self._forget(h)
            self.path(h).unlink(missing_ok=True)
            freed += size
            self.evicted_pages += 1
            self.evicted_bytes += size
        if freed:
            log.debug("disk tier: evicted %d B to stay under %d B", freed, self.max_bytes)
        return freed

    def page_hashes(self, tokens: npt.ArrayLike, num_pages: int | None = None) -> list[str]:
        """The chained hash of each of the first `num_pages` whole pages of `tokens`."""
        toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
        ps = self.layout.page_size
        n = toks.size // ps if num_pages is None else min(num_pages, toks.size // ps)
        out, h = [], self.layout_id.encode()
        for i in range(n):
            h = hashlib.sha256(h + toks[i * ps : (i + 1) * ps].tobytes()).hexdigest().encode()
            out.append(h.decode())
        return out

    def path(self, h: str) -> Path:
        return self.dir / h[:2] / f"{h}.page"

    def contains(self, h: str) -> bool:
        return h in self._lru

    def count_present(self, hashes: list[str]) -> int:
        """How many of `hashes`, from the first, have a page on disk (stops at the first miss)."""
        for i, h in enumerate(hashes):
            if not self.contains(h):
                return i
        return len(hashes)

    def write(self, hashes: list[str], rows: torch.Tensor, protect: list[str] | None = None) -> int:
        """Persist page rows [len(hashes), bytes_per_page] (skipping pages already on disk); returns pages written.

        `hashes` is a run of one chain, in order; `protect` (the chain's earlier pages) is never evicted to make
        room. Under the cap, a page that only fits by evicting the chain's own pages is not written, nor are the
        pages after it."""
        if rows.shape != (len(hashes), self.page_bytes):
            raise ValueError(f"{len(hashes)} hashes but page rows of shape {tuple(rows.shape)}")
        data = rows.to("cpu").contiguous().numpy()
        keep = set(protect or ()) | set(hashes)
        written = 0
        for i, h in enumerate(hashes):
            p = self.path(h)
            if h in self._lru:
                continue
            if self.max_bytes is not None:
                over = self.used_bytes + self.file_bytes - self.max_bytes
                if over > 0 and self._evict(over, keep) < over:
                    log.debug("disk tier full of this chain's pages: %d pages not written", len(hashes) - i)
                    break
            p.parent.mkdir(exist_ok=True)
            tmp = p.with_name(f".{h}.{uuid.uuid4().hex[:8]}.tmp")
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, self.layout_id.encode(), h.encode(), self.page_bytes))
                f.write(data[i].tobytes())
            os.replace(tmp, p)
            self._lru[h] = self.file_bytes
            self._used += self.file_bytes
            written += 1
        self.touch(list(protect or ()) + hashes)
        return written

    def read(self, hashes: list[str]) -> torch.Tensor:
        """Page rows for the longest run of `hashes`, from the first, that read back intact: uint8 [n, page_bytes]."""
        out = np.empty((len(hashes), self.page_bytes), dtype=np.uint8)
        n = 0
        for h in hashes:
            if not self._read_one(h, out[n]):
                self._forget(h)
                break
            n += 1
        self.touch(hashes[:n])
        return torch.from_numpy(out[:n])

    def _read_one(self, h: str, dst: npt.NDArray[np.uint8]) -> bool:
        p = self.path(h)
        try:
            with open(p, "rb") as f:
                head = f.read(_HEADER.size)
                payload = f.read(self.page_bytes + 1)
        except OSError:
            return False
        ok = len(head) == _HEADER.size and len(payload) == self.page_bytes
        if ok:
            magic, lid, hh, nbytes = _HEADER.unpack(head)
            ok = magic == MAGIC and lid == self.layout_id.encode() and hh == h.encode() and nbytes == self.page_bytes
        if not ok:
            log.warning("disk tier: %s is corrupt or truncated; deleting it and reading a miss", p)
            p.unlink(missing_ok=True)
            return False
        dst[:] = np.frombuffer(payload, dtype=np.uint8)
        return True

    def num_pages(self) -> int:
        """Page files on disk (counted from the directory, not the index)."""
        return sum(1 for _ in self.dir.glob("*/*.page"))

    def disk_bytes(self) -> int:
        """Bytes of the page files on disk (from the directory, not the index)."""
        return sum(p.stat().st_size for p in self.dir.glob("*/*.page"))
