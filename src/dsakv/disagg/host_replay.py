"""Host-tier page copies of a PP prefill worker, recorded on stage 0 and replayed on every later stage.

Stage 0's HiCache decides every move between its DevicePool and its HostPool (offload device -> host on a write
policy's backup, load host -> device on a host hit). Every stage keeps its own layers' KV for the same page ids,
so each move must happen on every stage, in the same order relative to the steps:

    rec = RecordingHostPool(cache.host)       stage 0: wraps the cache's HostPool, logs each copy's page ids
    ops = rec.drain()                         sent with the next step/tick metadata (before that step's batch)
    replay(ops, host_pool, device_pool)       stage k > 0: applied to its own pools before it computes the step

Ops are [kind, int64 bytes of source page ids, int64 bytes of destination page ids], kind "o" (offload: device
ids -> host ids) or "l" (load: host ids -> device ids). Imports numpy and dsakv.cache only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.host_pool import HostPool


class RecordingHostPool:
    """A HostPool that logs the page ids of every offload/load it performs (everything else is delegated)."""

    def __init__(self, inner: HostPool) -> None:
        self._inner = inner
        self._ops: list[list[Any]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def offload(self, device: DevicePool, dev_ids: npt.ArrayLike, host_ids: npt.ArrayLike) -> int:
        n = self._inner.offload(device, dev_ids, host_ids)
        self._ops.append(["o", _ids(dev_ids), _ids(host_ids)])
        return n

    def load(self, device: DevicePool, host_ids: npt.ArrayLike, dev_ids: npt.ArrayLike) -> int:
        n = self._inner.load(device, host_ids, dev_ids)
        self._ops.append(["l", _ids(host_ids), _ids(dev_ids)])
        return n

    def drain(self) -> list[list[Any]]:
        ops, self._ops = self._ops, []
        return ops


def _ids(a: npt.ArrayLike) -> bytes:
    return np.asarray(a, dtype=np.int64).reshape(-1).tobytes()


def replay(ops: list[Any], host: HostPool, device: DevicePool) -> tuple[int, int]:
    """Apply stage 0's recorded copies to this stage's pools, in order; returns (pages offloaded, pages loaded)."""
    off = loaded = 0
    for kind, src, dst in ops:
        a = np.frombuffer(src, dtype=np.int64).copy()
        b = np.frombuffer(dst, dtype=np.int64).copy()
        if a.size != b.size:
            raise ValueError(f"host replay: op {kind!r} has {a.size} source and {b.size} destination pages")
        if kind == "o":
            host.offload(device, a, b)
            off += int(a.size)
        elif kind == "l":
            host.load(device, a, b)
            loaded += int(a.size)
        else:
            raise ValueError(f"host replay: unknown op {kind!r} (expected 'o' offload or 'l' load)")
    return off, loaded
