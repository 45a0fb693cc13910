"""The page MAC threads in a forked child: the pool is the process's own (cache/storage/base.py mac_pool)."""

from __future__ import annotations

import os

import torch

from dsakv.cache.host_pool import make_host_pool
from dsakv.cache.storage.base import NONCE_BYTES, PageMac
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec

LAYOUT = KVLayout(load_spec("tiny"), page_size=4)


def _pages(n: int) -> tuple[object, list[list[tuple[int, int]]]]:
    host = make_host_pool("layer_first", LAYOUT, n)
    g = torch.Generator().manual_seed(3)
    for key in host.keys:
        v = host.view(key)
        v.copy_(torch.randint(0, 256, v.shape, dtype=torch.uint8, generator=g))
    return host, [[(host.view(b.key)[i].data_ptr(), b.page_bytes) for b in LAYOUT.buffers] for i in range(n)]


def test_threaded_macs_work_in_a_forked_child() -> None:
    """The MAC threads are the process's own: a child forked after the parent used them (their threads do not
    survive a fork) gets a pool of its own and the same MACs, instead of waiting on dead threads."""
    key = os.urandom(32)
    host, segs = _pages(4)  # (host keeps the pages alive)
    hashes = [f"{i:064x}" for i in range(4)]
    nonces = [os.urandom(NONCE_BYTES) for _ in hashes]
    want = PageMac(key).tags("0123456789abcdef", hashes, nonces, segs, 2)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once, whatever happens
        try:
            ok = PageMac(key).tags("0123456789abcdef", hashes, nonces, segs, 2) == want
            os.write(w, b"1" if ok else b"0")
        finally:
            os._exit(0)
    os.close(w)
    try:
        import select

        ready, _, _ = select.select([r], [], [], 120)
        got = os.read(r, 1) if ready else b""
    finally:
        os.close(r)
        if not got:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert got == b"1"
