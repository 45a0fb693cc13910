"""The DeepSeek-V4 prefill's books (V4Link: a handshaken decode; V4Job: one request), its sender (a mixin: each
stage's paired kinds of a parked request to the decode, one STAGE_DONE per stage, then the pages freed) and its
views (a mixin: integrity, HEALTH). disagg/prefill/v4_worker.py's V4PrefillWorker is built from them.

Imports numpy, dsakv.engine and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from dsakv.config import PrefillConfig
from dsakv.disagg.prefill.v4_stages import V4StageChild
from dsakv.disagg.protocol.errors import TransferTimeout
from dsakv.disagg.protocol.messages import STAGE_DONE, LinkSummary, PrefillHealth, StageDone, StageInfo, TransferHealth
from dsakv.disagg.protocol.worker_service import WorkerService
from dsakv.disagg.transfer.backends.base import Peer, TransferBackend, deadline_in
from dsakv.disagg.transfer.v4 import V4Manifest, pair_figure, v4_blocks
from dsakv.engine.v4_engine import V4Engine
from dsakv.spec.v4_layout import V4Pair
from dsakv.util.stats import Stats

log = logging.getLogger("dsakv.disagg.prefill.v4_worker")


@dataclass
class V4PrefillStats(Stats):
    submitted: int = 0
    transferred: int = 0  # requests every stage sent
    transfer_failed: int = 0
    dropped: int = 0  # deadline passed or aborted before the transfer
    transfer_bytes: int = 0
    transfer_s: float = 0.0


@dataclass
class V4Link:
    """A handshaken decode: its process (boot), manifest, grant key, and per stage the pairs (stage 0: its peer)."""

    addr: str
    boot: str
    manifest: V4Manifest
    manifest_bytes: bytes
    grant_key: bytes
    pairs: list[tuple[V4Pair, ...]]
    peer: Peer


@dataclass
class V4Job:
    rid: str
    eid: int  # the V4Engine's request id
    prompt_len: int
    link: V4Link
    dst_pages: list[int]
    dst_slot: int
    grant: bytes
    deadline: float
    queued: bool = False  # handed to the sender
    aborted: str | None = None
    sending: bool = False
    first_token: int | None = None
    cached_tokens: int = 0
    bytes: dict[int, int] = field(default_factory=dict)


class _Parts:
    """Needs (set by V4PrefillWorker.__init__) the attributes below."""

    cfg: PrefillConfig
    name: str
    boot: str
    engine: V4Engine
    backend: TransferBackend
    manifest: V4Manifest
    children: list[V4StageChild]
    ranges: list[tuple[int, int]]
    links: dict[str, V4Link]
    jobs: dict[str, V4Job]
    stats: V4PrefillStats
    lock: threading.RLock
    service: WorkerService
    num_pages: int
    _sendq: queue.Queue[V4Job | None]

    if TYPE_CHECKING:  # V4PrefillWorker's, declared for the type checker only

        @property
        def address(self) -> str: ...

        @property
        def page_size(self) -> int: ...

        def _post(self, link: V4Link, rpc: Any, msg: Any) -> None: ...

        def _summaries(self, link: V4Link) -> list[LinkSummary]: ...

        def down_reason(self) -> str | None: ...


class V4Sender(_Parts):
    """The sender thread: a parked request's kinds from every stage, its reports, its pages freed."""

    def _send_loop(self) -> None:
        while True:
            job = self._sendq.get()
            if job is None:
                return
            try:
                self._send(job)
            except Exception:
                log.exception("prefill %s: sending %s failed", self.name, job.rid)

    def _send(self, job: V4Job) -> None:
        with self.lock:
            if job.aborted is not None or job.rid not in self.jobs:
                return
            job.sending = True
            req = self.engine.parked[job.eid]
            src, slot = req.page_ids[: len(job.dst_pages)].copy(), int(req.slot)
        link, n = job.link, len(self.ranges)
        reports: list[StageDone] = []
        t0 = time.perf_counter()
        for k in range(n):
            left = job.deadline - time.monotonic()
            ok, err, nbytes, quarantine, started = True, None, 0, 0.0, False
            try:
                if left <= 0:
                    raise RuntimeError(f"request {job.rid}: its KV deadline passed before stage {k} sent")
                started = True
                if k == 0:
                    plan = v4_blocks(
                        link.pairs[0], self.manifest, link.manifest, src, job.dst_pages, slot, job.dst_slot
                    )
                    nbytes = int(self.backend.transfer(link.peer, plan.blocks, deadline_in(left)).nbytes)
                    want = pair_figure(link.pairs[0], len(src))
                else:
                    child = self.children[k - 1]
                    args = (link.manifest_bytes, src, np.asarray(job.dst_pages), slot, job.dst_slot, left)
                    nbytes, _, want = child.send(args, left + 30.0)
                if nbytes != want:
                    raise RuntimeError(f"stage {k} moved {nbytes} B of request {job.rid}, its layout says {want} B")
            except Exception as e:
                ok, err = False, f"prefill {self.name} stage {k}: {type(e).__name__}: {e}"
                # a write that timed out may still land: the decode keeps the pages for the engine's quarantine
                timed_out = started and (isinstance(e, TransferTimeout) or "timed out" in str(e).lower())
                quarantine = (
                    (self.backend.quarantine_s if k == 0 else self.children[k - 1].quarantine_s) if timed_out else 0.0
                )
                log.warning("prefill %s: transfer of %s failed: %s", self.name, job.rid, err)
            job.bytes[k] = nbytes
            reports.append(
                StageDone(
                    rid=job.rid,
                    prefill=self.name,
                    stage=k,
                    ok=ok,
                    error=err,
                    quarantine_s=quarantine,
                    bytes=nbytes,
                    first_token=job.first_token if k == n - 1 else None,
                    cached_tokens=job.cached_tokens if k == 0 else 0,
                    boot=self.boot,
                    grant=job.grant,
                )  # fmt: skip
            )
        dt = time.perf_counter() - t0
        for rep in reports:
            self._post(link, STAGE_DONE, rep)
        with self.lock:
            self.jobs.pop(job.rid, None)
            self.engine.abort_parked(job.eid)
            good = all(r.ok for r in reports)
            self.stats.transferred += good
            self.stats.transfer_failed += not good
            self.stats.transfer_bytes += sum(job.bytes.values())
            self.stats.transfer_s += dt
        log.debug("prefill %s: sent %s (%s B per stage) in %.4fs", self.name, job.rid, job.bytes, dt)


