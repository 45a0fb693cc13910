"""The storage (L3) tier's contract: backends that keep whole KV pages outside the process, chosen by name.

    STORAGE_BACKENDS.get("mooncake")(layout, model_hash, StorageConfig(backend="mooncake", master="127.0.0.1:50051"))

Identity: a page is named by the chained hash of every token up to its end, seeded with the layout identity
(checkpoint fingerprint, model shape, layer range, draft layers, elision, formats, page size, buffer keys):

    h[-1] = layout_id            h[i] = sha256(h[i-1] || int64 tokens of page i)

so another model, layout or weights can never name the same page. What a page holds is exactly the layout's
buffers (INDEX_K only for producer layers): `layout.bytes_per_page` payload bytes, the planner's figure.

Memory: a backend reads and writes pages in place, from/to host memory given as one (address, bytes) segment
per buffer in layout order (`Segments`), e.g. a HostPool's pages, registered once with `register()`; nothing
is staged through Python bytes.

Integrity: every stored page carries a 64-bit checksum of its payload (`page_checksum`) and its identity
(layout_id, hash, payload size); a read that fails any of them is dropped and counted, never loaded.

A page is stored only when every object it needs is present (`count_present` checks them all), so a partially
written page is never a hit. Failures (a dead master, an I/O error) raise StorageError; the caller computes
instead. Imports numpy, dsakv.spec and dsakv.cache.native only; must not import torch, model or engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import numpy.typing as npt

from dsakv.cache import native
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.util import Registry

Segments = list[tuple[int, int]]  # one page: (address, bytes) per buffer, layout order

META = struct.Struct("<8s16s64sQQ")  # magic, layout_id, page hash, payload bytes, checksum
META_MAGIC = b"DSAKVPG2"


class StorageError(RuntimeError):
    """A storage operation failed (the store is down, an I/O error): the caller treats the pages as a miss."""


@dataclass(frozen=True)
class StorageConfig:
    """Options of a storage backend. `backend` names it in STORAGE_BACKENDS."""

    backend: str = "file"
    dir: str | None = None  # file: the directory
    max_bytes: int | None = None  # file: cap on page files (LRU eviction); None = unbounded
    master: str | None = None  # mooncake: master address HOST:PORT
    metadata: str | None = None  # mooncake: metadata server URL (default http://HOST:PORT+1/metadata)
    segment_bytes: int = 0  # mooncake: memory this instance adds to the store (0: objects live elsewhere)
    local_buffer_bytes: int = 16 << 20  # mooncake: the client's own transfer buffer
    protocol: str = "tcp"  # mooncake: tcp | rdma
    device_names: str = ""  # mooncake: RDMA devices
    local_hostname: str = "127.0.0.1"  # mooncake: the address this client's transfer engine listens on
    timeout: float = 2.0  # seconds one store operation may take before the request computes instead
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.timeout > 0 or self.timeout != self.timeout or self.timeout == float("inf"):
            raise ConfigError(f"storage timeout = {self.timeout} s must be a finite number > 0")
        if self.backend == "file" and not self.dir:
            raise ConfigError("storage backend 'file' needs a directory (--hicache-disk-dir DIR)")
        if self.backend == "mooncake" and not self.master:
            raise ConfigError(
                "storage backend 'mooncake' needs a master address (--mooncake-master HOST:PORT); "
                "start one with `dsakv store-master`"
            )
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(f"storage size cap = {self.max_bytes} bytes must be > 0 (or no cap)")
        if self.segment_bytes < 0 or self.local_buffer_bytes < 0:
            raise ConfigError(
                f"mooncake segment {self.segment_bytes} B / local buffer {self.local_buffer_bytes} B must be >= 0"
            )


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


def chain_hashes(layout_id: str, tokens: npt.ArrayLike, page_size: int, num_pages: int | None = None) -> list[str]:
    """The chained hash of each of the first `num_pages` whole pages of `tokens` (64 hex chars each)."""
    toks = np.asarray(tokens, dtype=np.int64).reshape(-1)
    n = toks.size // page_size if num_pages is None else min(num_pages, toks.size // page_size)
    out, h = [], layout_id.encode()
    for i in range(n):
        h = hashlib.sha256(h + toks[i * page_size : (i + 1) * page_size].tobytes()).hexdigest().encode()
        out.append(h.decode())
    return out


def view(ptr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """A writable numpy view of `nbytes` of host memory at `ptr` (no copy)."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


def mview(ptr: int, nbytes: int) -> memoryview:
    """A writable byte memoryview of `nbytes` of host memory at `ptr` (for readv / writev)."""
    return memoryview((ctypes.c_uint8 * nbytes).from_address(ptr)).cast("B")


CHECKSUM_MIX = _MIX = 0x9E3779B97F4A7C15  # the size mix of page_checksum (native read_pages uses it)


def finish_checksum(word_sum: int, nbytes: int) -> int:
    """page_checksum from the wrapping word sum of `nbytes` payload bytes (what native's read_sum returns)."""
    return (word_sum ^ (nbytes * _MIX)) & 0xFFFFFFFFFFFFFFFF


