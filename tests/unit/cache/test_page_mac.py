"""The page MAC's keys and its threads: the disk tier's per-directory key file (created mode 600, refused when
loose or not a key), a page file under another directory's key refused, the threaded batch MAC equal to the
reference HMAC page for page, and a page key (chain hash, layout identity) bound into every MAC."""

from __future__ import annotations

import hmac
import os
import shutil
import stat
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from dsakv.cache.host_pool import make_host_pool
from dsakv.cache.storage.base import KEY_FILE, MAC_DOMAIN, PageMac, StorageConfig
from dsakv.cache.storage.file import FileStore
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec

LAYOUT = KVLayout(load_spec("tiny"), page_size=4)


def _store(d: Path) -> FileStore:
    return FileStore(LAYOUT, None, StorageConfig(backend="file", dir=str(d)))


def _pages(n: int, seed: int = 3) -> tuple[object, list[list[tuple[int, int]]]]:
    host = make_host_pool("layer_first", LAYOUT, n)
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


def test_batch_macs_on_threads_equal_the_reference_hmac(tmp_path: Path) -> None:
    key = os.urandom(32)
    host, segs = _pages(7)
    m = PageMac(key)
    lid = "0123456789abcdef"
    hashes = [f"{i:064x}" for i in range(7)]
    want = []
    for h, sg in zip(hashes, segs, strict=True):
        payload = b"".join(_at(a, n).tobytes() for a, n in sg)
        ident = lid.encode() + h.encode() + struct.pack("<Q", len(payload))
        want.append(hmac.new(key, MAC_DOMAIN + ident + payload, "sha256").digest())
    for threads in (1, 2, 3, 16):
        assert m.macs(lid, hashes, segs, threads) == want, threads
    # the page key is bound: the same payload under another hash or layout identity has another MAC
    assert m.mac(lid, hashes[1], segs[0]) != want[0]
    assert m.mac("fedcba9876543210", hashes[0], segs[0]) != want[0]
    assert PageMac(os.urandom(32)).mac(lid, hashes[0], segs[0]) != want[0]
    with pytest.raises(ValueError, match="at least 16 bytes"):
        PageMac(b"short")


def _at(addr: int, n: int) -> np.ndarray:
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr))


def test_old_format_page_files_are_deleted_at_start_up_unread(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A page file of the previous format (DSAKVPG2: a 104 B record, no MAC) named like one of this layout's
    pages: start-up deletes it as "old format" (never indexed, never read); the page is then a miss."""
    import logging

    a = _store(tmp_path)
    h = a.page_hashes(np.arange(4) + 2)[0]
    p = a.path(h)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(b"DSAKVPG2" + a.layout_id.encode() + h.encode() + bytes(16) + bytes(LAYOUT.bytes_per_page))
    with caplog.at_level(logging.WARNING, logger="dsakv.cache.storage.file"):
        b = _store(tmp_path)
    assert not p.exists() and b.junk_deleted == 1 and not b.contains(h)
    assert "of an old format (DSAKVPG2)" in caplog.text
    host, out = _pages(1)
    assert b.get([h], out).reason == "missing"
