"""The page MAC's keys and its threads: the disk tier's per-directory key file (created mode 600, refused when
loose or not a key), a page file under another directory's key refused, the threaded batch MAC equal to the
pure-Python reference (Poly1305 under HMAC-SHA256(key, domain | nonce | identity)) page for page, a page key
(chain hash, layout identity) and the nonce bound into every tag, a fresh nonce on every write (a rewrite of
the same page included), and old-format (v2, v3) page files deleted at start-up unread."""

from __future__ import annotations

import os
import shutil
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

from dsakv.cache.host_pool import make_host_pool
from dsakv.cache.storage.base import KEY_FILE, MAC_DOMAIN, META, META_MAC_AT, NONCE_BYTES, TAG_BYTES, PageMac
from dsakv.cache.storage.file import FileStore
from dsakv.config import StorageConfig
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec
from dsakv.testing.pagemac import page_tag, poly1305

LAYOUT = KVLayout(load_spec("tiny"), page_size=4)


def _store(d: Path) -> FileStore:
    return FileStore(LAYOUT, None, StorageConfig(backend="file", dir=str(d)))


def _pages(n: int, seed: int = 3, host_layout: str = "layer_first") -> tuple[object, list[list[tuple[int, int]]]]:
    host = make_host_pool(host_layout, LAYOUT, n)
    g = torch.Generator().manual_seed(seed)
    for key in host.keys:
        v = host.view(key)
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g))
    segs = [[(host.view(b.key)[i].data_ptr(), b.page_bytes) for b in LAYOUT.buffers] for i in range(n)]
    return host, segs


def test_disk_key_file_is_made_once_mode_600_and_checked(tmp_path: Path) -> None:
    a = _store(tmp_path)
    key_file = tmp_path / KEY_FILE
    st = key_file.lstat()
    assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    text = key_file.read_text()
    assert len(text) == 65 and text.endswith("\n") and len(bytes.fromhex(text.strip())) == 32
    b = _store(tmp_path)  # a second server on the directory: the same key, the file untouched
    assert b.mac.key_id == a.mac.key_id and key_file.read_text() == text
    assert _store(tmp_path / "other").mac.key_id != a.mac.key_id  # another directory: another random key
    key_file.chmod(0o640)
    with pytest.raises(ConfigError, match=f"mode 640\\): chmod 600 {key_file}"):
        _store(tmp_path)
    key_file.chmod(0o600)
    key_file.write_text("not hex\n")
    with pytest.raises(ConfigError, match=f"disk tier key {key_file} is not a key \\(64 hex digits\\); delete it"):
        _store(tmp_path)
    key_file.unlink()
    (tmp_path / "elsewhere").write_text(text)
    key_file.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match="cannot open it"):  # never followed
        _store(tmp_path)
    key_file.unlink()
    key_file.mkdir()
    with pytest.raises(ConfigError, match="not a regular file"):
        _store(tmp_path)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        _store(tmp_path / "afile")


def test_page_file_under_another_key_is_refused(tmp_path: Path) -> None:
    """Page files copied from another directory (its own key) into this one, byte for byte: each is refused as
    "MAC mismatch", counted corrupt and deleted; this directory's own pages read back exactly."""
    src_host, segs = _pages(3)  # (the hosts keep the pages alive)
    src, dst = _store(tmp_path / "a"), _store(tmp_path / "b")
    hashes = src.page_hashes(np.arange(12) % 5 + 2)
    assert src.put(hashes, segs) == 3
    assert src.layout_id == dst.layout_id and src.mac.key_id != dst.mac.key_id
    for h in hashes:
        dst.path(h).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src.path(h), dst.path(h))
    dst2 = _store(tmp_path / "b")  # indexes the copied files at start-up (they look like pages)
    dst_host, out = _pages(3, seed=9)
    res = dst2.get(hashes, out)
    assert (res.n, res.reason, res.corrupt, dst2.corrupt_pages) == (0, "MAC mismatch", 1, 1)
    assert not dst2.path(hashes[0]).exists() and dst2.path(hashes[1]).exists()
    assert src.get(hashes, out).n == 3


def test_reference_poly1305_is_rfc_8439s() -> None:
    """The tests' pure-Python Poly1305 gives RFC 8439 section 2.5.2's tag, and cryptography's agrees on it."""
    from cryptography.hazmat.primitives.poly1305 import Poly1305

    key = bytes.fromhex("85d6be7857556d337f4452fe42d506a80103808afb0db2fd4abff6af4149f51b")
    msg = b"Cryptographic Forum Research Group"
    assert poly1305(key, msg).hex() == "a8061dc1305136c6c22b8baf0c0127a9"
    assert Poly1305.generate_tag(key, msg) == poly1305(key, msg)