def page_checksum(segs: Segments) -> int:
    """64-bit checksum of a page's payload (its segments laid end to end): the wrapping sum of its little-endian
    8-byte words, mixed with the size. Any flipped bit or overwritten word changes it; it is one pass over memory
    (~9 GB/s), not a MAC. The same bytes give the same value whatever the host layout's segmentation."""
    nbytes = sum(n for _, n in segs)
    ext = native.lib()
    if ext is not None:  # the same sum in C (cache/native.py)
        return finish_checksum(int(ext.dsakv_sum64(len(segs), native.seg_table(segs))), nbytes)
    total = 0
    if all(n % 8 == 0 for _, n in segs[:-1]):  # adjacent segments (a page_first page) summed as one region
        merged: Segments = []
        for p, n in segs:
            if merged and merged[-1][0] + merged[-1][1] == p:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((p, n))
        segs = merged
    if any(n % 8 for _, n in segs[:-1]):  # an unaligned split: checksum a contiguous copy
        buf = np.concatenate([view(p, n) for p, n in segs]) if segs else np.zeros(0, np.uint8)
        segs_v = [buf]
    else:
        segs_v = [view(p, n) for p, n in segs]
    for v in segs_v:
        full = v.size - v.size % 8
        if full:
            total += int(np.add.reduce(v[:full].view(np.uint64)))
        if full < v.size:
            tail = np.zeros(8, np.uint8)
            tail[: v.size - full] = v[full:]
            total += int(tail.view(np.uint64)[0])
    return (total ^ (nbytes * _MIX)) & 0xFFFFFFFFFFFFFFFF


@dataclass
class ReadResult:
    """A batch read: pages[:n] are intact; if n < asked, `reason` says why the next one was not loaded."""

    n: int
    corrupt: int = 0  # a page that failed its checksum (dropped)
    refused: int = 0  # an object of another identity or size (never loaded)
    missing: int = 0  # gone between the existence query and the read
    reason: str = ""


class StorageBackend:
    """Base class. Subclasses register in STORAGE_BACKENDS under `name`.

    Contract:
      count_present(hashes)   how many of `hashes`, from the first, are stored whole (every object present)
      put(hashes, pages)      store pages (segments in host memory, valid until put returns); pages written
      get(hashes, pages)      read into the segments; a ReadResult whose first n pages are verified
      touch(hashes)           mark a used chain (LRU), the first page most recent
    `synchronous` backends are called inline (local files); others through a thread with a deadline."""

    name: ClassVar[str] = ""
    synchronous: ClassVar[bool] = True
    needs_registration: ClassVar[bool] = False  # pages must live in memory given to register()

    def __init__(self, layout: KVLayout, model_hash: str | None, config: StorageConfig) -> None:
        self.layout = layout
        self.config = config
        self.model_hash = model_hash
        self.layout_id = layout_identity(layout, model_hash)
        self.page_bytes = layout.bytes_per_page
        self.evicted_pages = 0
        self.evicted_bytes = 0

    def page_hashes(self, tokens: npt.ArrayLike, num_pages: int | None = None) -> list[str]:
        return chain_hashes(self.layout_id, tokens, self.layout.page_size, num_pages)

    def meta(self, h: str, checksum: int) -> bytes:
        return META.pack(META_MAGIC, self.layout_id.encode(), h.encode(), self.page_bytes, checksum)

    def check_meta(self, h: str, raw: bytes | npt.NDArray[np.uint8]) -> tuple[str, int]:
        """("", checksum) if `raw` is this layout's record for page `h`, else (why, 0)."""
        b = bytes(raw)
        if len(b) != META.size:
            return f"record of {len(b)} B, not {META.size}", 0
        magic, lid, hh, nbytes, checksum = META.unpack(b)
        if magic != META_MAGIC:
            return f"bad magic {magic!r}", 0
        if lid != self.layout_id.encode() or hh != h.encode():
            return f"identity {lid.decode(errors='replace')}/{hh[:12].decode(errors='replace')} is not this page's", 0
        if nbytes != self.page_bytes:
            return f"payload of {nbytes} B, this layout's pages are {self.page_bytes} B", 0
        return "", int(checksum)

    def register(self, ptr: int, nbytes: int) -> None:
        """Host memory that page segments will live in (zero-copy backends register it with their engine)."""

    def count_present(self, hashes: list[str]) -> int:
        raise NotImplementedError

    def put(self, hashes: list[str], pages: list[Segments]) -> int:
        raise NotImplementedError

    def get(self, hashes: list[str], pages: list[Segments]) -> ReadResult:
        raise NotImplementedError

    def touch(self, hashes: list[str]) -> None:
        """Mark a used chain (the first page most recent); a no-op where the store keeps its own order."""

    def contains(self, h: str) -> bool:
        """A local, cheap 'known stored' answer (False when unsure: the caller then asks count_present)."""
        return False

    def describe(self) -> str:
        return self.name

    def close(self) -> None:
        """Release connections and registrations."""


STORAGE_BACKENDS: Registry[Callable[[KVLayout, str | None, StorageConfig], StorageBackend]] = Registry(
    "storage backend", flag="--hicache-storage"
)
