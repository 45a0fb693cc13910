"""TransferBackend: the contract every transfer engine (mooncake, nixl, local) is driven through.

Lifecycle of one worker:

    backend = make_backend("mooncake")          # registry, one class per engine
    backend.register(pool.regions())            # zero-length refused here; engine code checked;
                                                # a refusal unregisters what this call registered
    manifest = Manifest.from_pool(pool, backend.meta())   # meta only after registration
    ... exchange manifests, pairs = pair(mine, theirs) ...
    peer = backend.connect(their_manifest)      # fails fast for an unreachable peer
    h = backend.submit(peer, plan.blocks, deadline)       # async; blocks checked at the boundary
    backend.poll(h) -> PENDING | DONE | FAILED  # never blocks; FAILED once the deadline passes
    backend.wait(h) -> TransferMetrics          # or raises TransferError / TransferTimeout

The boundary check in `submit` refuses (TransferError, nothing sent) an empty
block list, a block of length <= 0, a source outside this backend's
registered regions, and a destination outside the peer's manifest regions:
engines do not all check (mooncake over TCP happily reads unregistered memory).

Deadlines are absolute `time.monotonic()` seconds (`deadline_in(s)`). A
transfer unfinished at its deadline is cancelled and fails with
TransferTimeout; the engine may still touch the pages for up to
`quarantine_s` seconds afterwards (a hung peer's socket), so a receiver must
not hand failed destination pages to another request before then.

Subclasses implement the `_engine_*` hooks only. Imports numpy, spec and
disagg.{manifest, transfer_plan, metrics, errors}; never engine or serve.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt

from dsakv.disagg.protocol.errors import RegistrationError, TransferError, TransferTimeout
from dsakv.disagg.transfer.manifest import BackendMeta, Manifest, RegionLike
from dsakv.disagg.transfer.metrics import TransferMetrics, TransferStats
from dsakv.disagg.transfer.plan import Blocks

log = logging.getLogger(__name__)

IntArray = npt.NDArray[np.int64]
K = TypeVar("K", bound=Hashable)


def deadline_in(seconds: float) -> float:
    """An absolute deadline `seconds` from now, on the time.monotonic() clock."""
    return time.monotonic() + seconds


class TransferStatus(enum.StrEnum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Span:
    """A registered memory span [addr, addr + nbytes)."""

    addr: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


class SpanTable:
    """Sorted spans, for vectorised 'is every block inside one span' checks."""

    def __init__(self, spans: Mapping[Hashable, Span]) -> None:
        items = sorted(spans.items(), key=lambda kv: kv[1].addr)
        self.keys = [k for k, _ in items]
        self.starts = np.asarray([s.addr for _, s in items], dtype=np.int64)
        self.ends = np.asarray([s.end for _, s in items], dtype=np.int64)

    def first_outside(self, addr: IntArray, length: IntArray) -> int | None:
        """Index of the first block [addr, addr+length) not inside a single span, or None."""
        if self.starts.size == 0:
            return 0 if addr.size else None
        idx = np.searchsorted(self.starts, addr, side="right") - 1
        ok = idx >= 0
        safe = np.where(ok, idx, 0)
        ok &= (addr + length) <= self.ends[safe]
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else None


@dataclass(frozen=True, eq=False)
class Peer:
    """A connected peer: its manifest, the backend's connection object and its regions for bounds checks."""

    name: str
    backend: str
    address: Any
    manifest: Manifest = field(repr=False)
    regions: SpanTable = field(repr=False)


@dataclass(eq=False)
class TransferHandle:
    """One submitted transfer. Poll it through the backend that returned it."""

    id: int
    peer: str
    nbytes: int
    blocks: int
    batches: int
    deadline: float
    started: float
    status: TransferStatus = TransferStatus.PENDING
    error: TransferError | None = None
    metrics: TransferMetrics | None = None
    job: Any = field(default=None, repr=False)

    @property
    def done(self) -> bool:
        return self.status is not TransferStatus.PENDING


