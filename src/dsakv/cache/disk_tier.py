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
Imports torch, numpy and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import uuid
from pathlib import Path

import numpy as np
import numpy.typing as npt
import torch

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
    def __init__(self, root: str | Path, layout: KVLayout, model_hash: str | None = None) -> None:
        self.layout = layout
        self.layout_id = layout_identity(layout, model_hash)
        self.dir = Path(root) / self.layout_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.page_bytes = layout.bytes_per_page

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
        return self.path(h).is_file()

    def count_present(self, hashes: list[str]) -> int:
        """How many of `hashes`, from the first, have a page on disk (stops at the first miss)."""
        for i, h in enumerate(hashes):
            if not self.contains(h):
                return i
        return len(hashes)

    def write(self, hashes: list[str], rows: torch.Tensor) -> int:
        """Persist page rows [len(hashes), bytes_per_page] (skipping pages already on disk); returns pages written."""
        if rows.shape != (len(hashes), self.page_bytes):
            raise ValueError(f"{len(hashes)} hashes but page rows of shape {tuple(rows.shape)}")
        data = rows.to("cpu").contiguous().numpy()
        written = 0
        for i, h in enumerate(hashes):
            p = self.path(h)
            if p.is_file():
                continue
            p.parent.mkdir(exist_ok=True)
            tmp = p.with_name(f".{h}.{uuid.uuid4().hex[:8]}.tmp")
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(MAGIC, self.layout_id.encode(), h.encode(), self.page_bytes))
                f.write(data[i].tobytes())
            os.replace(tmp, p)
            written += 1
        return written

    def read(self, hashes: list[str]) -> torch.Tensor:
        """Page rows for the longest run of `hashes`, from the first, that read back intact: uint8 [n, page_bytes]."""
        out = np.empty((len(hashes), self.page_bytes), dtype=np.uint8)
        n = 0
        for h in hashes:
            if not self._read_one(h, out[n]):
                break
            n += 1
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
        return sum(1 for _ in self.dir.glob("*/*.page"))
