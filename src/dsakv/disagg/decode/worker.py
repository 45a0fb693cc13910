"""DecodeWorker: the decode side of disaggregated serving (one process).

    router ─ PREALLOC Prealloc(rid, prompt, params, prefill, num_stages, kv_timeout) ─► pages (held, WAITING_KV)
    prefill stage k ─ transfer (its layers' paired keys) ─► those pages (fragmented pages: the staging slot the
                    grant names, disagg.staging; scattered into the pages once every stage reported ok)
                    ─ STAGE_DONE StageDone(rid, k, ok, error, first token + MTP draft hidden (last stage)) ─►
    when every stage reported ok and the first token is known: Engine.start_decode -> continuous batching
    (with --speculative-num-steps K: engine/speculative.py on the received KV, the draft layer's included)
    router ◄─ EVENTS EventsQuery(since, wait) -> Events: token events of every request (EventLog, long-poll)
(the RPCs: messages.DECODE_SERVICE)

Bounded waits: a request whose stages have not all reported by its deadline (kv_timeout + grace) fails
with an error naming the missing stages; a prefill stage that a request still waits for is pinged, and
an unreachable one fails its requests at once. A failed request's pages are freed only once no stage can
still write them: every stage reported (plus the quarantine a timed-out transfer asks for) or is gone,
else at the deadline + the backend's quarantine.
The parts: WorkerService (RPC, health, threads), the Engine, the InboundKv ledger (this class), DecodeOutputs
(engine outputs -> events, n > 1 choices), liveness (stage pings), decode_views (HEALTH, integrity). Imports
torch, dsakv.engine and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from dsakv.config import DecodeConfig
from dsakv.disagg.decode import views as decode_views
from dsakv.disagg.decode.events import EventLog
from dsakv.disagg.decode.inbound import InboundBook
from dsakv.disagg.decode.kv_in import KvIn
from dsakv.disagg.decode.outputs import DecodeOutputs
from dsakv.disagg.decode.ranks import DecodeTP
from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.lifecycle import DECODE, InboundKv, Ledger, Phase
from dsakv.disagg.protocol.messages import (
    ABORT,
    DECODE_SERVICE,
    EVENTS,
    HANDSHAKE,
    KV_FAILED,
    PREALLOC,
    STAGE_DONE,
    Abort,
    DecodeHealth,
    Events,
    EventsQuery,
    Hello,
    HelloReply,
    StageDone,
    StageDoneReply,
    unpack_logprobs,
)
from dsakv.disagg.protocol.worker_service import WorkerService
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.bootstrap import StageRegistry
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.staging import decode_slots
from dsakv.errors import ConfigError

if TYPE_CHECKING:
    from dsakv.disagg.decode.stage import DecodePipeline

log = logging.getLogger(__name__)


class DecodeWorker(KvIn):
    """The RPCs, loops and views; the inbound-KV path (prealloc, kv_failed, scatter, start) is in kv_in.py."""

    def __init__(
        self, cfg: DecodeConfig, model: tuple[Any, Any] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.t = cfg.timeouts
        self.pipeline: DecodePipeline | None = None
        self.tp = DecodeTP()  # --tp-size > 1: the other ranks' pools and reports (decode/ranks.py); DP: decode/dp.py
        if cfg.pipeline is not None and cfg.dp_size > 1:  # DP attention x PP: cell (d, 0) (decode/dp_pipe.py)
            from dsakv.disagg.decode import dp_pipe

            self.pipeline, self.engine, self.tp = dp_pipe.stage0(cfg)  # type: ignore[assignment]
        elif cfg.pipeline is not None and cfg.pipeline.pp_size > 1:  # stage 0 of a pipeline (TP: decode/grid.py)
            from dsakv.disagg.decode.grid import stage0

            self.pipeline, self.engine, self.tp = stage0(cfg, model)
        elif cfg.dp_size > 1:  # DP attention: this process is one DP rank of the instance (decode/dp.py)
            from dsakv.disagg.decode.dp import DecodeDP

            self.tp, self.engine = DecodeDP.build(cfg, model)  # type: ignore[assignment]
        else:
            self.tp, self.engine = DecodeTP.build(cfg, model)
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.backend.register(self.engine.pool.regions())
        tc = cfg.config.transfer  # destination staging (disagg.staging): slots for fragmented destinations
        self.slots = decode_slots(
            self.backend,
            tc.staging_bytes(self.engine.pool.nbytes),
            tc.staging_slots,
            bool(self.pipeline or self.tp.refs),
        )
        self.service = WorkerService(
            DECODE_SERVICE,
            {
                HANDSHAKE: self._rpc_handshake,
                PREALLOC: self.prealloc,
                STAGE_DONE: self.stage_done,
                KV_FAILED: self.kv_failed,
                EVENTS: self._rpc_events,
                ABORT: self.abort,
            },
            cfg.host,
            cfg.port,
            "decode",
            health=self.health,
            integrity=self.integrity,
        )
        self.boot = self.service.boot if self.pipeline is None else f"{self.service.boot}.0"  # .<formation>
        self.name = cfg.name or f"decode@{self.address}"
        self.manifest = Manifest.from_pool(
            self.engine.pool, self.backend.meta(), self.name, self.slots.region if self.slots is not None else None
        )
        self.registry = StageRegistry(self.manifest)
        self.grant_key = grants.new_key()  # signs this process's page grants; handed to handshaken stages only
        self.events = EventLog()
        self.inbound: Ledger[InboundKv] = Ledger(DECODE, clock, keep_done=False)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self.stats = DecodeStats()  # its health's counters
        self.outputs = DecodeOutputs(self.events, self.stats, self._lock)
        self.book = InboundBook(
            self.inbound,
            name=self.name,
            lock=self._lock,
            stats=self.stats,
            outputs=self.outputs,
            registry=self.registry,
            quarantine_s=self.backend.quarantine_s,
            abort_choices=self._abort_choices,
            wake=self._wake,
            timeouts=self.t,
            stopping=self.service.stopping,
            release_slot=self._release_slot,
        )
        st = self.engine.stats()
        log.info(
            "decode %s: %d pages x %d tokens, %d B/token, elide=%s, backend %s, rpc %s, tp %d", self.name,
            st.pages_total, st.page_size, st.bytes_per_token, self.engine.layout.elide, cfg.config.transfer.backend,
            self.address, self.tp.size,
        )  # fmt: skip

    @property
    def address(self) -> str:
        return self.service.address

    def start(self) -> DecodeWorker:
        self.tp.attach(self)  # a TP rank's death fails every request this worker holds (on_pipeline_break)
        self.service.start(
            [
                (self._step_loop, "decode-step"),
                (self.book.monitor_loop, "decode-monitor"),
                (self.book.revoke_loop, "decode-revoke"),
            ]
        )
        return self

    def request_stop(self) -> None:
        self.service.request_stop()

    def stop(self) -> None:
        self.service.request_stop()
        self.tp.quiesce()  # DP rank 0: the stop round (every rank stops after it)
        self._wake.set()
        self.service.stop(join_timeout=5)
        if self.pipeline is not None:
            self.pipeline.group.close()
        self.tp.close(self.engine)
        if self.slots is not None:
            self.slots.close()
        self.backend.close()

    def serve_forever(self) -> None:
        self.service.serve_forever()

    # ---- RPC ----------------------------------------------------------------------------------------

    def integrity(self) -> str:
        """decode_views.integrity: 'ok', or what does not balance in the engine's and the inbound ledger's books."""
        return decode_views.integrity(self)

    def health(self) -> DecodeHealth:
        """decode_views.health: the HEALTH reply."""
        return decode_views.health(self)

    def _rpc_handshake(self, hello: Hello) -> HelloReply:
        if self.pipeline is not None:
            return self.pipeline.handshake(self, hello)
        self.registry.accept(hello)  # IncompatiblePeer / ManifestError travel back to the stage
        m = self.manifest.to_bytes()
        return HelloReply(manifest=m, boot=self.boot, name=self.name, grant_key=self.grant_key, ranks=self.tp.refs)

    def stage_done(self, p: StageDone) -> StageDoneReply:
        """Stage p.stage reported its transfer: start decoding once all did, fail the request if it failed."""
        rid, stage, ok = p.rid, p.stage, p.ok
        scatter = False
        with self._lock:
            inb = self.inbound.get(rid)
            if inb is None:
                return StageDoneReply(accepted=False)
            if not 0 <= stage < inb.num_stages:
                raise ConfigError(f"request {rid}: stage {stage} reported, but its prefill has {inb.num_stages} stages")
            if p.boot not in self.book.boots(inb, stage) or p.prefill != inb.prefill:
                raise self.book.refuse_report(
                    f"stage_done of {rid} stage {stage}",
                    f"from prefill {p.prefill!r} boot {p.boot or '(none)'}, but the request's stage {stage} is "
                    f"prefill {inb.prefill!r} boot {inb.stage_boot.get(stage)}",
                )
            if not hmac.compare_digest(p.grant, inb.grant):
                raise self.book.refuse_report(
                    f"stage_done of {rid} stage {stage}", "it does not carry the request's grant"
                )
            wrong = (self.pipeline or self.tp).check_parts(self, p)  # every (prefill stage, decode stage|rank) pair
            if wrong is not None:  # must have landed
                p = replace(p, ok=False, error=wrong)
                ok = False
            if ok and p.slot != inb.slot:  # the grant named the slot: a stage that wrote elsewhere left it partial
                p = replace(p, ok=False, error=f"it wrote into staging slot {p.slot}, the grant named {inb.slot}")
                ok = False
            inb.reported[stage] = ok
            inb.bytes += p.bytes
            if p.quarantine_s > 0:
                inb.hold_until = max(inb.hold_until, self.inbound.now() + p.quarantine_s)
            if p.first_token is not None:
                inb.first_token = p.first_token
                inb.first_logprobs = p.first_logprobs.unpack()[0] if p.first_logprobs is not None else None
                inb.prompt_logprobs = unpack_logprobs(p.prompt_logprobs)
            if p.stage == 0:
                inb.cached_tokens = p.cached_tokens
            if p.draft_hidden is not None:
                inb.draft_hidden = p.draft_hidden
            waiting = inb.phase is Phase.AWAITING_KV
            if waiting and not ok:
                self.book.fail(inb, f"prefill {inb.prefill} stage {stage}: {p.error or 'failed'}")
            elif waiting and not inb.scattering and len(inb.reported) == inb.num_stages and inb.first_token is not None:
                if inb.slot < 0:
                    self._start(inb)
                    return StageDoneReply(accepted=True, started=True)
                inb.scattering = scatter = True  # below, outside the lock; its pages and slot stay held meanwhile
            if inb.phase is Phase.FAILED:
                self.book.maybe_release(inb)
        if scatter:
            return self._scatter_and_start(inb)
        return StageDoneReply(accepted=True)

    def _rpc_events(self, p: EventsQuery) -> Events:
        wait = min(self.t.max_poll_wait, max(0.0, p.wait))
        return replace(self.events.since(p.since, wait), boot=self.boot)

    def abort(self, p: Abort) -> bool:
        rid = p.rid
        why = p.why or "aborted"
        with self._lock:
            inb = self.inbound.get(rid)
            if inb is not None:
                if inb.phase is Phase.AWAITING_KV:
                    self.book.fail(inb, why, reason="abort")
                self.book.maybe_release(inb)
                return True
            if p.choice is not None:  # one choice of an n > 1 request (its stop string matched)
                return self.engine.abort(self.outputs.engine_id(rid, p.choice)) is not None
        return self._abort_choices(rid)

    def _abort_choices(self, rid: str) -> bool:
        """Abort every choice of request `rid` (the forks first: DecodeOutputs.engine_ids)."""
        found = False
        for eid in self.outputs.engine_ids(rid):
            found = self.engine.abort(eid) is not None or found
        return found

    # ---- loops ---------------------------------------------------------------------------------------

    def on_pipeline_break(self, why: str) -> None:
        """The decode pipeline broke: every request this worker holds fails (running ones at once; inbound ones
        free their pages once no prefill stage can still write them)."""
        with self._lock:
            for inb in self.inbound.in_phase(Phase.AWAITING_KV):
                self.book.fail(inb, why)
            reqs = [r for r in self.engine.scheduler.requests.values() if r.request_id not in self.inbound]
            rids = {r.request_id if not r.choice_index else r.request_id[: -len(f"/{r.choice_index}")] for r in reqs}
            for rid in sorted(rids):  # each request once (choice 0); its forks '<rid>/<i>' go with it
                self.outputs.failed(rid, "error", why)
                self._abort_choices(rid)
                self.outputs.forget(rid)
            for r in reqs:  # forks whose choice 0 already finished
                self.outputs.drop(r.request_id)
                self.engine.abort(r.request_id)
            for inb in self.inbound.in_phase(Phase.FAILED):
                self.book.maybe_release(inb)
        log.warning("%s: every request it held failed", why)

    def _step_loop(self) -> None:
        eng = self.engine
        pipe = self.pipeline
        while not self.service.stopping.is_set():
            if pipe is not None and not pipe.ready(self):
                continue
            try:
                outs = self.step_once()
            except Exception:
                log.exception("decode %s: engine step failed", self.name)
                time.sleep(0.05)
                continue
            sch = eng.scheduler
            if not outs and not (sch.running or sch.ready or sch.waiting):
                self._wake.wait(0.005)
                self._wake.clear()

    def step_once(self) -> int:
        """One engine step; its outputs become events (the step thread loops on this). Returns how many."""
        outs = self.engine.step()
        if self.pipeline is not None:  # holds/drops for the later stages, an idle tick, a broken pipeline
            self.pipeline.after_step(self, outs)
        return self.outputs.publish(outs)

    def check_deadlines(self) -> None:
        """InboundBook.check_deadlines (the monitor thread calls it every 50 ms; tests call it directly)."""
        self.book.check_deadlines()

    def stage_verdict(
        self, addr: str, verdict: str | None, waits: list[tuple[InboundKv, int]], why: str | None = None
    ) -> None:
        """InboundBook.stage_verdict: one liveness verdict on stage `addr` applied to the requests waiting for it."""
        self.book.stage_verdict(addr, verdict, waits, why)
