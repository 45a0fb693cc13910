"""MooncakeBackend: mooncake.engine.TransferEngine in P2P-handshake mode (no metadata server).

    engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")   port picked by the engine (get_rpc_port)
    meta = b"127.0.0.1:<rpc port>"                              the session name peers write to

What the engine does, measured with mooncake-transfer-engine-non-cuda 0.3.13 over TCP:
- register_memory(addr, 0) -> -1; an overlapping region -> -7. Both checked here.
- get_first_buffer_address(session) opens the segment (handshake): 0 for an unreachable peer, at once.
- batch_transfer_async_write(...) -> batch id, 0 when the submission is refused.
- get_batch_transfer_status([id]) BLOCKS (busy-waits a core) until done: 0, or -1 on failure or after
  MC_TRANSFER_TIMEOUT seconds (default 30, minimum 5) + 1 ns per byte. A peer that died costs ~1 s
  per call; a hung (stopped) peer costs the full engine timeout. So it runs on one worker thread per
  peer, and poll() reports a timeout at the caller's deadline while that thread is still blocked.
- More than ~2,048 descriptors in flight to one peer are rejected ("TCP lane queue-full"), and
  the peer refuses everything for ~1 s after. Batches are split to 1,024 descriptors, or to
  min(MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER, MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER) when both
  are set higher.
- Over TCP the sender's source memory is NOT checked against its registrations; base.submit does it.
- INFO logs per call ("Batch Transfer completed!"): MC_LOG_LEVEL defaults to WARNING here.
Imports the engine lazily (in __init__). Imports disagg.backends.{base, registry}.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from dsakv.disagg.protocol.errors import TransferError, TransferTimeout
from dsakv.disagg.transfer.backends.base import Peer, Span, TransferBackend, TransferStatus
from dsakv.disagg.transfer.backends.registry import register_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.plan import Blocks

log = logging.getLogger(__name__)

DEFAULT_TCP_BATCH = 1024
_BAD_BATCH_IDS = (0, (1 << 64) - 1)


def mooncake_batch_limit() -> int:
    """Descriptors per batch the TCP transport accepts for one peer (see module docstring)."""
    vals = []
    for name in ("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER"):
        raw = os.environ.get(name, "")
        vals.append(int(raw) if raw.strip().isdigit() else 0)
    return max(DEFAULT_TCP_BATCH, min(vals))


@dataclass
class _Job:
    session: str
    peer: str
    batches: list[Blocks]
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False
    error: TransferError | None = None


class _PeerWorker:
    """One daemon thread per peer: runs that peer's batches one after another (the engine's queue is per peer)."""

    def __init__(self, engine: Any, session: str) -> None:
        self.engine = engine
        self.session = session
        self.jobs: queue.Queue[_Job | None] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, name=f"mooncake-{session}", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job.error = self._run(job)
            except Exception as e:  # a binding error must not kill the worker
                job.error = TransferError(f"mooncake: {type(e).__name__}: {e}", backend="mooncake")
            job.done.set()

    def _run(self, job: _Job) -> TransferError | None:
        n = len(job.batches)
        for i, b in enumerate(job.batches):
            if job.cancelled or time.monotonic() >= job.deadline:
                return TransferTimeout(
                    f"mooncake -> {job.peer} ({self.session}): stopped before batch {i + 1}/{n} (deadline)",
                    backend="mooncake",
                )
            bid = self.engine.batch_transfer_async_write(
                self.session, b.src.tolist(), b.dst.tolist(), b.length.tolist()
            )
            if bid in _BAD_BATCH_IDS or bid < 0:
                return TransferError(
                    f"mooncake -> {job.peer} ({self.session}): batch {i + 1}/{n} ({len(b)} blocks, {b.nbytes} B) "
                    f"refused at submission (batch id {bid}): peer unreachable",
                    backend="mooncake",
                    code=-1,
                )
            rc = self.engine.get_batch_transfer_status([bid])
            if rc != 0:
                return TransferError(
                    f"mooncake -> {job.peer} ({self.session}): batch {i + 1}/{n} ({len(b)} blocks, {b.nbytes} B) "
                    f"failed with engine code {rc} (peer dead, hung past MC_TRANSFER_TIMEOUT, a destination "
                    "outside its registered memory, or its queue full)",
                    backend="mooncake",
                    code=rc,
                )
        return None


@register_backend
class MooncakeBackend(TransferBackend):
    name = "mooncake"
    default_max_blocks_per_batch = DEFAULT_TCP_BATCH
    quarantine_s = 30.0  # MC_TCP_PROGRESS_TIMEOUT_SEC: a stuck session is dropped after this

    def __init__(
        self,
        hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        device_name: str = "",
        metadata_server: str = "P2PHANDSHAKE",
        max_blocks_per_batch: int | None = None,
        engine_timeout_s: int | None = None,
    ) -> None:
        super().__init__(max_blocks_per_batch or mooncake_batch_limit())
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        if engine_timeout_s is not None:  # read by TransferEngine() at construction; the engine's floor is 5 s
            os.environ["MC_TRANSFER_TIMEOUT"] = str(max(5, int(engine_timeout_s)))
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise TransferError(
                "the mooncake backend needs the package mooncake-transfer-engine-non-cuda (module mooncake.engine): "
                f"pip install it, or choose another backend ({e})",
                backend=self.name,
            ) from None
        self._engine = TransferEngine()
        host = hostname.rsplit(":", 1)[0] if hostname.count(":") == 1 else hostname
        rc = self._engine.initialize(hostname, metadata_server, protocol, device_name)
        if rc != 0:
            raise TransferError(
                f"mooncake: TransferEngine.initialize({hostname!r}, {metadata_server!r}, {protocol!r}, "
                f"{device_name!r}) failed with code {rc}",
                backend=self.name,
                code=rc,
            )
        self.session = f"{host}:{self._engine.get_rpc_port()}"
        self._workers: dict[str, _PeerWorker] = {}
        self._lock = threading.Lock()
        log.info(
            "mooncake: engine at %s (%s, %s), %d blocks per batch",
            self.session,
            protocol,
            metadata_server,
            self.max_blocks_per_batch,
        )

    def _engine_register(self, key: Hashable, span: Span) -> int | str:
        return int(self._engine.register_memory(span.addr, span.nbytes))

    def _engine_unregister(self, key: Hashable, span: Span) -> int | str:
        return int(self._engine.unregister_memory(span.addr))

    def _engine_meta(self) -> bytes:
        return self.session.encode()

    def _engine_connect(self, meta: bytes, manifest: Manifest) -> Any:
        session = meta.decode(errors="replace")
        host, _, port = session.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(
                f"mooncake: peer {manifest.worker!r} published session {session!r}, expected host:port",
                backend=self.name,
            )
        first = int(self._engine.get_first_buffer_address(session))
        if first == 0:
            raise TransferError(
                f"mooncake: peer {manifest.worker!r} at {session} is unreachable (P2P handshake failed) or has "
                "registered no memory",
                backend=self.name,
                code=0,
            )
        return session

    def _worker(self, session: str) -> _PeerWorker:
        with self._lock:
            w = self._workers.get(session)
            if w is None:
                w = self._workers[session] = _PeerWorker(self._engine, session)
            return w

    def _engine_submit(self, peer: Peer, batches: list[Blocks], deadline: float) -> Any:
        job = _Job(str(peer.address), peer.name, batches, deadline)
        self._worker(job.session).jobs.put(job)
        return job

    def _engine_poll(self, job: Any) -> tuple[TransferStatus, TransferError | None]:
        if not job.done.is_set():
            return TransferStatus.PENDING, None
        return (TransferStatus.FAILED, job.error) if job.error else (TransferStatus.DONE, None)

    def _engine_wait(self, job: Any, timeout: float) -> None:
        job.done.wait(timeout)

    def _engine_cancel(self, job: Any) -> None:
        job.cancelled = True

    def _engine_close(self) -> None:
        with self._lock:
            for w in self._workers.values():
                w.jobs.put(None)  # a worker blocked in the engine exits after its call returns
            self._workers.clear()
