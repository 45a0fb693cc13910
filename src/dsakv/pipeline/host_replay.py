"""Host-tier page copies of a pipeline, recorded on stage 0 and replayed on every later stage (the prefill pipeline's
host tier today).

Stage 0's HiCache decides every move between its DevicePool and its HostPool (offload device -> host on a write
policy's backup, load host -> device on a host hit). Every stage keeps its own layers' KV for the same page ids,
so each move must happen on every stage, in the same order relative to the steps:

    log = HostCopyLog(); cache.add_observer(log)     stage 0: HiCache tells it each copy's page ids
    ops = log.drain()                                sent with the next step/tick (the prefill: PrefillStep.host_ops)
    replay(ops, host_pool, device_pool)              stage k > 0: applied to its own pools before it computes

Ops are HostOp(kind, int64 bytes of source page ids, int64 bytes of destination page ids), kind "o" (offload:
device ids -> host ids) or "l" (load: host ids -> device ids); `HostOp.problem` says what is wrong with a received
one. Imports numpy and dsakv.cache only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.host_pool import HostPool

OFFLOAD = "o"
LOAD = "l"


@dataclass(frozen=True)
class HostOp:
    """One host-tier copy stage 0 made, to replay: kind "o" (device -> host) or "l" (host -> device)."""

    kind: str
    src: bytes  # int64 page ids
    dst: bytes

    def problem(self) -> str | None:
        """What is wrong with this op as received (None: nothing): its kind, or page-id bytes that do not pair."""
        if self.kind not in (OFFLOAD, LOAD):
            return f"kind {self.kind!r} is not 'o' (offload) or 'l' (load)"
        if len(self.src) % 8 or len(self.src) != len(self.dst):
            return f"{len(self.src)} source and {len(self.dst)} destination bytes are not pairs of int64 page ids"
        return None


class HostCopyLog:
    """A HiCache observer (cache.hicache.HostCopyObserver) that keeps the copies until drained."""

    def __init__(self) -> None:
        self._ops: list[HostOp] = []
        self._lock = threading.Lock()

    def on_offload(self, dev_ids: npt.ArrayLike, host_ids: npt.ArrayLike) -> None:
        with self._lock:
            self._ops.append(HostOp(OFFLOAD, _ids(dev_ids), _ids(host_ids)))

    def on_load(self, host_ids: npt.ArrayLike, dev_ids: npt.ArrayLike) -> None:
        with self._lock:
            self._ops.append(HostOp(LOAD, _ids(host_ids), _ids(dev_ids)))

    def drain(self) -> list[HostOp]:
        with self._lock:
            ops, self._ops = self._ops, []
        return ops


def _ids(a: npt.ArrayLike) -> bytes:
    return np.asarray(a, dtype=np.int64).reshape(-1).tobytes()


def replay(ops: list[HostOp], host: HostPool, device: DevicePool) -> tuple[int, int]:
    """Apply stage 0's recorded copies to this stage's pools, in order; returns (pages offloaded, pages loaded)."""
    off = loaded = 0
    for op in ops:
        a = np.frombuffer(op.src, dtype=np.int64).copy()
        b = np.frombuffer(op.dst, dtype=np.int64).copy()
        if a.size != b.size:
            raise ValueError(f"host replay: op {op.kind!r} has {a.size} source and {b.size} destination pages")
        if op.kind == OFFLOAD:
            host.offload(device, a, b)
            off += int(a.size)
        elif op.kind == LOAD:
            host.load(device, a, b)
            loaded += int(a.size)
        else:
            raise ValueError(f"host replay: unknown op {op.kind!r} (expected 'o' offload or 'l' load)")
    return off, loaded
