"""Staging: registered host memory that turns many small transfer blocks into few large ones.

StagingBuffer (sender): one buffer a prefill stage gathers a fragmented request's source pages into.

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

StagingSlots (decode): a registered region of `num_slots` slots, published in the decode's manifest
(Manifest.staging), for requests whose *destination* pages are fragmented:

    slots = StagingSlots(backend, slot_bytes, num_slots)  registered (key SLOTS_KEY) before backend.meta()
    i = slots.acquire(rid, nbytes)                         prealloc, when choose_destination says STAGED; None:
                                                           none free / too small -> the request goes BLOCKS
    grant names (i, pages) ─► every prefill stage writes its pages into slot i (Manifest.slot_offsets layout)
    slots.scatter(i, pool regions, keys, pages, dst_ids)   every stage reported ok: slot -> the request's pages
    slots.release(i, rid)                                  after the scatter, or when the failed request's pages
                                                           are freed (late writes may land in both until then)

A slot is held by one request (its id); acquire never waits. Imports numpy, disagg.{backends.base,
manifest, transfer_plan}, spec.
"""

from __future__ import annotations

import ctypes
import logging
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from dsakv.disagg.transfer.backends.base import TransferBackend
from dsakv.disagg.transfer.manifest import Manifest, RegionLike, SlotRegion
from dsakv.disagg.transfer.plan import Strategy, TransferPlan, choose_destination
from dsakv.spec.layout import BufferKey

log = logging.getLogger(__name__)

STAGING_KEY = "transfer-staging"
SLOTS_KEY = "transfer-staging-slots"


@dataclass(frozen=True)
class _Region:
    addr: int
    page_bytes: int
    num_pages: int = 1


