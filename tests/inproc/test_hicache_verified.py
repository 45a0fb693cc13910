"""Verified tiers (issue 11.4/11.5) on the file storage backend: flipped or NaN page payloads are dropped and
counted and never change a token; a FIFO, a directory or junk named like a page file neither hangs, crashes nor
counts against the cap; the weights fingerprint covers every byte (a mid-tensor change is a new identity) and is
computed once per checkpoint file identity."""

from __future__ import annotations

import os
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dsakv.cache import fingerprint
from dsakv.cache.fingerprint import weights_fingerprint
from dsakv.cache.storage.base import META
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.config import engine_config
from dsakv.testing.hicache import FILE, PS  # noqa: E402
from dsakv.testing.hicache import disk_cache as _cache  # noqa: E402
from dsakv.testing.hicache import run_request as _run  # noqa: E402
from dsakv.testing.hicache import toks as _toks  # noqa: E402

os.environ.setdefault("DSAKV_CACHE_DIR", tempfile.mkdtemp(prefix="dsakv-fp-"))
SP = SamplingParams(max_new_tokens=4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("verified") / "tiny", seed=0)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(9)
    return [rng.integers(2, 500, 33).tolist() for _ in range(3)]


def _pages(d: Path) -> list[Path]:
    return sorted(p for p in d.rglob("*.page") if p.is_file())


