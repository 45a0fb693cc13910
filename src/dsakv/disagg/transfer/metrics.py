"""Transfer metrics: one record per finished transfer, and running totals per backend.

Counted per transfer: bytes, blocks, engine batches, seconds (submit to
completion or failure), and whether it failed (with the error). Imports nothing
from dsakv but the standard library.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class TransferMetrics:
    """What one transfer moved and how long it took. `error` is None when it succeeded."""

    backend: str
    peer: str
    nbytes: int
    blocks: int
    batches: int
    seconds: float
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def gbps(self) -> float:
        """GB/s (1e9 bytes per second) of a successful transfer; 0 for a failure or a zero duration."""
        return self.nbytes / self.seconds / 1e9 if self.ok and self.seconds > 0 else 0.0


@dataclass(frozen=True)
class TransferTotals:
    transfers: int
    failures: int
    bytes: int
    blocks: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class TransferStats:
    """Thread-safe running totals (successful bytes/blocks/seconds; every failure counted) plus recent records."""

    def __init__(self, keep: int = 256) -> None:
        self._lock = threading.Lock()
        self._recent: deque[TransferMetrics] = deque(maxlen=keep)
        self._transfers = self._failures = self._bytes = self._blocks = 0
        self._seconds = 0.0

    def record(self, m: TransferMetrics) -> None:
        with self._lock:
            self._recent.append(m)
            self._transfers += 1
            if m.ok:
                self._bytes += m.nbytes
                self._blocks += m.blocks
                self._seconds += m.seconds
            else:
                self._failures += 1

    def totals(self) -> TransferTotals:
        with self._lock:
            return TransferTotals(self._transfers, self._failures, self._bytes, self._blocks, self._seconds)

    def recent(self) -> list[TransferMetrics]:
        with self._lock:
            return list(self._recent)
