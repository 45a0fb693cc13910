"""copy_page_set: one-pass page copies (runs coalesced on both sides), exact bytes, bounds refused untouched; the
native (C) copy, checksum and disk read against the Python paths on real layouts with fragmented runs."""

from __future__ import annotations

import ctypes
import errno
import os
import stat

import numpy as np
import pytest
import torch

from dsakv.cache import native, page_copy
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.host_pool import make_host_pool
from dsakv.cache.page_copy import copy_page_set, page_runs
from dsakv.cache.storage.base import finish_checksum, page_checksum
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec


def test_page_runs_coalesce_on_both_sides():
    d, s, n = page_runs([4, 5, 6, 9, 10, 2], [0, 1, 2, 3, 5, 6])
    assert d.tolist() == [4, 9, 10, 2] and s.tolist() == [0, 3, 5, 6] and n.tolist() == [3, 1, 1, 1]
    with pytest.raises(ValueError, match="2 source pages but 1 destination pages"):
        page_runs([0], [0, 1])


@pytest.mark.parametrize("threads", [1, 2])
def test_copy_page_set_exact_bytes(threads):
    g = torch.Generator().manual_seed(0)
    src_a = torch.randint(0, 256, (8, 24), dtype=torch.uint8, generator=g)
    src_b = torch.randint(0, 256, (8, 40), dtype=torch.uint8, generator=g)
    dst_a = torch.zeros(6, 24, dtype=torch.uint8)
    wide = torch.zeros(6, 100, dtype=torch.uint8)  # a page_first row: dst_b is a strided column slice of it
    dst_b = wide[:, 30:70]
    src_ids, dst_ids = [1, 2, 3, 7, 0], [5, 0, 1, 2, 4]
    moved = copy_page_set([(dst_a, src_a), (dst_b, src_b)], torch.tensor(dst_ids), np.array(src_ids), threads=threads)
    assert moved == 5 * (24 + 40)
    for d, s in zip(dst_ids, src_ids, strict=True):
        assert torch.equal(dst_a[d], src_a[s]) and torch.equal(dst_b[d], src_b[s])
    assert int(dst_a[3].count_nonzero()) == 0 and int(wide[:, :30].count_nonzero()) == 0
    assert int(wide[:, 70:].count_nonzero()) == 0


def test_copy_page_set_refuses_out_of_range_ids_untouched():
    src = torch.ones(4, 16, dtype=torch.uint8)
    dst = torch.zeros(4, 16, dtype=torch.uint8)
    other = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(IndexError, match="destination page ids span 0..3 but the destination buffer has pages 0..1"):
        copy_page_set([(dst, src), (other, src)], [0, 3], [0, 1])
    assert int(dst.count_nonzero()) == 0  # checked before any byte moved
    with pytest.raises(IndexError, match="source page ids span -1..0"):
        copy_page_set([(dst, src)], [0, 1], [-1, 0])
    with pytest.raises(ValueError, match="destination pages of 8 bytes but source pages of 16"):
        copy_page_set([(torch.zeros(4, 8, dtype=torch.uint8), src)], [0], [0])
    assert page_copy.COPY_THREADS == 1


# ---- the native (C) path against the Python one and plain indexing: real layouts, fragmented runs ----------

DEV_IDS = [9, 10, 11, 2, 5, 6, 0, 13]  # runs 9-11, 2, 5-6, 0, 13 on the device side
HOST_IDS = [3, 4, 8, 1, 6, 7, 0, 12]  # broken differently on the host side: runs 3-4, 8, 1, 6-7, 0, 12


@pytest.fixture(params=["native", "native-stream", "python"])
def copy_path(request, monkeypatch):
    if request.param.startswith("native"):
        if native.lib() is None:
            pytest.skip("no C compiler: the native path is not built")
        if request.param == "native-stream":  # non-temporal stores, as copies of >= STREAM_BYTES use
            monkeypatch.setattr(page_copy, "STREAM_BYTES", 0)
    else:
        monkeypatch.setattr(native, "_LIB", False)
    return request.param


