"""StagingBuffer: one registered host buffer a sender gathers a fragmented request's pages into.

    staging = StagingBuffer(backend, nbytes)    allocated and registered with the backend (key STAGING_KEY)
    if plan.choose() is Strategy.STAGED and staging.acquire(plan.nbytes):
        staged = plan.staged(staging.addr)
        staging.gather(staged)                   every key's source pages, key-major, request order
        h = backend.submit(peer, staged.blocks, deadline) ... backend.wait(h)
        staging.release(quarantine_s)            after the transfer ended (a timed-out one: after quarantine)

One transfer holds it at a time (acquire fails while it is held, or when the plan does not fit: the caller
then sends the plan's own blocks). The gather runs on the sender's thread before submit, so the bytes the
engine reads are final; the receiver sees nothing different (same destination pages, fewer descriptors).
Source regions are read through numpy views of the registered addresses (the sender's own pool).
Imports numpy, disagg.{backends.base, transfer_plan}.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dsakv.disagg.backends.base import TransferBackend
from dsakv.disagg.transfer_plan import Strategy, TransferPlan

log = logging.getLogger(__name__)

STAGING_KEY = "transfer-staging"


@dataclass(frozen=True)
class _Region:
    addr: int
    page_bytes: int
    num_pages: int = 1


def _view(addr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(addr)).cast("B"), dtype=np.uint8)


class StagingBuffer:
    def __init__(self, backend: TransferBackend, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging buffer of {nbytes} B: give a positive size (or no staging buffer)")
        self.backend = backend
        self.nbytes = int(nbytes)
        self._mem = np.zeros(self.nbytes, dtype=np.uint8)  # touched: no page faults inside a transfer
        self.addr = int(self._mem.ctypes.data)
        backend.register({STAGING_KEY: _Region(self.addr, self.nbytes)})
        self._lock = threading.Lock()
        self._held = False
        self._free_at = 0.0
        self.used = 0  # transfers that went through it
        log.info("%s: staging buffer of %d B registered for fragmented transfers", backend.name, self.nbytes)

    def acquire(self, nbytes: int) -> bool:
        """Take the buffer for one transfer of `nbytes`; False if it is held, quarantined or too small."""
        with self._lock:
            if self._held or nbytes > self.nbytes or time.monotonic() < self._free_at:
                return False
            self._held = True
            return True

    def release(self, quarantine_s: float = 0.0) -> None:
        """Give the buffer back; after a timed-out transfer the engine may still read it for `quarantine_s`."""
        with self._lock:
            self._held = False
            self._free_at = time.monotonic() + max(0.0, quarantine_s)

    def gather(self, plan: TransferPlan) -> None:
        """Copy the plan's source pages into the buffer at plan.staging_offsets (a STAGED plan on this buffer)."""
        if plan.strategy is not Strategy.STAGED or plan.staging_addr != self.addr:
            raise ValueError("gather needs a plan made by plan.staged(staging.addr) for this buffer")
        if plan.nbytes > self.nbytes:
            raise ValueError(f"plan of {plan.nbytes} B does not fit the {self.nbytes} B staging buffer")
        t = plan.table
        n = plan.num_pages
        for k, off in enumerate(plan.staging_offsets.tolist()):
            pb, cap = int(t.page_bytes[k]), int(t.src_pages[k])
            src = _view(int(t.src_base[k]), pb * cap).reshape(cap, pb)
            dst = self._mem[off : off + n * pb].reshape(n, pb)
            np.take(src, plan.src_ids, axis=0, out=dst, mode="clip")  # ids checked by build
        self.used += 1

    def close(self) -> None:
        if STAGING_KEY in self.backend.registered:
            self.backend.unregister([STAGING_KEY])
