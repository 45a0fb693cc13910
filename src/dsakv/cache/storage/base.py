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

Integrity: every stored page carries a record (`META`, format "DSAKVPG4", 144 B): its identity (layout_id,
hash, payload size), a 64-bit word sum of the payload (`page_checksum`: a cheap pass that catches random damage,
fused into the native copy; not a MAC) and a keyed MAC (`PageMac`, Wegman-Carter): a fresh random nonce per write
and the tag Poly1305(HMAC-SHA256(tier key, domain | nonce | identity), payload): a swapped word, compensating
flips, or an object forged with a recomputed word sum all fail it. A read that fails any check is dropped and
counted, never loaded; a record of an older format (v1-v3; DSAKVPG3: 136 B, an HMAC-SHA256 of the whole
payload) is refused as "old format", never read. Keys (`tier_key`): the shared tier (mooncake) derives its key
from the deployment's secret (--hicache-storage-secret-file, else --cluster-secret-file /
$DSAKV_CLUSTER_SECRET_FILE); the local disk tier keeps a random key in its directory (`.dsakv-page-key`, created
mode 600, readable by the servers' user only), so every server sharing the directory shares it, and a page file
written by anyone else is refused.

A page is stored only when every object it needs is present (`count_present` checks them all), so a partially
written page is never a hit. Failures (a dead master, an I/O error) raise StorageError; the caller computes
instead. Imports numpy, cryptography (Poly1305), dsakv.spec, dsakv.util and dsakv.cache.native only; must not
import torch, model or engine.
"""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import stat
import struct
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Protocol

import numpy as np
import numpy.typing as npt
from cryptography.hazmat.primitives.poly1305 import Poly1305

from dsakv.cache import native
from dsakv.config import StorageConfig
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.util import Registry
from dsakv.util.secret import SECRET_ENV, load_secret

Segments = list[tuple[int, int]]  # one page: (address, bytes) per buffer, layout order


class StoredLayout(Protocol):
    """A page layout other than KVLayout (cache/v4_storage's DeepSeek-V4 pages and boundary states): what the
    tier reads of it. `identity()` names every buffer it holds (it seeds the page hashes)."""

    @property
    def page_size(self) -> int: ...

    @property
    def bytes_per_page(self) -> int: ...

    @property
    def bytes_per_token(self) -> object: ...

    def identity(self) -> dict[str, object]: ...


PageLayout = KVLayout | StoredLayout  # what a backend stores pages of

# magic, layout_id, page hash, payload bytes | word sum (page_checksum) | MAC (PageMac): nonce 24 B, tag 16 B: 144 B
META = struct.Struct("<8s16s64sQQ40s")
META_MAGIC = b"DSAKVPG4"
META_ID_BYTES = 96  # the identity prefix (magic .. payload bytes): known before a read, compared as bytes
META_SUM_AT = 96  # the word sum's offset (what the native read and write loops check and fill in)
META_MAC_AT = 104  # the MAC's offset: its nonce, then its tag
NONCE_BYTES = 24  # random per write (os.urandom): a one-time key is never reused, even by a rewrite of one page
TAG_BYTES = 16  # Poly1305
MAC_BYTES = NONCE_BYTES + TAG_BYTES
# older records (magic: record bytes): refused, never read (v3: HMAC-SHA256 over the payload, 136 B)
OLD_FORMATS = {b"DSAKVPG1": 96, b"DSAKVPG2": 104, b"DSAKVPG3": 136}
MAC_DOMAIN = b"dsakv-page-mac-v4\0"
KEY_FILE = ".dsakv-page-key"  # the disk tier's key, in its directory


def _mac_threads() -> int:
    """Threads that MAC one batch's pages: $DSAKV_PAGE_MAC_THREADS, default min(2, cores). Poly1305 holds the GIL
    while it hashes, so a second thread only overlaps the native read (which releases it) with one page's MAC,
    never two MACs (bench/results/hicache.txt: 2 threads vs 1 at load ~7 on 2 cores)."""
    raw = os.environ.get("DSAKV_PAGE_MAC_THREADS", "").strip()
    if not raw:
        return min(2, os.cpu_count() or 1)
    if not raw.isdigit() or not 1 <= int(raw) <= 16:
        raise ConfigError(f"DSAKV_PAGE_MAC_THREADS={raw!r} must be a whole number of threads in 1..16 (or unset)")
    return int(raw)


MAC_THREADS = _mac_threads()
_mac_pool: tuple[int, ThreadPoolExecutor] | None = None  # (pid, pool) shared by every tier of the process
_mac_lock = threading.Lock()


class StorageError(RuntimeError):
    """A storage operation failed (the store is down, an I/O error): the caller treats the pages as a miss."""


def layout_identity(layout: PageLayout, model_hash: str | None = None) -> str:
    """16 hex chars naming everything that shapes a cached page: checkpoint, model shape, layers, formats, keys."""
    if not isinstance(layout, KVLayout):
        stored = {"model_hash": model_hash or "", **layout.identity()}
        return hashlib.sha256(json.dumps(stored, sort_keys=True).encode()).hexdigest()[:16]
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


def old_format(size_or_magic: int | bytes, payload_bytes: int) -> str:
    """The refusal "old format (MAGIC)" when a record's magic, or a page file's size, is an older format's, else ""."""
    for magic, rec in OLD_FORMATS.items():
        if size_or_magic == magic or size_or_magic == rec + payload_bytes:
            return f"old format ({magic.decode()})"
    return ""


def mac_pool() -> ThreadPoolExecutor:
    """The process's MAC threads (16 at most; a forked child makes its own: threads do not survive a fork). A
    task on it must not wait on another task on it."""
    global _mac_pool
    with _mac_lock:
        if _mac_pool is None or _mac_pool[0] != os.getpid():
            _mac_pool = (os.getpid(), ThreadPoolExecutor(max_workers=16, thread_name_prefix="dsakv-page-mac"))
        return _mac_pool[1]


class PageMac:
    """The keyed MAC of stored pages, Wegman-Carter style: per write a fresh random nonce (NONCE_BYTES, stored in
    the record), the one-time key k = HMAC-SHA256(key, MAC_DOMAIN | nonce | layout_id | h | u64 payload bytes)
    (a short input: cheap), and the tag Poly1305(k, payload), the payload being the page's segments laid end to
    end (the same bytes whatever the host layout), streamed into Poly1305 segment by segment. A seal is
    nonce | tag (MAC_BYTES). Poly1305 is `cryptography`'s (OpenSSL, ~4.4 GB/s a core here vs ~1.4 for
    HMAC-SHA256); its update holds the GIL, so `tags` over `threads` threads (default MAC_THREADS) can overlap
    other work (a native read that releases the GIL), never hash in parallel."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError(f"a page MAC key needs at least 16 bytes, got {len(key)}")
        self._base = hmac.new(key, MAC_DOMAIN, "sha256")
        self.key_id = hmac.new(key, b"dsakv-page-key-id-v1", "sha256").hexdigest()[:8]  # names the key, not it

    def one_time_key(self, layout_id: str, h: str, nonce: bytes, nbytes: int) -> bytes:
        """The Poly1305 key of one write: HMAC-SHA256(key, MAC_DOMAIN | nonce | layout_id | h | u64 nbytes)."""
        if len(nonce) != NONCE_BYTES:
            raise ValueError(f"a page MAC nonce is {NONCE_BYTES} bytes, got {len(nonce)}")
        m = self._base.copy()
        m.update(nonce + layout_id.encode() + h.encode() + struct.pack("<Q", nbytes))
        return m.digest()

    def tag(self, layout_id: str, h: str, nonce: bytes, segs: Segments) -> bytes:
        """The page's Poly1305 tag (TAG_BYTES) under the one-time key of `nonce`."""
        p = Poly1305(self.one_time_key(layout_id, h, nonce, sum(n for _, n in segs)))
        run_at, run = 0, 0  # adjacent segments (a page_first page) in one update: fewer calls, the same bytes
        for a, n in segs:
            if run and a == run_at + run:
                run += n
                continue
            if run:
                p.update(mview(run_at, run))
            run_at, run = a, n
        if run:
            p.update(mview(run_at, run))
        return p.finalize()

    def tags(
        self, layout_id: str, hashes: list[str], nonces: list[bytes], pages: list[Segments], threads: int = 0
    ) -> list[bytes]:
        """The tag of each page, contiguous shares of the batch on `threads` threads (default MAC_THREADS)."""
        threads = threads or MAC_THREADS
        if threads <= 1 or len(pages) <= 1:
            return [self.tag(layout_id, h, nc, sg) for h, nc, sg in zip(hashes, nonces, pages, strict=True)]
        per = -(-len(pages) // min(threads, 16))  # contiguous shares, one a thread
        shares = [(hashes[i : i + per], nonces[i : i + per], pages[i : i + per]) for i in range(0, len(pages), per)]
        out: list[bytes] = []
        for part in mac_pool().map(
            lambda s: [self.tag(layout_id, h, nc, sg) for h, nc, sg in zip(*s, strict=True)], shares
        ):
            out += part
        return out

    def seals(self, layout_id: str, hashes: list[str], pages: list[Segments], threads: int = 0) -> list[bytes]:
        """What a write stores of each page: a fresh random nonce (os.urandom, never reused) | its tag."""
        raw = os.urandom(NONCE_BYTES * len(hashes))
        nonces = [raw[i * NONCE_BYTES : (i + 1) * NONCE_BYTES] for i in range(len(hashes))]
        return [nc + t for nc, t in zip(nonces, self.tags(layout_id, hashes, nonces, pages, threads), strict=True)]


def secret_key(config: StorageConfig, tier: str) -> bytes:
    """A shared tier's MAC key: HMAC(the deployment's secret, "dsakv-storage-v1:" + tier). The secret file is
    config.secret_file, else $DSAKV_CLUSTER_SECRET_FILE; ConfigError if there is none or it is bad."""
    path = config.secret_file or os.environ.get(SECRET_ENV)
    flag = f"--hicache-storage {tier}"
    if not path:
        raise ConfigError(
            f"{flag} keys its pages with the deployment's secret (a page forged by another store client is then "
            f"refused): create one with `dsakv cluster-secret PATH` and pass --hicache-storage-secret-file PATH "
            f"(or --cluster-secret-file PATH, or set {SECRET_ENV}=PATH) to every server sharing the store"
        )
    try:
        secret = load_secret(path)
    except ValueError as e:
        raise ConfigError(f"{flag}: {e}") from None
    return hmac.new(secret, f"dsakv-storage-v1:{tier}".encode(), "sha256").digest()


def directory_key(root: str | os.PathLike[str]) -> bytes:
    """The disk tier's MAC key: 32 random bytes in `root`/KEY_FILE (64 hex digits), created mode 600 on first use
    (written whole, then linked into place: a concurrent server reads the same key); ConfigError naming the file
    and the fix when it is not a regular file of the owner's only, or not a key."""
    p = Path(root) / KEY_FILE
    if not os.path.lexists(p):
        tmp = p.with_name(f"{KEY_FILE}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(os.urandom(32).hex() + "\n")
            try:
                os.link(tmp, p)  # never replaces a key another server made meanwhile
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    fix = f"delete it (the pages already in {root} are then refused and rewritten)"
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ConfigError(f"disk tier key {p}: cannot open it ({e.strerror}); {fix}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"disk tier key {p} is not a regular file; {fix}")
        if st.st_mode & 0o077:
            raise ConfigError(
                f"disk tier key {p} is readable or writable by group or others (mode {stat.S_IMODE(st.st_mode):o}): "
                f"chmod 600 {p}"
            )
        raw = os.read(fd, 256).strip()
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != 32:
        raise ConfigError(f"disk tier key {p} is not a key (64 hex digits); {fix}")
    return key


@dataclass
class ReadResult:
    """A batch read: pages[:n] are intact; if n < asked, `reason` says why the next one was not loaded."""

    n: int
    corrupt: int = 0  # a page that failed its checksum or MAC (dropped)
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

    def __init__(self, layout: PageLayout, model_hash: str | None, config: StorageConfig) -> None:
        self.layout = layout
        self.config = config
        self.model_hash = model_hash
        self.layout_id = layout_identity(layout, model_hash)
        self.page_bytes = layout.bytes_per_page
        self.evicted_pages = 0
        self.evicted_bytes = 0
        self.mac = PageMac(self.tier_key())

    def page_hashes(self, tokens: npt.ArrayLike, num_pages: int | None = None) -> list[str]:
        return chain_hashes(self.layout_id, tokens, self.layout.page_size, num_pages)

    def tier_key(self) -> bytes:
        """The key of this tier's page MACs (secret_key for a shared tier, directory_key for a local one)."""
        raise NotImplementedError

    def meta(self, h: str, checksum: int, mac: bytes = bytes(MAC_BYTES)) -> bytes:
        return META.pack(META_MAGIC, self.layout_id.encode(), h.encode(), self.page_bytes, checksum, mac)

    def check_meta(self, h: str, raw: bytes | npt.NDArray[np.uint8]) -> tuple[str, int, bytes]:
        """("", word sum, MAC) if `raw` is this layout's record for page `h`, else (why, 0, b"")."""
        b = bytes(raw)
        if len(b) >= 8 and b[:8] in OLD_FORMATS:
            return old_format(b[:8], self.page_bytes), 0, b""
        if len(b) != META.size:
            return f"record of {len(b)} B, not {META.size}", 0, b""
        magic, lid, hh, nbytes, checksum, mac = META.unpack(b)
        if magic != META_MAGIC:
            return f"bad magic {magic!r}", 0, b""
        if lid != self.layout_id.encode() or hh != h.encode():
            why = f"identity {lid.decode(errors='replace')}/{hh[:12].decode(errors='replace')} is not this page's"
            return why, 0, b""
        if nbytes != self.page_bytes:
            return f"payload of {nbytes} B, this layout's pages are {self.page_bytes} B", 0, b""
        return "", int(checksum), mac

    def page_macs(self, hashes: list[str], pages: list[Segments], threads: int = 0) -> list[bytes]:
        """A write's MAC of each page (its segments) under this tier's key: a seal, fresh nonce | tag."""
        return self.mac.seals(self.layout_id, hashes, pages, threads)

    def first_forged(self, hashes: list[str], pages: list[Segments], seals: list[bytes], threads: int = 0) -> int:
        """The index of the first page whose tag is not the one its record's seal (nonce | tag, read back) gives
        (len(hashes) if none): pages read into their segments are verified there, the bytes that will be used."""
        seals = [bytes(s) for s in seals]
        nonces = [s[:NONCE_BYTES] for s in seals]
        got = self.mac.tags(self.layout_id, hashes, nonces, pages, threads)
        for i, (a, s) in enumerate(zip(got, seals, strict=True)):
            if not hmac.compare_digest(a, s[NONCE_BYTES:]):
                return i
        return len(hashes)

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


STORAGE_BACKENDS: Registry[Callable[[PageLayout, str | None, StorageConfig], StorageBackend]] = Registry(
    "storage backend", flag="--hicache-storage"
)
