"""A transfer peer in a child process: a real pool on a real backend, for tests and benchmarks.

    parent (sender)                                child (receiver), multiprocessing "spawn"
    ──────────────                                 ─────────────────────────────────────────
    PeerProcess(PeerSpec(layout, pages, "nixl"))   DevicePool(layout, pages) (zeros)
                                       ◄── pipe ── backend.register(pool.regions()); manifest bytes
    pair(mine, peer.manifest); connect; submit
    peer.checksums(pages)              ── pipe ──► blake2b of each key's pages, and non-zero bytes
                                       ◄────────── outside them (must stay 0)
    peer.scatter(slot, pages)          ── pipe ──► (with PeerSpec.staging_slots) StagingSlots.scatter of every
                                       ◄────────── key: slot -> pages; its seconds
    peer.stop() / peer.kill() / peer.pause()

The handshake is a multiprocessing Pipe (no port to allocate). Every call has
a timeout. Imports torch (through cache.device_pool), spec and disagg; never
engine or serve.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from dsakv.disagg.transfer.backends.registry import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.staging import StagingSlots
from dsakv.spec.layout import BufferKey, KVLayout
from dsakv.util.child import ChildProcess, answer
from dsakv.util.procs import arm_parent_death


@dataclass(frozen=True)
class PeerSpec:
    layout: KVLayout
    num_pages: int
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    worker: str = "peer"
    env: dict[str, str] = field(default_factory=dict)
    fill_seed: int | None = None  # None: zeros (a receiver); else deterministic random bytes
    staging_slots: tuple[int, int] | None = None  # (slot bytes, slots): a decode's destination staging region


def fill_random(pool: Any, seed: int) -> None:
    """Fill every buffer of a DevicePool with deterministic random bytes (one generator per key)."""
    import torch

    for i, key in enumerate(pool.keys):
        g = torch.Generator().manual_seed(seed * 100_003 + i)
        t = pool.tensor(key)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def page_checksums(pool: Any, pages: np.ndarray, keys: list[BufferKey] | None = None) -> dict[str, str]:
    """blake2b of the bytes of `pages` (in that order) for each key: {str(key): hex}."""
    import torch

    idx = torch.as_tensor(np.asarray(pages, dtype=np.int64))
    out = {}
    for key in keys if keys is not None else list(pool.keys):
        data = pool.tensor(key).index_select(0, idx).contiguous().numpy().tobytes()
        out[str(key)] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return out


def nonzero_outside(pool: Any, pages: np.ndarray) -> dict[str, int]:
    """Non-zero bytes of each key outside `pages` (a receiver's untouched pages must stay zero)."""
    import torch

    mask = torch.ones(pool.num_pages, dtype=torch.bool)
    mask[torch.as_tensor(np.asarray(pages, dtype=np.int64))] = False
    return {str(k): int(pool.tensor(k)[mask].count_nonzero()) for k in pool.keys}


def _child_main(conn: Connection, spec: PeerSpec, parent: int) -> None:
    arm_parent_death(parent, signal.SIGKILL)  # a killed test run takes its peers with it (Linux)
    for k, v in spec.env.items():
        os.environ[k] = v
    import torch

    from dsakv.cache.device_pool import DevicePool

    torch.set_num_threads(1)
    try:
        pool = DevicePool(spec.layout, spec.num_pages)
        if spec.fill_seed is not None:
            fill_random(pool, spec.fill_seed)
        backend = make_backend(spec.backend, **spec.backend_options)
        backend.register(pool.regions())
        slots = StagingSlots(backend, *spec.staging_slots) if spec.staging_slots is not None else None
        manifest = Manifest.from_pool(pool, backend.meta(), spec.worker, slots.region if slots else None)
        conn.send(("ok", manifest.to_bytes()))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return

    def scatter(args: tuple[int, np.ndarray]) -> float:
        assert slots is not None
        t0 = time.perf_counter()
        slots.scatter(args[0], manifest, pool.regions(), manifest.keys, args[1])
        return time.perf_counter() - t0

    handlers = {
        "checksums": lambda pages: page_checksums(pool, pages),
        "nonzero_outside": lambda pages: nonzero_outside(pool, pages),
    }
    if slots is not None:
        handlers["scatter"] = scatter
    answer(conn, handlers, backend.close)


class PeerProcess(ChildProcess):
    """Start a receiver (or sender) worker in a child process and read its manifest."""

    label = "peer"

    def __init__(self, spec: PeerSpec, start_timeout: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, spec, os.getpid())
        self.proc = ctx.Process(target=_child_main, args=args, name=f"dsakv-{spec.worker}", daemon=True)
        self.proc.start()
        child.close()
        self.manifest = Manifest.from_bytes(self._reply(start_timeout, "start"))

    def checksums(self, pages: np.ndarray) -> dict[str, str]:
        return dict(self.call("checksums", np.asarray(pages, dtype=np.int64)))

    def scatter(self, slot: int, pages: np.ndarray) -> float:
        """Scatter staging slot `slot` into `pages` (every key) in the child; the seconds it took there."""
        return float(self.call("scatter", (slot, np.asarray(pages, dtype=np.int64))))

    def nonzero_outside(self, pages: np.ndarray) -> dict[str, int]:
        return dict(self.call("nonzero_outside", np.asarray(pages, dtype=np.int64)))

    def pause(self) -> None:
        """SIGSTOP: the peer hangs (its sockets stay open, nothing answers)."""
        os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.pid, signal.SIGCONT)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
