"""KvSender: how every prefill stage sends a request's KV to its decode worker and says so.

    sender.queue(Transfer(job, src_pages, first_token))     after the step that computed the prompt's last chunk
    loop: batch what is queued -> per transfer: handshaken link (decode boot checked) -> per decode stage holding
          some of this stage's layers (one for a single-stage decode): TransferPlan(its paired keys, src pages ->
          job.dst_pages) -> backend.submit(deadline) ... backend.wait
          -> STAGE_DONE StageDone(rid, stage, ok, error, quarantine, bytes, first token, draft hidden, bytes per
             decode stage)
             to the decode (its stage 0)
          -> on_done(job, ok): the role frees its books (stage 0: one release of N; stage k: tells stage 0)
    sender.fail(job, why)                                   KV_FAILED: the stage dropped it before its transfer
    sender.revoke(Revoke(rid, grant)) -> Revoked(in_flight)  the decode gave up on it: never start writing its pages
                                      (a revoked grant is refused right before the write); is a write running (or
                                      in its quarantine)? The decode frees the pages at once when none is

Strategy per part (TransferPlan.choose, the measured rule in transfer_plan.choose_strategy): with a staging
buffer (`staging`, dsakv.disagg.transfer.staging) a plan of many small blocks whose source is fragmented is gathered
into it and sent as one block per key and destination run; otherwise (or while the buffer is held by another
transfer) the plan's own blocks go. A grant that names a destination staging slot (the decode's pages are
fragmented: transfer_plan.choose_destination, dsakv.disagg.transfer.staging.StagingSlots) makes every part go into that
slot instead (TransferPlan.into_slot, Manifest.slot_offsets), gathered too when the rule says so, and its blocks
coalesced (a gathered source into a slot: one block per range of adjacent keys); STAGE_DONE names the slot, and
the decode scatters it into the pages.

A transfer that times out after the engine took it reports the backend's quarantine (the decode keeps the
pages that long: the engine may still write them). Imports numpy, dsakv.disagg.{backends, bootstrap,
messages, transfer_plan, worker_service, wire}, dsakv.engine.request; never torch.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dsakv.config import MAX_KV_TIMEOUT, Timeouts
from dsakv.disagg.prefill.stats import PrefillStats
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.errors import TransferTimeout
from dsakv.disagg.protocol.lifecycle import StageJob
from dsakv.disagg.protocol.messages import KV_FAILED, STAGE_DONE, KvFailed, Revoke, Revoked, StageDone, WireLogprobs
from dsakv.disagg.protocol.rpc import RpcError
from dsakv.disagg.protocol.worker_service import Notifier
from dsakv.disagg.transfer.backends.base import TransferBackend, TransferHandle
from dsakv.disagg.transfer.bootstrap import DecodeLink, DecodeLinks, LinkPart
from dsakv.disagg.transfer.plan import PairTable, Strategy, TransferPlan
from dsakv.disagg.transfer.rank_routes import part_routes, request_rotation, route_pairs
from dsakv.disagg.transfer.staging import StagingBuffer
from dsakv.engine.request import TokenLogprobs
from dsakv.errors import DsakvError

log = logging.getLogger(__name__)

MAX_REVOKED = 1 << 16  # revoked grants a stage keeps (each until its expiry); more are not recorded


@dataclass(frozen=True)
class Transfer:
    job: StageJob
    src_pages: list[int]
    first_token: int | None  # the last stage's sampled token, reported with the transfer
    first_logprobs: TokenLogprobs | None = None  # last stage: its logprobs (params.logprobs)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # last stage: prompt tokens 1.. (params.prompt_logprobs)
    cached_tokens: int = 0  # stage 0: the prefix cache's hit
    draft_hidden: bytes | None = None  # MTP on the last stage: the draft's output at the prompt's last entry


@dataclass(frozen=True)
class SentPart:
    """What one rank of a TP stage sent for a request: its error, quarantine, bytes per decode stage / rank, the
    staging slot it wrote into; rank 0's also the rule's routes (prefill/ranks.py TPReports merges them)."""

    x: Transfer
    tp_rank: int
    err: str | None
    quarantine: float
    parts: dict[int, int]
    slot: int
    ranks: dict[int, int]
    routes: list[list[int]]


class KvSender:
    def __init__(
        self,
        *,
        backend: TransferBackend,
        links: DecodeLinks,
        prefill: str,
        stage: int,
        timeouts: Timeouts,
        notifier: Notifier,
        stats: PrefillStats,
        on_done: Callable[[StageJob, bool], None],
        debug_delay: float = 0.0,
        debug_fail: tuple[int, int] | None = None,
        clock: Callable[[], float] = time.monotonic,
        staging: StagingBuffer | None = None,
        tp_rank: int = 0,
        tp_size: int = 1,
        combine: Callable[[SentPart], None] | None = None,
    ) -> None:
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.combine = combine  # a TP stage: each rank's part goes here (prefill/ranks.py), rank 0 reports them all
        self.staging = staging
        self.clock = clock  # the ledger's: job deadlines are on it
        self.backend = backend
        self.links = links
        self.prefill = prefill
        self.stage = stage
        self.t = timeouts
        self.notifier = notifier
        self.stats = stats
        self.on_done = on_done
        self.debug_delay = debug_delay
        self.debug_fail = debug_fail
        self._sent_to: dict[int, int] = {}  # decode stage -> transfers started to it (debug_fail counts them)
        self._q: queue.Queue[Transfer] = queue.Queue()
        self._busy = 0
        self._lock = threading.Lock()
        self._writing: dict[bytes, float] = {}  # grant -> until when its write may land (inf: running)
        self._revoked: dict[bytes, float] = {}  # grant -> until when it is kept (its expiry): never written

    @property
    def in_flight(self) -> int:
        """Transfers queued or running (not yet reported)."""
        with self._lock:
            return self._busy

    def queue(self, x: Transfer) -> None:
        with self._lock:
            self._busy += 1
        self._q.put(x)

    def fail(self, job: StageJob, why: str) -> None:
        """Tell the decode this stage dropped `job` before transferring it."""
        msg = KvFailed(job.rid, why, self.prefill, self.links.hello.boot, stage=self.stage, grant=job.grant)
        self.notifier.post(job.decode, KV_FAILED, msg)

    def revoke(self, p: Revoke) -> Revoked:
        """The decode gave up on the request of grant p.grant: this stage never starts writing its pages; whether
        a write of them is running or may still land (a timed-out one, for the backend's quarantine)."""
        now = time.monotonic()
        with self._lock:
            for table in (self._writing, self._revoked):
                for g in [g for g, until in table.items() if until < now]:
                    del table[g]
            if p.grant in self._writing or len(self._revoked) >= MAX_REVOKED:  # (full: no promise can be kept)
                return Revoked(in_flight=True, boot=self.links.hello.boot)
            self._revoked[p.grant] = now + MAX_KV_TIMEOUT + self.backend.quarantine_s
        return Revoked(in_flight=False, boot=self.links.hello.boot)

    def is_revoked(self, grant: bytes) -> bool:
        with self._lock:
            return grant in self._revoked

    def _begin_write(self, job: StageJob) -> str | None:
        """Book the request's write as running, unless its decode revoked it (then why not)."""
        with self._lock:
            if job.grant in self._revoked:
                return f"prefill stage {self.stage}: the decode revoked request {job.rid}'s pages (it gave up on it)"
            self._writing[job.grant] = math.inf
        return None

    def _end_write(self, job: StageJob, quarantine: float) -> None:
        with self._lock:
            if quarantine > 0:
                self._writing[job.grant] = time.monotonic() + quarantine
            else:
                self._writing.pop(job.grant, None)

    def wait_drained(self, stop: threading.Event) -> None:
        while not stop.is_set() and self.in_flight:
            time.sleep(0.01)

    def loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                first = self._q.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while True:
                try:
                    batch.append(self._q.get_nowait())
                except queue.Empty:
                    break
            if self.debug_delay > 0:  # testing: a window in which the transfers are in flight
                left = max(x.job.deadline for x in batch) - self.clock()
                time.sleep(max(0.0, min(self.debug_delay, left)))
            started = [self._start(x) for x in batch]
            for x, handles, err, staged, slot in started:
                quarantine = 0.0
                parts: dict[int, int] = {}
                ranks: dict[int, int] = {}  # decode cell -> bytes (a TP decode: one part per (stage, rank))
                for part, h in handles:
                    j = part.stage
                    try:
                        n = self.backend.wait(h).nbytes
                        parts[j] = parts.get(j, 0) + n
                        ranks[part.cell] = ranks.get(part.cell, 0) + n
                    except DsakvError as e:
                        err = err or f"transfer of prefill stage {self.stage}'s layers to decode stage {j} " + (
                            f"rank {part.rank} failed: {e}" if part.rank else f"failed: {e}"
                        )
                        if isinstance(e, TransferTimeout) and h.job is not None:  # the engine had it: it may
                            quarantine = self.backend.quarantine_s  # still write the decode's pages a while
                if staged and self.staging is not None:
                    self.staging.release(quarantine)
                self._end_write(x.job, quarantine)  # (a write that never began: nothing booked)
                if self.combine is not None:
                    self.combine(SentPart(x, self.tp_rank, err, quarantine, parts, slot, ranks, self._routes(x)))
                    continue
                self._report(x, err, quarantine, parts, slot, {} if set(ranks) <= {0} else ranks)

    def _routes(self, x: Transfer) -> list[list[int]]:
        """Rank 0 of a TP stage: the (prefill rank, decode rank) pairs the rule gives the request (its report
        names them; the decode checks each landed)."""
        if self.tp_rank != 0 or self.tp_size == 1:
            return []
        link = self.links.cached(x.job.decode)
        if link is None or link.boot != x.job.decode_boot:
            return []
        return route_pairs(link, self.stage, self.tp_size, request_rotation(x.job.rid))

    def _injected(self, j: int) -> str | None:
        """Testing (debug_fail = (decode stage, n)): the n-th transfer to decode stage j fails before it starts."""
        if self.debug_fail is None or self.debug_fail[0] != j:
            return None
        self._sent_to[j] = self._sent_to.get(j, 0) + 1
        if self._sent_to[j] != self.debug_fail[1]:
            return None
        return f"debug: injected failure of transfer #{self._sent_to[j]} to decode stage {j} (--debug-fail-transfer)"

    def _plan(self, plan: TransferPlan) -> tuple[TransferPlan, bool]:
        """The plan to send: staged (gathered into the staging buffer, which it then holds) when the rule
        says so and the buffer is free and large enough; else as built."""
        st = self.staging
        if st is None or plan.choose(self.backend.name) is not Strategy.STAGED or not st.acquire(plan.nbytes):
            return plan, False
        try:
            staged = plan.staged(st.addr)
            st.gather(staged)
        except BaseException:
            st.release()
            raise
        self.stats.transfers_staged += 1
        log.debug(
            "prefill %s stage %d: staged %d pages, %d blocks -> %d", self.prefill, self.stage, plan.num_pages,
            plan.num_blocks, staged.num_blocks,
        )  # fmt: skip
        return staged, True

    def _into_slot(
        self, link: DecodeLink, part: LinkPart, g: grants.Grant, src: np.ndarray, table: PairTable
    ) -> TransferPlan:
        """The plan writing `src` into the decode staging slot the grant names (its layout: slot_offsets); `table`:
        the keys this rank writes (a TP stage's ranks each write their share of the keys into the one slot)."""
        region = part.manifest.staging
        if region is None or len(link.parts) != 1:
            raise DsakvError(
                f"the grant names staging slot {g.slot}, but decode {link.addr} "
                f"{'has no staging region' if region is None else 'is pipelined'}"
            )
        n = int(src.size)
        if g.slot_pages != n or n * part.manifest.bytes_per_page > region.slot_bytes:
            raise DsakvError(
                f"staging slot {g.slot} holds {g.slot_pages} pages ({region.slot_bytes} B), this stage writes {n}"
            )
        off = part.manifest.slot_offsets(n)
        return TransferPlan.into_slot(table, src, region.slot_addr(g.slot), [off[p.key] for p in table.pairs])

    def _start(self, x: Transfer) -> tuple[Transfer, list[tuple[LinkPart, TransferHandle]], str | None, bool, int]:
        """Submit the request's pages to every decode stage this stage shares layers with (one plan per stage:
        its paired keys only); an error stops the rest (what was submitted is still waited for). The fourth
        value says whether one part holds the staging buffer (released after the waits), the last which
        destination staging slot the parts went into (-1: the pages)."""
        job = x.job
        left = job.deadline - self.clock()
        if left <= 0:
            return x, [], f"prefill stage {self.stage}: the KV deadline passed before the transfer started", False, -1
        handles: list[tuple[LinkPart, TransferHandle]] = []
        staged = False
        slot = -1
        try:
            link = self.links.get(job.decode, job.decode_boot, timeout=min(self.t.rpc, left))
            if link.boot != job.decode_boot:
                raise DsakvError(
                    f"decode {job.decode} restarted (boot {link.boot}, request was for boot {job.decode_boot}): "
                    "its pages are gone"
                )
            src, dst = np.asarray(x.src_pages), np.asarray(job.dst_pages[: len(x.src_pages)])
            g = grants.verify(
                link.grant_key, job.grant, rid=job.rid, boot=link.boot, pages=list(job.dst_pages[: len(x.src_pages)])
            )  # before any write
            revoked = self._begin_write(job)
            if revoked is not None:
                return x, handles, revoked, staged, slot
            rotate = request_rotation(job.rid)
            for part, table in part_routes(link, self.stage, self.tp_rank, self.tp_size, rotate):
                into = g.slot >= 0
                plan = self._into_slot(link, part, g, src, table) if into else TransferPlan.build(table, src, dst)
                injected = self._injected(part.stage)
                if injected is not None:
                    return x, handles, injected, staged, slot
                if not staged:
                    plan, staged = self._plan(plan)
                if into:
                    plan, slot = plan.coalesced(), g.slot
                    self.stats.transfers_into_slot += 1
                handles.append((part, self.backend.submit(part.peer, plan.blocks, time.monotonic() + left)))
            return x, handles, None, staged, slot
        except (DsakvError, ValueError) as e:
            return x, handles, f"prefill stage {self.stage} could not start the transfer: {e}", staged, slot

    def _report(
        self, x: Transfer, err: str | None, quarantine: float, parts: dict[int, int], slot: int = -1,
        ranks: dict[int, int] | None = None, senders: dict[int, dict[int, int]] | None = None,
        routes: list[list[int]] | None = None,
    ) -> None:  # fmt: skip
        job = x.job
        nbytes = sum(parts.values())
        done = StageDone(
            job.rid,
            self.prefill,
            self.stage,
            err is None,
            err,
            quarantine,
            nbytes,
            x.first_token,
            WireLogprobs.pack([x.first_logprobs]) if x.first_logprobs is not None else None,
            WireLogprobs.pack(x.prompt_logprobs),
            x.cached_tokens,
            x.draft_hidden,
            parts,
            boot=self.links.hello.boot,
            grant=job.grant,
            slot=slot,
            rank_parts=ranks or {},
            senders=self.tp_size,
            sender_parts=senders or {},
            routes=routes or [],
        )
        timeout = max(self.t.report_floor, min(self.t.rpc, job.deadline - self.clock() + 1))
        try:
            self.notifier.client(job.decode, job.decode_boot).request(STAGE_DONE, done, timeout=timeout)
        except RpcError as e:
            log.warning(
                "prefill %s stage %d: could not report %s to decode %s: %s", self.prefill, self.stage, job.rid,
                job.decode, e,
            )  # fmt: skip
        if err is None:
            self.stats.transferred += 1
        else:
            self.stats.transfer_failed += 1
        self.on_done(job, err is None)
        with self._lock:
            self._busy -= 1