@pytest.mark.parametrize("host_layout", ["layer_first", "page_first"])
@pytest.mark.parametrize("fmt", [("fp32", "fp32"), ("fp8-656", "fp8-132")])
def test_offload_load_fragmented_runs_exact(copy_path, host_layout, fmt):
    layout = KVLayout(load_spec("tiny"), kv_format=fmt[0], index_format=fmt[1], page_size=4)
    dev = DevicePool(layout, 14)
    g = torch.Generator().manual_seed(1)
    for key in dev.keys:
        dev.tensor(key).copy_(torch.randint(0, 256, dev.tensor(key).shape, dtype=torch.uint8, generator=g))
    host = make_host_pool(host_layout, layout, 13)
    for key in host.keys:
        host.view(key).fill_(0xEE)
    assert host.offload(dev, DEV_IDS, HOST_IDS) == len(DEV_IDS) * layout.bytes_per_page
    untouched = sorted(set(range(13)) - set(HOST_IDS))
    for key in dev.keys:
        assert torch.equal(host.view(key)[HOST_IDS], dev.tensor(key)[DEV_IDS]), key
        assert bool((host.view(key)[untouched] == 0xEE).all()), key
    back = DevicePool(layout, 14)
    for key in back.keys:
        back.tensor(key).fill_(0x11)
    order = [7, 0, 3, 1, 6, 2, 5, 4]  # load in another order: other runs
    dst = [DEV_IDS[i] for i in order]
    assert host.load(back, [HOST_IDS[i] for i in order], dst) == len(dst) * layout.bytes_per_page
    for key in dev.keys:
        assert torch.equal(back.tensor(key)[DEV_IDS], dev.tensor(key)[DEV_IDS]), key
        assert bool((back.tensor(key)[[1, 3, 4, 7, 8, 12]] == 0x11).all()), key


