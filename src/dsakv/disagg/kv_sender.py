"""KvSender: how every prefill stage sends a request's KV to its decode worker and says so.

    sender.queue(Transfer(job, src_pages, first_token))     after the step that computed the prompt's last chunk
    loop: batch what is queued -> per transfer: handshaken link (decode boot checked) -> TransferPlan(paired
          keys, src pages -> job.dst_pages) -> backend.submit(deadline) ... backend.wait
          -> STAGE_DONE StageDone(rid, stage, ok, error, quarantine, bytes, first token, draft hidden) to the decode
          -> on_done(job, ok): the role frees its books (stage 0: one release of N; stage k: tells stage 0)
    sender.fail(job, why)                                   KV_FAILED: the stage dropped it before its transfer

A transfer that times out after the engine took it reports the backend's quarantine (the decode keeps the
pages that long: the engine may still write them). Imports numpy, dsakv.disagg.{backends, bootstrap,
messages, transfer_plan, worker_service, wire}, dsakv.engine.request; never torch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from dsakv.disagg import grants
from dsakv.disagg.backends.base import TransferBackend, TransferHandle
from dsakv.disagg.bootstrap import DecodeLinks
from dsakv.disagg.errors import TransferTimeout
from dsakv.disagg.lifecycle import StageJob
from dsakv.disagg.messages import KV_FAILED, STAGE_DONE, KvFailed, StageDone, WireLogprobs
from dsakv.disagg.rpc import RpcError
from dsakv.disagg.timeouts import Timeouts
from dsakv.disagg.transfer_plan import TransferPlan
from dsakv.disagg.worker_service import Notifier
from dsakv.engine.request import TokenLogprobs
from dsakv.errors import DsakvError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Transfer:
    job: StageJob
    src_pages: list[int]
    first_token: int | None  # the last stage's sampled token, reported with the transfer
    first_logprobs: TokenLogprobs | None = None  # last stage: its logprobs (params.logprobs)
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None  # last stage: prompt tokens 1.. (params.prompt_logprobs)
    cached_tokens: int = 0  # stage 0: the prefix cache's hit
    draft_hidden: bytes | None = None  # MTP on the last stage: the draft's output at the prompt's last entry


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
        counters: dict[str, int],
        on_done: Callable[[StageJob, bool], None],
        debug_delay: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.clock = clock  # the ledger's: job deadlines are on it
        self.backend = backend
        self.links = links
        self.prefill = prefill
        self.stage = stage
        self.t = timeouts
        self.notifier = notifier
        self.counters = counters
        self.on_done = on_done
        self.debug_delay = debug_delay
        self._q: queue.Queue[Transfer] = queue.Queue()
        self._busy = 0
        self._lock = threading.Lock()

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
        self.notifier.post(job.decode, KV_FAILED, KvFailed(job.rid, why, self.prefill, self.links.hello.boot))

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
            for x, h, err in started:
                quarantine = 0.0
                nbytes = 0
                if h is not None:
                    try:
                        nbytes = self.backend.wait(h).nbytes
                    except DsakvError as e:
                        err = f"transfer of prefill stage {self.stage}'s layers failed: {e}"
                        if isinstance(e, TransferTimeout) and h.job is not None:  # the engine had it: it may
                            quarantine = self.backend.quarantine_s  # still write the decode's pages a while
                self._report(x, err, quarantine, nbytes)

    def _start(self, x: Transfer) -> tuple[Transfer, TransferHandle | None, str | None]:
        job = x.job
        left = job.deadline - self.clock()
        if left <= 0:
            return x, None, f"prefill stage {self.stage}: the KV deadline passed before the transfer started"
        try:
            link = self.links.get(job.decode, job.decode_boot, timeout=min(self.t.rpc, left))
            if link.boot != job.decode_boot:
                raise DsakvError(
                    f"decode {job.decode} restarted (boot {link.boot}, request was for boot {job.decode_boot}): "
                    "its pages are gone"
                )
            dst = job.dst_pages[: len(x.src_pages)]
            grants.verify(link.grant_key, job.grant, rid=job.rid, boot=link.boot, pages=dst)  # before any write
            plan = TransferPlan.build(link.table, np.asarray(x.src_pages), np.asarray(dst))
            return x, self.backend.submit(link.peer, plan.blocks, time.monotonic() + left), None
        except (DsakvError, ValueError) as e:
            return x, None, f"prefill stage {self.stage} could not start the transfer: {e}"

    def _report(self, x: Transfer, err: str | None, quarantine: float, nbytes: int) -> None:
        job = x.job
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
            boot=self.links.hello.boot,
            grant=job.grant,
        )
        timeout = max(self.t.report_floor, min(self.t.rpc, job.deadline - self.clock() + 1))
        try:
            self.notifier.client(job.decode, job.decode_boot).request(STAGE_DONE, done, timeout=timeout)
        except RpcError as e:
            log.warning(
                "prefill %s stage %d: could not report %s to decode %s: %s", self.prefill, self.stage, job.rid,
                job.decode, e,
            )  # fmt: skip
        self.counters["transferred" if err is None else "transfer_failed"] += 1
        self.on_done(job, err is None)
        with self._lock:
            self._busy -= 1
