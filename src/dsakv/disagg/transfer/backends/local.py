"""LocalBackend: same-process memcpy between two backends, for unit tests.

It behaves like a real engine where it matters to the layer above: a
registration overlapping a registered span is refused (code -7, as mooncake) and
so is address 0 (code -1); a destination outside the peer's registered spans
fails the transfer (code -1); a closed peer is unreachable. `latency_s`
delays completion (the copy happens when the transfer completes), so deadline
and cancellation paths can be tested without a network. Imports ctypes and
disagg.backends.{base, registry}.
"""

from __future__ import annotations

import ctypes
import time
import uuid
import weakref
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from dsakv.disagg.protocol.errors import TransferError
from dsakv.disagg.transfer.backends.base import Peer, Span, SpanTable, TransferBackend, TransferStatus
from dsakv.disagg.transfer.backends.registry import register_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.plan import Blocks

_LIVE: dict[str, weakref.ref[LocalBackend]] = {}

CODE_OVERLAP = -7
CODE_INVALID = -1


@dataclass
class _LocalJob:
    peer_id: str
    batches: list[Blocks]
    ready_at: float
    cancelled: bool = False
    state: TransferStatus = TransferStatus.PENDING
    error: TransferError | None = None


@register_backend
class LocalBackend(TransferBackend):
    name = "local"

    def __init__(self, max_blocks_per_batch: int | None = None, latency_s: float = 0.0) -> None:
        super().__init__(max_blocks_per_batch)
        self.latency_s = float(latency_s)
        self.id = uuid.uuid4().hex
        self._engine_spans: dict[Hashable, Span] = {}  # what the "engine" holds, apart from the base's books
        _LIVE[self.id] = weakref.ref(self)

    def _engine_register(self, key: Hashable, span: Span) -> int | str:
        if span.addr == 0:
            return CODE_INVALID
        for other in self._engine_spans.values():
            if span.addr < other.end and other.addr < span.end:
                return CODE_OVERLAP
        self._engine_spans[key] = span
        return 0

    def _engine_unregister(self, key: Hashable, span: Span) -> int | str:
        return 0 if self._engine_spans.pop(key, None) is not None else CODE_INVALID

    def _engine_meta(self) -> bytes:
        return self.id.encode()

    def _engine_connect(self, meta: bytes, manifest: Manifest) -> Any:
        peer_id = meta.decode(errors="replace")
        if self._resolve(peer_id) is None:
            raise TransferError(f"local: peer {manifest.worker!r} ({peer_id}) is gone", backend=self.name, code=-1)
        return peer_id

    @staticmethod
    def _resolve(peer_id: str) -> LocalBackend | None:
        ref = _LIVE.get(peer_id)
        target = ref() if ref is not None else None
        return None if target is None or target.closed else target

    def _engine_submit(self, peer: Peer, batches: list[Blocks], deadline: float) -> Any:
        job = _LocalJob(str(peer.address), batches, time.monotonic() + self.latency_s)
        self._advance(job)
        return job

    def _advance(self, job: _LocalJob) -> None:
        if job.state is not TransferStatus.PENDING or job.cancelled or time.monotonic() < job.ready_at:
            return
        target = self._resolve(job.peer_id)
        if target is None:
            job.state, job.error = (
                TransferStatus.FAILED,
                TransferError(f"local: peer {job.peer_id} is gone", backend=self.name, code=-1),
            )
            return
        table = SpanTable(target._engine_spans)
        for b in job.batches:
            i = table.first_outside(b.dst, b.length)
            if i is not None:
                job.state, job.error = (
                    TransferStatus.FAILED,
                    TransferError(
                        f"local: destination {int(b.dst[i]):#x} is not registered on the peer",
                        backend=self.name,
                        code=CODE_INVALID,
                    ),
                )
                return
            for s, d, n in zip(b.src.tolist(), b.dst.tolist(), b.length.tolist(), strict=True):
                ctypes.memmove(d, s, n)
        job.state = TransferStatus.DONE

    def _engine_poll(self, job: Any) -> tuple[TransferStatus, TransferError | None]:
        self._advance(job)
        return job.state, job.error

    def _engine_cancel(self, job: Any) -> None:
        job.cancelled = True

    def _engine_close(self) -> None:
        _LIVE.pop(self.id, None)