class V4PrefillViews(_Parts):
    """integrity and HEALTH."""

    def integrity(self) -> str:
        with self.lock:
            try:
                self.engine.check_integrity()
            except AssertionError as e:
                return str(e)
            held = {j.eid for j in self.jobs.values()}
            live = {r.rid for r in [*self.engine.waiting, *self.engine.running]} | set(self.engine.parked)
            if live - held:
                return f"engine requests {sorted(live - held)} belong to no job"
        return "ok"

    def health(self) -> PrefillHealth:
        with self.lock:
            e = self.engine
            used = e.pages.num_pages - e.pages.num_free
            jobs = len(self.jobs)
            sending = sum(1 for j in self.jobs.values() if j.sending)
            waiting, running = len(e.waiting), len(e.running)
            cached = len({int(p) for ids, _ in e._cache.values() for p in ids})  # held by the prefix cache
            links = [s for link in self.links.values() for s in self._summaries(link)[:1]]
            st = self.stats
            transfer = TransferHealth(
                st.transferred + st.transfer_failed, st.transfer_failed, st.transfer_bytes, st.transfer_s
            )
            counters = {k: int(v) for k, v in st.as_dict().items() if not isinstance(v, float)}
        a, b = self.ranges[0]
        down = "stopping" if self.service.stopping.is_set() else self.down_reason()
        return PrefillHealth(
            ok=down is None,
            down=down,
            role="prefill",
            name=self.name,
            pid=os.getpid(),
            boot=self.boot,
            elide=True,
            backend=self.cfg.config.transfer.backend,
            page_size=self.page_size,
            pages_total=self.num_pages,
            pages_used=used,
            pages_free=self.num_pages - used,
            capacity_tokens=self.num_pages * self.page_size,
            integrity=self.integrity(),
            counters=counters,
            stages=[
                StageInfo(
                    stage=k,
                    rpc=self.address,
                    pid=os.getpid() if k == 0 else self.children[k - 1].pid,
                    layers=[s, t - 1],
                )
                for k, (s, t) in enumerate(self.ranges)
            ],  # fmt: skip
            stage=0,
            num_stages=len(self.ranges),
            layers=[a, b - 1],
            waiting=waiting,
            running=running,
            jobs=jobs,
            transfers_in_flight=sending,
            links=links,
            prefix_cache_enabled=False,
            host_tier=e.host is not None,
            cache_pages=cached,
            transfer=transfer,
        )