def test_batch_macs_on_threads_equal_the_reference(tmp_path: Path) -> None:
    key = os.urandom(32)
    host, segs = _pages(7)
    m = PageMac(key)
    lid = "0123456789abcdef"
    hashes = [f"{i:064x}" for i in range(7)]
    nonces = [os.urandom(NONCE_BYTES) for _ in hashes]
    payloads = [b"".join(_at(a, n).tobytes() for a, n in sg) for sg in segs]
    want = [page_tag(key, MAC_DOMAIN, lid, h, nc, p) for h, nc, p in zip(hashes, nonces, payloads, strict=True)]
    assert all(len(t) == TAG_BYTES for t in want) and len(set(want)) == 7
    for threads in (1, 2, 3, 16):
        assert m.tags(lid, hashes, nonces, segs, threads) == want, threads
    # the same bytes in a page_first pool (each page's segments adjacent: one update) give the same tags
    host2, segs2 = _pages(7, host_layout="page_first")
    assert all(a + n == b for sg in segs2 for (a, n), (b, _) in zip(sg, sg[1:], strict=False))
    assert [b"".join(_at(a, n).tobytes() for a, n in sg) for sg in segs2] == payloads
    assert m.tags(lid, hashes, nonces, segs2) == want
    # a write's seals: a fresh nonce each (never two alike, another on every call), then its tag
    for threads in (1, 2):
        seals = m.seals(lid, hashes, segs, threads)
        again = m.seals(lid, hashes, segs, threads)
        got = [s[:NONCE_BYTES] for s in seals + again]
        assert len(set(got)) == 14 and all(len(s) == NONCE_BYTES + TAG_BYTES for s in seals)
        for h, s, p in zip(hashes, seals, payloads, strict=True):
            assert s[NONCE_BYTES:] == page_tag(key, MAC_DOMAIN, lid, h, s[:NONCE_BYTES], p)
    # the page key and the nonce are bound: the same payload under another hash, layout identity, nonce or key
    assert m.tag(lid, hashes[1], nonces[0], segs[0]) != want[0]
    assert m.tag("fedcba9876543210", hashes[0], nonces[0], segs[0]) != want[0]
    assert m.tag(lid, hashes[0], nonces[1], segs[0]) != want[0]
    assert PageMac(os.urandom(32)).tag(lid, hashes[0], nonces[0], segs[0]) != want[0]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PageMac(b"short")
    with pytest.raises(ValueError, match=f"nonce is {NONCE_BYTES} bytes, got 16"):
        m.tag(lid, hashes[0], bytes(16), segs[0])


def test_rewrite_of_a_page_gets_a_fresh_nonce(tmp_path: Path) -> None:
    """The same page written twice (deleted, then put again; and by a second store on the directory) carries
    another nonce and another tag each time, over the same payload; every copy reads back verified."""
    host, segs = _pages(2)
    a = _store(tmp_path)
    hashes = a.page_hashes(np.arange(8) % 5 + 2)
    records = []
    for _ in range(3):
        assert a.put(hashes, segs) == 2
        raw = [a.path(h).read_bytes() for h in hashes]
        records += [r[META_MAC_AT : META.size] for r in raw]
        assert raw[0][META.size :] == b"".join(_at(p, n).tobytes() for p, n in segs[0])
        out_host, out = _pages(2, seed=11)
        assert a.get(hashes, out).n == 2
        for h in hashes:
            a.path(h).unlink()
        a = _store(tmp_path)  # a restart (or another server): the files are gone, the pages rewritten
    nonces = {r[:NONCE_BYTES] for r in records}
    tags = {r[NONCE_BYTES:] for r in records}
    assert len(nonces) == 6 and len(tags) == 6


def _at(addr: int, n: int) -> np.ndarray:
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


@pytest.mark.parametrize("magic, record", [(b"DSAKVPG2", 104), (b"DSAKVPG3", 136)])
def test_old_format_page_files_are_deleted_at_start_up_unread(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, magic: bytes, record: int
) -> None:
    """A page file of an older format (DSAKVPG2: a 104 B record, no MAC; DSAKVPG3: 136 B, an HMAC-SHA256)
    named like one of this layout's pages: start-up deletes it as "old format" (never indexed, never read); the
    page is then a miss."""
    import logging

    a = _store(tmp_path)
    h = a.page_hashes(np.arange(4) + 2)[0]
    p = a.path(h)
    p.parent.mkdir(parents=True, exist_ok=True)
    head = magic + a.layout_id.encode() + h.encode() + bytes(record - 88)
    assert len(head) == record != META.size
    p.write_bytes(head + bytes(LAYOUT.bytes_per_page))
    with caplog.at_level(logging.WARNING, logger="dsakv.cache.storage.file"):
        b = _store(tmp_path)
    assert not p.exists() and b.junk_deleted == 1 and not b.contains(h)
    assert f"of an old format ({magic.decode()})" in caplog.text
    host, out = _pages(1)
    assert b.get([h], out).reason == "missing"