def _same_sum_damage(b: bytearray, how: str, i: int) -> None:
    """Damage a position-blind word sum cannot see: two payload words swapped, or bit 0 set in one word and
    cleared in another (two compensating flips)."""
    nw = (len(b) - META.size) // 8
    w = np.frombuffer(bytes(b), dtype=np.uint64, count=nw, offset=META.size).copy()
    before = int(w.sum(dtype=np.uint64))
    if how == "swap":
        j, k = 3 + i, nw // 2 + i
        k = next(x for x in range(k, nw) if w[x] != w[j])
        w[j], w[k] = w[k], w[j]
    else:
        j = next(x for x in range(3 + i, nw) if w[x] & 1 == 0)
        k = next(x for x in range(nw // 2, nw) if w[x] & 1 == 1)
        w[j] ^= np.uint64(1)
        w[k] ^= np.uint64(1)
    assert int(w.sum(dtype=np.uint64)) == before
    b[META.size : META.size + 8 * nw] = w.tobytes()


@pytest.mark.parametrize("damage", ["flip", "nan", "swap", "compensating"])
def test_corrupt_payloads_never_change_a_token(tiny_dir: Path, tmp_path: Path, damage: str) -> None:
    """Damaged page 1 of each of 3 chains: any damage (a flip, a NaN, and what a word sum cannot see: swapped
    words, compensating flips) is refused and counted; tokens are exactly the no-tier run's, before, after and
    across restarts."""
    prompts = _prompts()
    base = [Engine(tiny_dir, engine_config(page_size=PS, max_tokens=80)).generate([p], SP)[0] for p in prompts]
    first = Engine(tiny_dir, engine_config(page_size=PS, max_tokens=80, hicache_disk_dir=tmp_path))
    assert [first.generate([p], SP)[0] for p in prompts] == base
    assert len(_pages(tmp_path)) == 3 * 9  # 36 tokens of KV per request
    disk: Any = first.prefix_cache.disk  # type: ignore[union-attr]
    bad = [disk.path(disk.page_hashes(p)[1]) for p in prompts]  # page 1 of each chain
    for i, p in enumerate(bad):
        b = bytearray(p.read_bytes())
        if damage == "flip":
            b[META.size + 17 + i] ^= 0x01
        elif damage == "nan":  # an fp32 NaN over the first KV value (the header stays valid)
            b[META.size : META.size + 4] = np.array([np.nan], dtype=np.float32).tobytes()
        else:
            _same_sum_damage(b, damage, i)
        p.write_bytes(bytes(b))
    second = Engine(
        tiny_dir, engine_config(page_size=PS, max_tokens=80, hicache_disk_dir=tmp_path), check_every_step=True
    )
    assert [second.generate([p], SP)[0] for p in prompts] == base
    s = second.cache_stats()
    # each prompt loads its page 0, stops at the corrupt page 1 and computes the rest
    assert s is not None and (s["storage_corrupt_pages"], s["disk_hit_tokens"], s["disk_read_pages"]) == (3, 12, 3)
    assert second.prefix_cache.disk.corrupt_pages == 3  # type: ignore[union-attr]
    assert all(p.exists() for p in bad)  # deleted, then written back by the recompute
    for _ in range(2):  # restarted twice: every page (the rewritten ones too) loads, the same tokens
        third = Engine(tiny_dir, engine_config(page_size=PS, max_tokens=80, hicache_disk_dir=tmp_path))
        assert [third.generate([p], SP)[0] for p in prompts] == base
        s = third.cache_stats()
        assert s is not None and (s["storage_corrupt_pages"], s["disk_hit_tokens"]) == (0, 3 * 32)


@pytest.mark.timeout(60)
def test_fifo_dir_and_junk_named_like_pages(tmp_path: Path) -> None:
    c = _cache(tmp_path, cap=None)
    a, b = _toks(1, 13), _toks(2, 13)
    _run(c, a)
    _run(c, b)
    d = c.disk
    assert d is not None
    ha, hb = d.page_hashes(a), d.page_hashes(b)
    # after start-up: a page file swapped for a FIFO must not hang a read (no writer will ever come)
    p = d.path(ha[1])
    p.unlink()
    os.mkfifo(p)
    c2 = _cache(tmp_path, cap=None)  # start-up deletes the FIFO (not a regular file)
    assert not p.exists()
    os.mkfifo(p)  # the first cache still indexes page 1: its read meets the FIFO
    done = threading.Event()
    result: list[int] = []

    def read() -> None:
        m = c.match_prefix(a)
        result.append(m.disk_pages)
        c.release(m)
        done.set()

    c.clear()
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert done.wait(20), "reading a FIFO named like a page hung"
    assert result == [1] and not p.exists()  # page 0 read, the FIFO dropped as junk, page 1 a miss
    # a directory named like a page, junk of the wrong size, an old-format file, a leftover temporary
    q = d.path(hb[2])
    q.unlink()
    q.mkdir()
    junk = d.path("e" * 64)
    junk.parent.mkdir(exist_ok=True)
    junk.write_bytes(b"x" * 10)
    old = d.path("f" * 64)
    old.parent.mkdir(exist_ok=True)
    old.write_bytes(b"DSAKVPG1" + b"\0" * (FILE - 8 - 8))  # the v1 header was 8 B shorter
    tmp = d.path(hb[0]).with_name(f".{hb[0]}.abcd1234.tmp")
    tmp.write_bytes(b"partial")
    c3 = _cache(tmp_path, cap=3 * FILE)  # a cap: the directory is skipped, never counted or evicted
    assert c3.disk is not None and q.is_dir() and not junk.exists() and not old.exists() and not tmp.exists()
    assert c3.disk.junk_deleted == 3 and c3.disk.used_bytes <= 3 * FILE
    assert c3.disk.disk_bytes() == c3.disk.used_bytes
    # eviction that hits a page path turned into a directory does not crash
    keep = c3.disk.page_hashes(a)[0]
    if c3.disk.contains(keep):
        kp = c3.disk.path(keep)
        kp.unlink()
        kp.mkdir()
    for seed in range(3, 7):
        _run(c3, _toks(seed, 9))
    c3.check_integrity()
    assert c3.disk.used_bytes <= 3 * FILE
    assert all(stat.S_ISDIR(x.stat().st_mode) or x.stat().st_size == FILE for x in c3.disk.dir.rglob("*.page"))
    c2.check_integrity()


def test_fingerprint_covers_every_byte_and_is_cached_by_file_identity(tiny_dir: Path, tmp_path: Path) -> None:
    spec, model = load_model(tiny_dir)
    fp = weights_fingerprint(model)
    name, t = max(model.state_dict().items(), key=lambda kv: kv[1].numel())
    with torch.no_grad():
        flat = t.view(-1)
        mid = flat.numel() // 2
        old = flat[mid].clone()
        flat[mid] += 1.0  # one value in the middle of the largest tensor
        assert weights_fingerprint(model) != fp
        flat[mid] = old
    assert weights_fingerprint(model) == fp
    assert weights_fingerprint(model.to(torch.float64)) != fp  # same weights, other dtype: other KV
    model.to(torch.float32)
    # from the checkpoint: the same value as in memory, computed once per file identity
    assert weights_fingerprint(model, tiny_dir) == fp
    calls: list[int] = []
    real = fingerprint.tensors_digest

    def counting(m: Any) -> str:
        calls.append(1)
        return real(m)

    fingerprint.tensors_digest = counting  # type: ignore[assignment]
    try:
        fingerprint._memo.clear()  # a new process: the on-disk cache answers
        assert weights_fingerprint(model, tiny_dir) == fp and calls == []
    finally:
        fingerprint.tensors_digest = real  # type: ignore[assignment]


def test_same_size_same_mtime_rewrite_invalidates_stored_pages(tiny_dir: Path, tmp_path: Path) -> None:
    """One value mid-tensor rewritten in place, the file's size and mtime (os.utime) restored: a new weights
    fingerprint (inode, size, mtime and ctime name a file's content; ctime moved), so the old weights' pages are
    never read and the tokens are the new weights' exactly."""
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_dir, ckpt)
    prompts = _prompts()
    first = Engine(ckpt, engine_config(page_size=PS, max_tokens=80, hicache_disk_dir=tmp_path / "disk"))
    [first.generate([p], SP)[0] for p in prompts]
    (f,) = sorted(ckpt.glob("*.safetensors"))
    tensors = load_file(f)
    key = next(k for k in sorted(tensors) if "kv_a_proj" in k)  # feeds the cached KV of layer 0
    w = tensors[key].clone()
    w.view(-1)[w.numel() // 2] += 0.5
    tensors[key] = w
    before = f.stat()
    data = tmp_path / "rewritten.safetensors"
    save_file(tensors, data, metadata={"format": "pt"})
    with open(f, "r+b") as out:  # in place: the same inode, the same size
        out.write(data.read_bytes())
    os.utime(f, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = f.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert f.read_bytes() == data.read_bytes()
    new_base = [Engine(ckpt, engine_config(page_size=PS, max_tokens=80)).generate([p], SP)[0] for p in prompts]
    second = Engine(ckpt, engine_config(page_size=PS, max_tokens=80, hicache_disk_dir=tmp_path / "disk"))
    assert [second.generate([p], SP)[0] for p in prompts] == new_base
    s = second.cache_stats()
    assert s is not None and s["disk_hit_tokens"] == 0  # the old weights' pages are never read
