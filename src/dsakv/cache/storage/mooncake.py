"""`mooncake` storage backend: pages as objects in a Mooncake Store shared by every instance on one master.

Per page `h` (chain hash, see base.py) two objects, under `dsakv/<layout_id>/<key id>/<h>` (key id: 8 hex chars
naming the MAC key, so deployments of other secrets on one master never read or drop each other's objects):

    <key>        the payload: the page's buffers in layout order, exactly layout.bytes_per_page bytes
                 (put with batch_put_from_multi_buffers straight from the host pool's pages: one object per
                 page whatever the host layout, no staging copy)
    <key>.meta   144 B record (base.META) written after the payload: magic, layout_id, h, payload bytes, word sum,
                 MAC (a fresh nonce | Poly1305 tag of the payload under HMAC-SHA256(a key derived from the
                 deployment's secret, nonce | identity))

A page is stored iff both exist (a writer that dies between the two left no hit). A read fetches the records,
refuses any of another identity, size or format, reads the payloads straight into host-pool pages (batch_get_
into_multi_buffers), checks each returned size, word sum and MAC (over the bytes as loaded), and keeps the intact
prefix. Any client of the master can write any object; without the secret it cannot make one that passes the
MAC, so a forged object is refused and dropped, never served.

Objects live in the segments clients mount: `dsakv store-master` runs the master and a process that mounts the
store's memory, so pages outlive the servers that wrote them. Calls go through a thread with a deadline
(StorageConfig.timeout) in the HiCache controller: a dead master returns errors (StorageError) or stalls, and
the request computes instead. Imports numpy, mooncake and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

import logging
import socket
import threading
import urllib.parse
from collections import OrderedDict

import numpy as np

from dsakv.cache.storage.base import (
    META,
    STORAGE_BACKENDS,
    PageLayout,
    ReadResult,
    Segments,
    StorageBackend,
    StorageError,
    page_checksum,
    secret_key,
)
from dsakv.config import StorageConfig
from dsakv.errors import ConfigError

log = logging.getLogger(__name__)

_BATCH = 512  # pages per store call (bounds the record buffer)
_KNOWN = 1 << 16  # pages remembered as stored
_NOT_FOUND = -704  # mooncake OBJECT_NOT_FOUND
_RPC_FAIL = -900  # mooncake RPC_FAIL and worse: the master is unreachable


def parse_address(addr: str, what: str = "--mooncake-master") -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"{what} {addr!r} is not HOST:PORT (e.g. 127.0.0.1:50051)")
    return host, int(port)


def default_metadata_url(master: str) -> str:
    """The HTTP metadata server `dsakv store-master` runs next to a master: port + 1."""
    host, port = parse_address(master)
    return f"http://{host}:{port + 1}/metadata"


def _coalesce(segs: Segments) -> tuple[list[int], list[int]]:
    ptrs: list[int] = []
    sizes: list[int] = []
    for a, n in segs:
        if ptrs and ptrs[-1] + sizes[-1] == a:
            sizes[-1] += n
        else:
            ptrs.append(a)
            sizes.append(n)
    return ptrs, sizes


@STORAGE_BACKENDS.register("mooncake")
class MooncakeStore(StorageBackend):
    name = "mooncake"
    synchronous = False
    needs_registration = True

    def __init__(self, layout: PageLayout, model_hash: str | None, config: StorageConfig) -> None:
        super().__init__(layout, model_hash, config)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:  # pragma: no cover - the package is a dependency
            raise ConfigError(f"--hicache-storage mooncake needs the mooncake package ({e})") from e
        assert config.master is not None
        parse_address(config.master)
        self.master = config.master
        self.metadata = config.metadata or default_metadata_url(config.master)
        self.prefix = f"dsakv/{self.layout_id}/{self.mac.key_id}/"
        self._probe()
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            config.local_hostname,
            self.metadata,
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.device_names,
            config.master,
        )
        if rc != 0:
            raise ConfigError(
                f"cannot reach the Mooncake master at {config.master} (metadata {self.metadata}): setup returned "
                f"{rc}; start one with `dsakv store-master --port PORT` or fix --mooncake-master"
            )
        self._meta = np.zeros((_BATCH, META.size), dtype=np.uint8)  # record staging, registered
        self._meta_lock = threading.Lock()
        self._registered: list[tuple[int, int]] = []
        self.register(self._meta.ctypes.data, self._meta.nbytes)
        # pages this client wrote or read lately (skips a re-put); bounded, and a page the store evicted since
        # is found missing by the existence check of its next write or read
        self._known: OrderedDict[str, None] = OrderedDict()
        log.info("storage: mooncake master %s, metadata %s, objects %s*", config.master, self.metadata, self.prefix)

    def _probe(self) -> None:
        """Refuse an unreachable master at once (the client's own setup retries for ~90 s before failing)."""
        host, port = parse_address(self.master)
        targets = [(host, port, "master")]
        murl = urllib.parse.urlparse(self.metadata)
        if murl.scheme == "http" and murl.hostname:
            targets.append((murl.hostname, murl.port or 80, "metadata server"))
        for h, p, what in targets:
            try:
                socket.create_connection((h, p), timeout=2.0).close()
            except OSError as e:
                raise ConfigError(
                    f"cannot reach the Mooncake {what} at {h}:{p} ({e.strerror or e}): start one with "
                    f"`dsakv store-master --port {port}` or fix --mooncake-master / --mooncake-metadata"
                ) from None

    def tier_key(self) -> bytes:
        """The deployment's secret (config.secret_file, else $DSAKV_CLUSTER_SECRET_FILE) keys the MACs."""
        return secret_key(self.config, "mooncake")

    def key(self, h: str) -> str:
        return self.prefix + h

    def register(self, ptr: int, nbytes: int) -> None:
        rc = self._store.register_buffer(ptr, nbytes)
        if rc != 0:
            raise StorageError(f"mooncake register_buffer({nbytes} B) returned {rc}")
        self._registered.append((ptr, nbytes))

    def contains(self, h: str) -> bool:
        return h in self._known

    def _remember(self, hashes: list[str]) -> None:
        for h in hashes:
            self._known[h] = None
            self._known.move_to_end(h)
        while len(self._known) > _KNOWN:
            self._known.popitem(last=False)

    def count_present(self, hashes: list[str]) -> int:
        if not hashes:
            return 0
        keys = []
        for h in hashes:
            keys += [self.key(h), self.key(h) + ".meta"]
        got = self._store.batch_is_exist(keys)
        if any(r < 0 for r in got):  # -1: the master is unreachable
            raise StorageError(f"mooncake batch_is_exist failed ({min(got)}) at master {self.master}")
        for i in range(len(hashes)):
            if got[2 * i] != 1 or got[2 * i + 1] != 1:
                return i
        return len(hashes)

    def put(self, hashes: list[str], pages: list[Segments]) -> int:
        written = 0
        for s in range(0, len(hashes), _BATCH):
            hs, ps = hashes[s : s + _BATCH], pages[s : s + _BATCH]
            todo = [i for i, h in enumerate(hs) if h not in self._known]
            if not todo:
                continue
            have = self._store.batch_is_exist([self.key(hs[i]) + ".meta" for i in todo])
            if any(r < 0 for r in have):
                raise StorageError(f"mooncake batch_is_exist failed ({min(have)}) at master {self.master}")
            self._remember([hs[i] for i, r in zip(todo, have, strict=True) if r == 1])
            todo = [i for i, r in zip(todo, have, strict=True) if r != 1]
            if not todo:
                continue
            segs = [_coalesce(ps[i]) for i in todo]
            rc = self._store.batch_put_from_multi_buffers(
                [self.key(hs[i]) for i in todo], [p for p, _ in segs], [n for _, n in segs]
            )
            ok = [i for i, r in zip(todo, rc, strict=True) if r == 0]
            if len(ok) < len(todo):
                log.debug("mooncake: %d of %d payload puts failed (%s)", len(todo) - len(ok), len(todo), set(rc))
            if not ok:
                if any(r < 0 for r in rc):
                    raise StorageError(f"mooncake put failed ({min(rc)}) at master {self.master}")
                continue
            macs = self.page_macs([hs[i] for i in ok], [ps[i] for i in ok])
            with self._meta_lock:
                for j, (i, mac) in enumerate(zip(ok, macs, strict=True)):
                    self._meta[j] = np.frombuffer(self.meta(hs[i], page_checksum(ps[i]), mac), dtype=np.uint8)
                base = self._meta.ctypes.data
                rc2 = self._store.batch_put_from(
                    [self.key(hs[i]) + ".meta" for i in ok],
                    [base + j * META.size for j in range(len(ok))],
                    [META.size] * len(ok),
                )
            for i, r in zip(ok, rc2, strict=True):
                if r == 0:
                    self._remember([hs[i]])
                    written += 1
        return written

    def get(self, hashes: list[str], pages: list[Segments]) -> ReadResult:
        res = ReadResult(0)
        for s in range(0, len(hashes), _BATCH):
            hs, ps = hashes[s : s + _BATCH], pages[s : s + _BATCH]
            n = len(hs)
            with self._meta_lock:
                base = self._meta.ctypes.data
                got = self._store.batch_get_into(
                    [self.key(h) + ".meta" for h in hs], [base + j * META.size for j in range(n)], [META.size] * n
                )
                checks: list[int] = []
                tags: list[bytes] = []
                for j, (h, r) in enumerate(zip(hs, got, strict=True)):
                    if r != META.size:
                        if r <= _RPC_FAIL:
                            raise StorageError(f"mooncake get failed ({r}) at master {self.master}")
                        why = "missing" if r == _NOT_FOUND else f"record of {r} B, not {META.size} (code {r})"
                        break
                    why, c, tag = self.check_meta(h, self._meta[j])
                    if why:
                        break
                    checks.append(c)
                    tags.append(tag)
                else:
                    why = ""
            m = len(checks)
            if m:
                segs = [_coalesce(p) for p in ps[:m]]
                got = self._store.batch_get_into_multi_buffers(
                    [self.key(h) for h in hs[:m]], [p for p, _ in segs], [sz for _, sz in segs]
                )
                for j in range(m):
                    if got[j] != self.page_bytes:
                        if got[j] <= _RPC_FAIL:
                            raise StorageError(f"mooncake get failed ({got[j]}) at master {self.master}")
                        why = (
                            "missing"
                            if got[j] == _NOT_FOUND
                            else f"object of another size (code {got[j]}), pages are {self.page_bytes} B"
                        )
                        m = j
                        break
                    if page_checksum(ps[j]) != checks[j]:
                        why = "checksum mismatch"
                        m = j
                        break
                forged = self.first_forged(hs[:m], ps[:m], tags[:m])
                if forged < m:  # the word sum held, the MAC did not: altered or forged without the secret
                    why, m = "MAC mismatch", forged
            res.n += m
            self._remember(hs[:m])
            if m < n:
                res.reason = why or "missing"
                if res.reason.startswith(("checksum", "MAC")):
                    res.corrupt = 1
                elif res.reason == "missing":
                    res.missing = 1
                else:
                    res.refused = 1
                self._known.pop(hs[m], None)
                if res.corrupt or res.refused:  # never serve it again: drop both objects
                    self._store.batch_remove([self.key(hs[m]), self.key(hs[m]) + ".meta"], True)
                break
        return res

    def remove(self, hashes: list[str]) -> None:
        keys = []
        for h in hashes:
            keys += [self.key(h), self.key(h) + ".meta"]
            self._known.pop(h, None)
        self._store.batch_remove(keys, True)

    def forget_known(self) -> None:
        """Drop the local 'known stored' set (after a store failure its objects may be gone)."""
        self._known.clear()

    def describe(self) -> str:
        return f"mooncake {self.master}"

    def close(self) -> None:
        try:
            for ptr, _ in self._registered:
                self._store.unregister_buffer(ptr)
            self._store.close()
        except Exception as e:  # noqa: BLE001 - closing a client of a dead master
            log.debug("mooncake close: %s", e)
        self._registered.clear()