def test_native_checksum_and_read_match_python(tmp_path):
    lib = native.lib()
    if lib is None:
        pytest.skip("no C compiler: the native path is not built")
    data = np.random.default_rng(3).integers(0, 256, 1000, dtype=np.uint8)
    base = data.ctypes.data
    for cuts in ([0, 1000], [0, 8, 1000], [0, 3, 11, 12, 513, 1000], [0, 997, 1000], [0, 1, 2, 3, 4, 5, 6, 7, 1000]):
        segs = [(base + a, b - a) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
        want = page_checksum([(base, 1000)])  # the same bytes, one segment
        assert page_checksum(segs) == want
        os.environ["DSAKV_NO_NATIVE"] = "1"
        try:
            saved, native._LIB = native._LIB, None
            assert page_checksum(segs) == want  # the Python sum agrees
        finally:
            native._LIB = saved
            del os.environ["DSAKV_NO_NATIVE"]
        # read_sum: preadv into scattered segments of another buffer, from a file offset, summed on the way
        f = tmp_path / "page.bin"
        f.write_bytes(b"H" * 40 + data.tobytes())
        out = np.zeros(1200, dtype=np.uint8)
        offs = [a + 19 * (i + 1) for i, a in enumerate(cuts[:-1])]  # scattered, gaps between segments
        dsegs = [(out.ctypes.data + offs[i], n) for i, (_, n) in enumerate(segs)]
        word = ctypes.c_uint64()
        fd = os.open(f, os.O_RDONLY)
        try:
            got = lib.dsakv_read_sum(fd, 40, len(dsegs), native.seg_table(dsegs), word)
        finally:
            os.close(fd)
        assert got == 1000
        assert np.array_equal(np.concatenate([out[o : o + n] for o, (_, n) in zip(offs, segs, strict=False)]), data)
        assert page_checksum(dsegs) == want
        assert finish_checksum(word.value, 1000) == want


def test_native_map_sum_one_pass_copy_exact(tmp_path):
    """map_sum (the disk tier's read from a mapping: copy + word sum in one pass, streaming stores) against the
    Python checksum, with segments whose destinations are 8-aligned with the stream (the vector path) or not
    (copy then sum), odd lengths, and a file offset that is not page aligned; a file shorter than the mapping
    (SIGBUS on the first page past its end) reads as -EFAULT, and the process carries on."""
    lib = native.lib()
    if lib is None:
        pytest.skip("no C compiler: the native path is not built")
    data = np.random.default_rng(4).integers(0, 256, 9000, dtype=np.uint8)
    f = tmp_path / "page.bin"
    f.write_bytes(b"H" * 104 + data.tobytes())
    want = page_checksum([(data.ctypes.data, 9000)])
    for cuts in ([0, 9000], [0, 8, 4104, 9000], [0, 3, 11, 12, 513, 4999, 9000], [0, 8997, 9000]):
        for gap in (64, 19):  # 64: dst - stream position a multiple of 8 (vector path); 19: not
            out = np.zeros(9000 + gap * len(cuts), dtype=np.uint8)
            offs = [a + gap * (i + 1) for i, a in enumerate(cuts[:-1])]
            lens = [b - a for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
            dsegs = [(out.ctypes.data + o, n) for o, n in zip(offs, lens, strict=True)]
            word = ctypes.c_uint64()
            fd = os.open(f, os.O_RDONLY)
            try:
                got = lib.dsakv_map_sum(fd, 104, len(dsegs), native.seg_table(dsegs), word)
            finally:
                os.close(fd)
            assert got == 9000, (cuts, gap)
            assert np.array_equal(np.concatenate([out[o : o + n] for o, n in zip(offs, lens, strict=True)]), data)
            assert finish_checksum(word.value, 9000) == want, (cuts, gap)
            mask = np.ones(out.size, dtype=bool)
            for o, n in zip(offs, lens, strict=True):
                mask[o : o + n] = False
            assert int(out[mask].sum()) == 0  # nothing written outside the segments
    short = tmp_path / "short.bin"
    short.write_bytes(data[:5000].tobytes())  # ends inside page 1 of the mapping: page 2 on raises SIGBUS
    out = np.zeros(20000, dtype=np.uint8)
    fd = os.open(short, os.O_RDONLY)
    try:
        got = lib.dsakv_map_sum(fd, 0, 1, native.seg_table([(out.ctypes.data, 20000)]), ctypes.c_uint64())
    finally:
        os.close(fd)
    assert got == -errno.EFAULT
    assert np.array_equal(out[:5000], data[:5000])  # what lay before the end was copied


# ---- the disk tier's batch read (FileStore.get): the native one-call path against the Python one ----------


@pytest.fixture(params=["native-mmap", "native-preadv", "native-2-threads", "native-one-call", "python"])
def disk_path(request, monkeypatch):
    """native-one-call: one C call per batch, then its MACs; the other native paths: chunks, each chunk's MACs on
    a MAC thread while the next is read (whatever this machine's core count)."""
    from dsakv.cache.storage import file as file_mod

    if request.param == "python":
        monkeypatch.setattr(native, "_LIB", False)
    elif native.lib() is None:
        pytest.skip("no C compiler: the native path is not built")
    monkeypatch.setattr(file_mod, "MAC_THREADS", 1 if request.param == "native-one-call" else 2)
    monkeypatch.setattr(file_mod, "READ_MAP", request.param != "native-preadv")
    monkeypatch.setattr(file_mod, "READ_THREADS", 2 if request.param == "native-2-threads" else 1)
    return request.param


DISK_LAYOUT = KVLayout(load_spec("tiny"), kv_format="fp8-656", index_format="fp8-132", page_size=4)
SRC_IDS = [3, 7, 1, 10, 5]  # the chain's pages in the writer's host pool
DST_IDS = [8, 0, 6, 2, 11]  # and where a reader loads them


def _disk_store(tmp_path):
    from dsakv.cache.storage.file import FileStore
    from dsakv.config import StorageConfig

    return FileStore(DISK_LAYOUT, None, StorageConfig(backend="file", dir=str(tmp_path)))


def _host(name, fill=None):
    host = make_host_pool(name, DISK_LAYOUT, 12)
    g = torch.Generator().manual_seed(5)
    for key in host.keys:
        v = host.view(key)
        v.copy_(
            torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g) if fill is None else torch.full_like(v, fill)
        )
    return host


def _segs(host, ids):
    return [[(host.view(b.key)[i].data_ptr(), b.page_bytes) for b in DISK_LAYOUT.buffers] for i in ids]


@pytest.mark.parametrize("layouts", [("layer_first", "page_first"), ("page_first", "layer_first")])
def test_disk_tier_reads_exact_bytes_per_page(disk_path, layouts, tmp_path):
    src, dst = _host(layouts[0]), _host(layouts[1], fill=0xEE)
    store = _disk_store(tmp_path)
    hashes = store.page_hashes(np.arange(20) % 7 + 2)
    assert len(hashes) == 5 and store.put(hashes, _segs(src, SRC_IDS)) == 5
    res = store.get(hashes, _segs(dst, DST_IDS))
    assert (res.n, res.corrupt, res.refused, res.missing, res.reason) == (5, 0, 0, 0, "")
    untouched = sorted(set(range(12)) - set(DST_IDS))
    for key in src.keys:
        assert torch.equal(dst.view(key)[DST_IDS], src.view(key)[SRC_IDS]), key
        assert bool((dst.view(key)[untouched] == 0xEE).all()), key
    # the read stamped the chain for the LRU: the first page most recent, on disk and in the index
    mtimes = [store.path(h).stat().st_mtime_ns for h in hashes]
    assert mtimes == sorted(mtimes, reverse=True) and len(set(mtimes)) == 5
    assert list(store._lru)[-5:] == hashes[::-1]
    assert (store.corrupt_pages, store.junk_deleted) == (0, 0)


def _damage(store, h, how, good: bytes) -> str:
    """Damages page h's file; returns the reason a read gives for it."""
    from dsakv.cache.storage.base import MAC_BYTES, META, META_MAC_AT, META_MAGIC, NONCE_BYTES

    p = store.path(h)
    size = META.size + DISK_LAYOUT.bytes_per_page
    if how == "missing":
        p.unlink()
        return "missing"
    if how == "truncated":
        os.truncate(p, size - 1)
        return f"size {size - 1} B, not {size}"
    if how == "foreign":  # a genuine-looking record of another layout, its payload intact
        p.write_bytes(
            META.pack(META_MAGIC, b"0123456789abcdef", h.encode(), DISK_LAYOUT.bytes_per_page, 0, bytes(MAC_BYTES))
            + good[META.size :]
        )
        return f"identity 0123456789abcdef/{h[:12]} is not this page's"
    if how == "old-magic":
        p.write_bytes(b"DSAKVPG2" + good[8:])
        return "old format (DSAKVPG2)"
    if how == "old-format":  # a whole page file of the previous format (a 104 B record): never opened for its data
        p.write_bytes(b"DSAKVPG2" + good[8:96] + good[96:104] + good[META.size :])
        return "old format (DSAKVPG2)"
    if how == "old-magic-v3":  # this size, the v3 magic (an HMAC-SHA256 record)
        p.write_bytes(b"DSAKVPG3" + good[8:])
        return "old format (DSAKVPG3)"
    if how == "old-format-v3":  # a whole v3 page file: a 136 B record (32 B HMAC), then the payload
        p.write_bytes(b"DSAKVPG3" + good[8:104] + bytes(32) + good[META.size :])
        return "old format (DSAKVPG3)"
    if how in ("nonce", "tag"):  # one bit of the record's nonce or tag: the word sum holds, the MAC does not
        b = bytearray(good)
        b[META_MAC_AT + (3 if how == "nonce" else NONCE_BYTES + 5)] ^= 0x04
        p.write_bytes(bytes(b))
        return "MAC mismatch"
    if how == "other-seal":  # the next page's genuine nonce | tag pasted into this page's record
        other = store.path(store.page_hashes(np.arange(20) % 7 + 2)[3]).read_bytes()
        p.write_bytes(good[:META_MAC_AT] + other[META_MAC_AT : META.size] + good[META.size :])
        return "MAC mismatch"
    if how == "bad-magic":
        p.write_bytes(b"NOTAPAGE" + good[8:])
        return "bad magic b'NOTAPAGE'"
    if how == "flip":
        b = bytearray(good)
        b[META.size + 1234] ^= 0x20
        p.write_bytes(bytes(b))
        return "checksum mismatch"
    if how in ("swap", "compensating"):  # damage a position-blind word sum cannot see: the MAC does
        b = bytearray(good)
        nw = (len(good) - META.size) // 8
        w = np.frombuffer(good, dtype=np.uint64, count=nw, offset=META.size).copy()  # the payload's words
        if how == "swap":  # two payload words exchanged: the same sum
            i, j = 10, 200
            assert w[i] != w[j]
            w[i], w[j] = w[j], w[i]
        else:  # bit 0 set in one word (+1) and cleared in another (-1): two bit flips, the same sum
            k = next(k for k in range(10, nw) if w[k] & 1 == 0)
            m = next(m for m in range(10, nw) if w[m] & 1 == 1)
            w[k] ^= np.uint64(1)
            w[m] ^= np.uint64(1)
        b[META.size : META.size + 8 * nw] = w.tobytes()
        assert _word_sum(bytes(b[META.size :])) == _word_sum(good[META.size :]) and bytes(b) != good
        p.write_bytes(bytes(b))
        return "MAC mismatch"
    if how == "fifo":
        p.unlink()
        os.mkfifo(p)
        return "not a regular file"
    if how == "dir":
        p.unlink()
        p.mkdir()
        return "not a regular file"
    assert how == "symlink"
    other = p.with_name("elsewhere.bin")
    other.write_bytes(good)
    p.unlink()
    p.symlink_to(other)
    return "cannot open: Too many levels of symbolic links"


def _word_sum(payload: bytes) -> int:
    """The format's word sum (page_checksum) of a payload, from first principles: wrapping u64 sum ^ size mix."""
    from dsakv.cache.storage.base import CHECKSUM_MIX

    pad = payload + bytes(-len(payload) % 8)
    total = int(np.frombuffer(pad, dtype=np.uint64).sum(dtype=np.uint64))
    return (total ^ (len(payload) * CHECKSUM_MIX)) & (2**64 - 1)


MAC_DAMAGES = ("flip", "swap", "compensating", "nonce", "tag", "other-seal")  # read as corrupt
DAMAGES = ["missing", "truncated", "foreign", "old-magic", "old-format", "old-magic-v3", "old-format-v3", "bad-magic"]
DAMAGES += MAC_DAMAGES


@pytest.mark.parametrize("how", [*DAMAGES, "fifo", "dir", "symlink"])
def test_disk_tier_refuses_bad_page_files_exactly(disk_path, how, tmp_path):
    """Page 2 of a 5-page chain damaged: pages 0-1 load with exact bytes, the read stops there with the same
    reason and counts on every path (native mmap / preadv / threads, Python), the bad file is deleted (a
    directory is left alone) and the page leaves the index."""
    src, dst = _host("layer_first"), _host("page_first", fill=0xEE)
    store = _disk_store(tmp_path)
    hashes = store.page_hashes(np.arange(20) % 7 + 2)
    assert store.put(hashes, _segs(src, SRC_IDS)) == 5
    bad = store.path(hashes[2])
    why = _damage(store, hashes[2], how, bad.read_bytes())
    res = store.get(hashes, _segs(dst, DST_IDS))
    assert (res.n, res.reason) == (2, why)
    corrupt = how in MAC_DAMAGES
    assert (res.corrupt, res.refused, res.missing) == (
        int(corrupt),
        int(not corrupt and how != "missing"),
        int(how == "missing"),
    )
    assert store.corrupt_pages == int(corrupt)
    assert store.junk_deleted == (0 if how in ("missing", "dir") else 1)
    assert bad.is_dir() if how == "dir" else not os.path.lexists(bad)
    assert not store.contains(hashes[2]) and store.contains(hashes[3])
    for key in src.keys:
        assert torch.equal(dst.view(key)[DST_IDS[:2]], src.view(key)[SRC_IDS[:2]]), key
    if how == "fifo":
        assert not any(stat.S_ISFIFO(x.lstat().st_mode) for x in store.dir.rglob("*"))


@pytest.fixture(params=["native", "native-one-pwritev", "native-odd-window", "native-2-threads", "python"])
def write_path(request, monkeypatch):
    from dsakv.cache.storage import file as file_mod

    if request.param == "python":
        monkeypatch.setattr(native, "_LIB", False)
    elif native.lib() is None:
        pytest.skip("no C compiler: the native path is not built")
    monkeypatch.setattr(file_mod, "WRITE_THREADS", 2 if request.param == "native-2-threads" else 1)
    if request.param == "native-one-pwritev":  # record + payload in one call (no windows)
        monkeypatch.setattr(file_mod, "WRITE_WINDOW", 0)
    if request.param == "native-odd-window":  # windows that split segments at odd offsets
        monkeypatch.setattr(file_mod, "WRITE_WINDOW", 1000)
    return request.param


def test_disk_tier_writes_the_same_file_bytes_on_every_path(write_path, monkeypatch, tmp_path):
    """put (native batch write, its threads, or the Python loop) writes the same page files: header (magic,
    layout id, hash, payload size, page_checksum, nonce, tag) + the page's buffers in layout order, the nonce
    fresh for every page and the tag exactly the pure-Python reference Poly1305(HMAC-SHA256(the directory's key
    file, domain | nonce | layout id | hash | u64 size), payload); read back on the Python path, each page's
    bytes are exact."""
    from dsakv.cache.storage.base import KEY_FILE, MAC_DOMAIN, META, META_MAC_AT, META_MAGIC, NONCE_BYTES, page_checksum
    from dsakv.testing.pagemac import page_tag

    src = _host("layer_first")
    store = _disk_store(tmp_path)
    hashes = store.page_hashes(np.arange(20) % 7 + 2)
    segs = _segs(src, SRC_IDS)
    assert store.put(hashes, segs) == 5 and store.put(hashes, segs) == 0  # the second finds them all on disk
    assert sorted(p.name for p in store.dir.rglob("*") if p.is_file()) == sorted(f"{h}.page" for h in hashes)
    key = bytes.fromhex((tmp_path / KEY_FILE).read_text().strip())
    nonces = set()
    for h, i, sg in zip(hashes, SRC_IDS, segs, strict=True):
        payload = b"".join(src.view(b.key)[i].numpy().tobytes() for b in DISK_LAYOUT.buffers)
        raw = store.path(h).read_bytes()
        nonce = raw[META_MAC_AT : META_MAC_AT + NONCE_BYTES]
        nonces.add(nonce)
        tag = page_tag(key, MAC_DOMAIN, store.layout_id, h, nonce, payload)
        head = META.pack(
            META_MAGIC, store.layout_id.encode(), h.encode(), DISK_LAYOUT.bytes_per_page, page_checksum(sg), nonce + tag
        )
        assert page_checksum(sg) == _word_sum(payload)
        assert raw == head + payload, h
    assert len(nonces) == 5
    monkeypatch.setattr(native, "_LIB", False)
    dst = _host("page_first", fill=0)
    assert store.get(hashes, _segs(dst, DST_IDS)).n == 5
    for key in src.keys:
        assert torch.equal(dst.view(key)[DST_IDS], src.view(key)[SRC_IDS]), key


def test_disk_tier_write_failure_writes_a_prefix(write_path, tmp_path):
    """Page 1's subdirectory is taken by a regular file: put writes page 0 only, on every path (the native
    threads' share after the failure is removed again), leaves no temporary behind, and indexes only page 0."""
    src = _host("layer_first")
    store = _disk_store(tmp_path)
    hashes = store.page_hashes(np.arange(20) % 7 + 2)
    assert hashes[1][:2] not in {h[:2] for h in hashes[:1] + hashes[2:]}  # the test's premise
    (store.dir / hashes[1][:2]).write_bytes(b"not a directory")
    assert store.put(hashes, _segs(src, SRC_IDS)) == 1
    assert [store.contains(h) for h in hashes] == [True, False, False, False, False]
    on_disk = sorted(p.name for p in store.dir.rglob("*") if p.is_file())
    assert on_disk == sorted([f"{hashes[0]}.page", hashes[1][:2]])
    assert store.used_bytes == store.file_bytes