def _view(addr: int, nbytes: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(memoryview((ctypes.c_uint8 * nbytes).from_address(addr)).cast("B"), dtype=np.uint8)


def _registered(backend: TransferBackend, key: str, nbytes: int) -> tuple[npt.NDArray[np.uint8], int]:
    """A host buffer of `nbytes`, touched up front (np.zeros maps lazily: no page faults inside a transfer or a
    scatter) and registered with `backend` under `key`; (buffer, address)."""
    mem = np.zeros(nbytes, dtype=np.uint8)
    mem.fill(0)
    addr = int(mem.ctypes.data)
    backend.register({key: _Region(addr, nbytes)})
    return mem, addr


class StagingBuffer:
    def __init__(self, backend: TransferBackend, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError(f"staging buffer of {nbytes} B: give a positive size (or no staging buffer)")
        self.backend = backend
        self.nbytes = int(nbytes)
        self._mem, self.addr = _registered(backend, STAGING_KEY, self.nbytes)
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


class StagingSlots:
    """A decode's destination-staging region: `num_slots` slots of `slot_bytes`, registered with `backend`."""

    def __init__(self, backend: TransferBackend, slot_bytes: int, num_slots: int) -> None:
        if slot_bytes <= 0 or num_slots <= 0:
            raise ValueError(f"{num_slots} staging slots of {slot_bytes} B: give positive sizes (or no slots)")
        self.backend = backend
        self.slot_bytes = int(slot_bytes)
        self.num_slots = int(num_slots)
        self._mem, self.addr = _registered(backend, SLOTS_KEY, self.slot_bytes * self.num_slots)
        self._lock = threading.Lock()
        self._owner: dict[int, str] = {}
        self.used = 0  # slots scattered
        log.info(
            "%s: %d destination staging slots of %d B registered for fragmented destinations",
            backend.name, self.num_slots, self.slot_bytes,
        )  # fmt: skip

    @property
    def region(self) -> SlotRegion:
        return SlotRegion(self.addr, self.slot_bytes, self.num_slots)

    def acquire(self, owner: str, nbytes: int) -> int | None:
        """A free slot for `owner` (a request id) that holds `nbytes`; None if none is free or it does not fit."""
        if nbytes > self.slot_bytes or nbytes <= 0:
            return None
        with self._lock:
            for i in range(self.num_slots):
                if i not in self._owner:
                    self._owner[i] = owner
                    return i
        return None

    def release(self, index: int, owner: str) -> None:
        """Give slot `index` back; only its holder may (a mismatch is a bug and raises)."""
        with self._lock:
            held = self._owner.get(index)
            if held != owner:
                raise AssertionError(f"staging slot {index} is held by {held!r}, not {owner!r}: not released")
            del self._owner[index]

    def held(self) -> dict[int, str]:
        with self._lock:
            return dict(self._owner)

    @property
    def free(self) -> int:
        with self._lock:
            return self.num_slots - len(self._owner)

    def view(self, index: int) -> npt.NDArray[np.uint8]:
        if not 0 <= index < self.num_slots:
            raise ValueError(f"staging slot {index} is not within 0..{self.num_slots - 1}")
        return self._mem[index * self.slot_bytes : (index + 1) * self.slot_bytes]

    def scatter(
        self,
        index: int,
        manifest: Manifest,
        regions: Mapping[BufferKey, RegionLike],
        keys: Iterable[BufferKey],
        dst_pages: Sequence[int] | npt.NDArray[np.int64],
    ) -> int:
        """Copy slot `index` (laid out by manifest.slot_offsets(len(dst_pages))) into `dst_pages` of each of
        `keys` in the pool `regions` (host memory); returns the bytes copied."""
        dst = np.asarray(dst_pages, dtype=np.int64)
        n = int(dst.size)
        slot = self.view(index)
        offsets = manifest.slot_offsets(n)
        copied = 0
        for key in keys:
            reg = regions[key]
            pb, cap = int(reg.page_bytes), int(reg.num_pages)
            if n and (int(dst.min()) < 0 or int(dst.max()) >= cap):
                raise ValueError(f"scatter: pages {int(dst.min())}..{int(dst.max())} outside {key}'s {cap} pages")
            off = offsets[key]
            if off + n * pb > self.slot_bytes:
                raise ValueError(f"scatter: {key} at +{off} ({n} pages) runs past the {self.slot_bytes} B slot")
            pool = _view(int(reg.addr), pb * cap).reshape(cap, pb)
            pool[dst] = slot[off : off + n * pb].reshape(n, pb)
            copied += n * pb
        self.used += 1
        return copied

    def close(self) -> None:
        if SLOTS_KEY in self.backend.registered:
            self.backend.unregister([SLOTS_KEY])


class _StageEntryLike(Protocol):
    @property
    def skipped(self) -> list[str]: ...


def written_keys(manifest: Manifest, entries: Iterable[_StageEntryLike]) -> tuple[BufferKey, ...]:
    """The decode keys a request's prefill stages write: all but the one-sided index-K they skip."""
    skipped = {s for e in entries for s in e.skipped}
    return tuple(k for k in manifest.keys if str(k) not in skipped)


def offer_slot(
    slots: StagingSlots | None,
    manifest: Manifest,
    rid: str,
    dst_pages: Sequence[int],
    keys: Sequence[BufferKey],
    backend: str,
    force: str = "",
) -> tuple[int, bool]:
    """The decode's choice at prealloc for the pages the prefill writes (`dst_pages`): (slot, wanted). slot >= 0:
    a staging slot held for `rid` (choose_destination said STAGED, or `force` == "staged"); -1: write the pages
    directly, and wanted says whether the rule wanted a slot but none was free or big enough."""
    if slots is None or force == "blocks" or not dst_pages:
        return -1, False
    n = len(dst_pages)
    written = n * sum(manifest.region(k).page_bytes for k in keys)
    if force != "staged" and choose_destination(len(keys), np.asarray(dst_pages), written, backend) is Strategy.BLOCKS:
        return -1, False
    i = slots.acquire(rid, n * manifest.bytes_per_page)
    return (-1, True) if i is None else (i, True)


def decode_slots(backend: TransferBackend, region_bytes: int, num_slots: int, pipelined: bool) -> StagingSlots | None:
    """The decode's StagingSlots (region_bytes split into num_slots), or None: off (0), or a pipelined decode
    (each decode stage would need its own region and scatter: not built, its transfers stay BLOCKS)."""
    if region_bytes <= 0 or num_slots <= 0:
        return None
    if pipelined:
        log.info(
            "destination staging is off on a pipelined decode (--pp-size > 1): every decode stage would need "
            "its own slots and scatter; fragmented destinations are written page run by page run"
        )
        return None
    return StagingSlots(backend, region_bytes // num_slots, num_slots) if region_bytes >= num_slots else None