class TransferBackend(ABC):
    """Base class: registration bookkeeping, boundary checks, deadlines and metrics. See module docstring."""

    name: ClassVar[str] = ""
    default_max_blocks_per_batch: ClassVar[int] = 1 << 16
    quarantine_s: ClassVar[float] = 0.0

    def __init__(self, max_blocks_per_batch: int | None = None) -> None:
        self.max_blocks_per_batch = int(max_blocks_per_batch or self.default_max_blocks_per_batch)
        if self.max_blocks_per_batch < 1:
            raise ValueError(f"max_blocks_per_batch = {max_blocks_per_batch} must be >= 1")
        self.stats = TransferStats()
        self._registered: dict[Hashable, Span] = {}
        self._local = SpanTable({})
        self._ids = itertools.count(1)
        self._closed = False

    # ---- engine hooks (subclasses) ---------------------------------------------------------

    @abstractmethod
    def _engine_register(self, key: Hashable, span: Span) -> int | str:
        """Register one span; return 0 on success, else the engine's code (int or error name)."""

    @abstractmethod
    def _engine_unregister(self, key: Hashable, span: Span) -> int | str:
        """Unregister one span; return 0 on success, else the engine's code."""

    @abstractmethod
    def _engine_meta(self) -> bytes:
        """What a peer needs to reach this engine (called after registration)."""

    @abstractmethod
    def _engine_connect(self, meta: bytes, manifest: Manifest) -> Any:
        """Open the peer described by `meta`; raise TransferError if it is unreachable."""

    @abstractmethod
    def _engine_submit(self, peer: Peer, batches: list[Blocks], deadline: float) -> Any:
        """Start moving `batches` (each within the engine's limit); return a job for _engine_poll."""

    @abstractmethod
    def _engine_poll(self, job: Any) -> tuple[TransferStatus, TransferError | None]:
        """Non-blocking: (PENDING, None), (DONE, None) or (FAILED, error)."""

    @abstractmethod
    def _engine_cancel(self, job: Any) -> None:
        """Stop a job past its deadline (best effort; it must not block)."""

    def _engine_wait(self, job: Any, timeout: float) -> None:
        """Block up to `timeout` seconds or until the job may have changed state (default: sleep)."""
        time.sleep(timeout)

    def _engine_close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine (after every region was unregistered)."""

    # ---- registration ---------------------------------------------------------------------------

    def register(self, regions: Mapping[K, RegionLike]) -> None:
        """Register every region; on any refusal unregister what this call registered and raise."""
        self._check_open()
        spans: dict[Hashable, Span] = {}
        for key, reg in regions.items():
            nbytes = int(reg.page_bytes) * int(reg.num_pages)
            if key in self._registered:
                raise RegistrationError(f"{self.name}: {key} is already registered", backend=self.name)
            if nbytes <= 0:
                raise RegistrationError(
                    f"{self.name}: region {key} at {int(reg.addr):#x} has {reg.page_bytes} B/page x {reg.num_pages} "
                    "pages = 0 bytes: a zero-length registration is refused before it reaches the engine "
                    "(nothing was registered by this call)",
                    backend=self.name,
                )
            spans[key] = Span(int(reg.addr), nbytes)
        done: list[Hashable] = []
        for skey, span in spans.items():
            try:
                code = self._engine_register(skey, span)
            except Exception as e:  # an engine binding raising instead of returning a code
                code = f"{type(e).__name__}: {e}"
            if code != 0:
                undone = self._rollback(done, spans)
                raise RegistrationError(
                    f"{self.name}: registering {skey} ({span.nbytes} B at {span.addr:#x}) failed with engine code "
                    f"{code!r}; unregistered the {undone} region(s) this call had registered, nothing is "
                    "half-registered",
                    backend=self.name,
                    code=code,
                )
            done.append(skey)
        self._registered.update(spans)
        self._local = SpanTable(self._registered)
        log.info("%s: registered %d region(s), %d bytes", self.name, len(spans), sum(s.nbytes for s in spans.values()))

    def _rollback(self, done: list[Hashable], spans: Mapping[Hashable, Span]) -> int:
        for key in reversed(done):
            try:
                code = self._engine_unregister(key, spans[key])
            except Exception as e:
                code = f"{type(e).__name__}: {e}"
            if code != 0:
                log.error("%s: rollback could not unregister %s (engine code %r)", self.name, key, code)
        return len(done)

    def unregister(self, keys: list[Hashable] | None = None) -> None:
        """Unregister `keys` (default: all); raise with the engine's code if one is refused."""
        failed: list[str] = []
        for key in list(self._registered) if keys is None else keys:
            span = self._registered.get(key)
            if span is None:
                raise RegistrationError(f"{self.name}: {key} is not registered", backend=self.name)
            try:
                code = self._engine_unregister(key, span)
            except Exception as e:
                code = f"{type(e).__name__}: {e}"
            if code != 0:
                failed.append(f"{key} (code {code!r})")
            del self._registered[key]
        self._local = SpanTable(self._registered)
        if failed:
            raise RegistrationError(f"{self.name}: unregistering failed for {', '.join(failed)}", backend=self.name)

    @property
    def registered(self) -> dict[Hashable, Span]:
        return dict(self._registered)

    def meta(self) -> BackendMeta:
        """This engine's connection metadata, for Manifest.from_pool. Only valid after register()."""
        self._check_open()
        if not self._registered:
            raise TransferError(
                f"{self.name}: meta() before register(): a peer must see this worker's registered memory",
                backend=self.name,
            )
        return BackendMeta(self.name, self._engine_meta())

    # ---- peers and transfers ------------------------------------------------------------------------

    def connect(self, manifest: Manifest) -> Peer:
        """Reach the worker that published `manifest` (after check_pair accepted it)."""
        self._check_open()
        if manifest.backend_meta.backend != self.name:
            raise TransferError(
                f"{self.name}: peer {manifest.worker!r} uses transfer backend {manifest.backend_meta.backend!r}; "
                "both peers must use the same --transfer-backend",
                backend=self.name,
            )
        address = self._engine_connect(manifest.backend_meta.data, manifest)
        spans: dict[Hashable, Span] = {k: Span(r.addr, r.nbytes) for k, r in manifest.regions.items()}
        if manifest.staging is not None:  # a decode's destination-staging slots (disagg.staging.StagingSlots)
            spans["staging-slots"] = Span(manifest.staging.addr, manifest.staging.nbytes)
        log.info("%s: connected to %s", self.name, manifest.worker)
        return Peer(manifest.worker, self.name, address, manifest, SpanTable(spans))

    def submit(self, peer: Peer, blocks: Blocks, deadline: float) -> TransferHandle:
        """Start writing `blocks` to `peer`; poll/wait the handle. Bad blocks raise here, nothing is sent."""
        self._check_open()
        where = f"{self.name} -> {peer.name}"
        blocks.check(where)
        i = self._local.first_outside(blocks.src, blocks.length)
        if i is not None:
            raise TransferError(
                f"{where}: source block #{i} [{int(blocks.src[i]):#x}, +{int(blocks.length[i])}) is outside every "
                "region registered with this backend: register the pool before transferring from it",
                backend=self.name,
            )
        i = peer.regions.first_outside(blocks.dst, blocks.length)
        if i is not None:
            raise TransferError(
                f"{where}: destination block #{i} [{int(blocks.dst[i]):#x}, +{int(blocks.length[i])}) is outside "
                f"every region of {peer.name}'s manifest",
                backend=self.name,
            )
        batches = blocks.batches(self.max_blocks_per_batch)
        now = time.monotonic()
        h = TransferHandle(next(self._ids), peer.name, blocks.nbytes, len(blocks), len(batches), deadline, now)
        if now >= deadline:
            self._finish(h, TransferTimeout(f"{where}: deadline already passed at submit", backend=self.name))
            return h
        try:
            h.job = self._engine_submit(peer, batches, deadline)
        except TransferError as e:
            self._finish(h, e)
        return h

    def poll(self, handle: TransferHandle) -> TransferStatus:
        """The handle's status now; a pending transfer past its deadline is cancelled and FAILED."""
        if handle.done:
            return handle.status
        state, err = self._engine_poll(handle.job)
        if state is TransferStatus.DONE:
            self._finish(handle, None)
        elif state is TransferStatus.FAILED:
            self._finish(handle, err or TransferError(f"{self.name}: transfer failed", backend=self.name))
        elif time.monotonic() >= handle.deadline:
            self._timeout(handle)
        return handle.status

    def wait(self, handle: TransferHandle, deadline: float | None = None) -> TransferMetrics:
        """Block until the transfer finishes; raise its error. `deadline` may only tighten the handle's."""
        limit = handle.deadline if deadline is None else min(deadline, handle.deadline)
        step = 0.0002
        while self.poll(handle) is TransferStatus.PENDING:
            left = limit - time.monotonic()
            if left <= 0:
                self._timeout(handle)
                break
            self._engine_wait(handle.job, min(step, left))
            step = min(step * 2, 0.005)
        if handle.error is not None:
            raise handle.error
        assert handle.metrics is not None
        return handle.metrics

    def transfer(self, peer: Peer, blocks: Blocks, deadline: float) -> TransferMetrics:
        """submit + wait."""
        return self.wait(self.submit(peer, blocks, deadline))

    def _timeout(self, handle: TransferHandle) -> None:
        try:
            self._engine_cancel(handle.job)
        except Exception as e:  # cancellation is best effort; the timeout is reported either way
            log.warning("%s: cancelling transfer %d failed: %s", self.name, handle.id, e)
        elapsed = time.monotonic() - handle.started
        self._finish(
            handle,
            TransferTimeout(
                f"{self.name} -> {handle.peer}: transfer {handle.id} ({handle.nbytes} B in {handle.blocks} blocks) "
                f"unfinished at its deadline, {elapsed:.2f}s after submit; cancelled (the engine may still touch "
                f"those pages for up to {self.quarantine_s:g}s)",
                backend=self.name,
            ),
        )

    def _finish(self, handle: TransferHandle, err: TransferError | None) -> None:
        handle.status = TransferStatus.FAILED if err else TransferStatus.DONE
        handle.error = err
        handle.metrics = TransferMetrics(
            self.name,
            handle.peer,
            handle.nbytes,
            handle.blocks,
            handle.batches,
            time.monotonic() - handle.started,
            None if err is None else str(err),
        )
        self.stats.record(handle.metrics)
        if err is not None:
            log.warning("%s", err)

    # ---- lifetime ----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"{self.name}: backend is closed", backend=self.name)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unregister everything and release the engine. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self.unregister()
        except RegistrationError as e:
            log.warning("%s", e)
        self._engine_close()

    def __enter__(self) -> TransferBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
