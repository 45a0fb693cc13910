"""The decode worker's requests waiting for KV (the InboundKv ledger): failing one, freeing its pages once no
prefill stage can still write them, deadlines, the liveness verdicts on the stages they wait for, and which
processes may report for them (the stage registered at prealloc, or its re-registered restart).

    book = InboundBook(ledger, name=..., lock=..., stats=..., outputs=..., registry=..., quarantine_s=...,
                       abort_choices=..., wake=..., timeouts=..., stopping=...)
    book.fail(inb, error)            FAILED, its one event (DecodeOutputs.failed); pages stay held ...
    book.revoke_failed()             ... while each stage that has not reported is asked to revoke its write (REVOKE:
                                     it never starts it; says if one is in flight) ...
    book.maybe_release(inb)          ... until every stage reported (+ quarantine), revoked or is gone, else the
                                     deadline + the backend's quarantine: DONE, its engine request (every choice)
                                     aborted
    book.boots(inb, k)               the boot ids that may report stage k of the request
    book.refuse_report(what, why)    count + log a refused report; the Forbidden to raise
    book.check_deadlines()           fail the expired, release the failed that may be released
    book.stage_verdict(addr, verdict, waits, why)   one ping's verdict applied to the requests waiting on addr
    book.monitor_loop()              the decode-monitor thread: deadlines every 50 ms, pings every liveness interval
    book.revoke_loop()               the decode-revoke thread: revoke_failed every 50 ms

Used by decode_worker.DecodeWorker (the RPC handlers call fail / maybe_release / boots). Imports dsakv.disagg.
{bootstrap, decode_outputs, errors, lifecycle, liveness, rpc, timeouts}; no torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dsakv.config import Timeouts
from dsakv.disagg.decode.liveness import ping_stage, revoke_stage, stage_waits
from dsakv.disagg.decode.outputs import DecodeOutputs
from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.protocol.errors import Forbidden
from dsakv.disagg.protocol.lifecycle import InboundKv, Ledger, Phase
from dsakv.disagg.protocol.rpc import RpcError
from dsakv.disagg.transfer.bootstrap import StageRegistry

log = logging.getLogger("dsakv.disagg.decode.worker")


class InboundBook:
    def __init__(
        self,
        inbound: Ledger[InboundKv],
        *,
        name: str,
        lock: threading.RLock,
        stats: DecodeStats,
        outputs: DecodeOutputs,
        registry: StageRegistry,
        quarantine_s: float,
        abort_choices: Callable[[str], bool],
        wake: threading.Event,
        timeouts: Timeouts,
        stopping: threading.Event,
        release_slot: Callable[[InboundKv], None] | None = None,
    ) -> None:
        self.inbound, self.name, self.lock, self.stats = inbound, name, lock, stats
        self.outputs, self.registry, self.quarantine_s = outputs, registry, quarantine_s
        self.abort_choices, self.wake, self.t, self.stopping = abort_choices, wake, timeouts, stopping
        self.silent_since: dict[str, float] = {}  # stage address -> when its pings began to go unanswered
        self.release_slot = release_slot  # frees a request's destination staging slot with its pages

    def fail(self, inb: InboundKv, error: str, reason: str = "error") -> None:
        self.inbound.move(inb, Phase.FAILED, error)
        self.stats.kv_failed += 1
        self.outputs.failed(inb.rid, reason, error)
        log.warning("decode %s: request %s failed before decoding: %s", self.name, inb.rid, error)

    def maybe_release(self, inb: InboundKv) -> None:
        """Free a failed request's pages (and staging slot) once no prefill stage can still write them, and no
        scatter is writing them."""
        if inb.scattering:
            return  # the scatter's end releases it
        now = self.inbound.now()
        hard = inb.deadline + self.quarantine_s
        if (inb.settled() and now >= inb.hold_until) or now >= max(hard, inb.hold_until):
            self.inbound.move(inb, Phase.DONE)
            if self.release_slot is not None:
                self.release_slot(inb)
            self.abort_choices(inb.rid)
            self.outputs.forget(inb.rid)
            self.wake.set()

    def boots(self, inb: InboundKv, k: int) -> set[str]:
        """The processes that may report stage k of a request: the one registered at its prealloc, or the one
        registered now (the stage restarted and re-registered while the request was being dispatched)."""
        now = self.registry.boot_of(inb.prefill, k)
        return {b for b in (inb.stage_boot.get(k), now) if b}

    def refuse_report(self, what: str, why: str) -> Forbidden:
        self.stats.reports_refused += 1
        log.warning("decode %s: refused %s: %s", self.name, what, why)
        return Forbidden(f"decode {self.name}: {what} refused: {why}")

    def check_deadlines(self) -> None:
        """Fail every request whose KV did not arrive by its deadline; free failed requests' pages once no
        stage can still write them (the monitor thread calls this every 50 ms)."""
        with self.lock:
            for inb in self.inbound.expired():
                if inb.phase is Phase.AWAITING_KV:
                    self.fail(
                        inb,
                        f"request {inb.rid}: the KV from prefill {inb.prefill} did not arrive within "
                        f"{inb.kv_timeout:g}s (+{self.t.kv_grace:g}s grace): stage(s) {inb.missing()} of "
                        f"{inb.num_stages} never reported",
                    )
            for inb in self.inbound.in_phase(Phase.FAILED):
                self.maybe_release(inb)

    def revoke_failed(self) -> None:
        """Ask every stage a failed request still waits for to revoke its write (never start it; is one running?):
        once each stage promised (or reported, or is gone), the pages are freed at once (maybe_release), not at
        the KV deadline + quarantine. A stage that does not answer, or says a write is in flight, is asked again
        every liveness interval (its report ends the wait too)."""
        now = self.inbound.now()
        asks: list[tuple[InboundKv, int, str]] = []
        with self.lock:
            for inb in self.inbound.in_phase(Phase.FAILED):
                if inb.revoke_next > now or inb.scattering:
                    continue
                inb.revoke_next = now + self.t.liveness_interval
                asks += [(inb, k, inb.stage_rpc[k]) for k in inb.unsettled() if k in inb.stage_rpc]
        silent: set[str] = set()  # stages that did not answer this round: not asked again until the next
        for inb, k, addr in asks:
            if addr in silent:
                continue
            try:
                r = revoke_stage(addr, inb.rid, inb.grant, self.t.ping)
            except RpcError as e:
                log.debug("decode %s: revoke of %s at stage %d (%s): %s", self.name, inb.rid, k, addr, e)
                silent.add(addr)
                continue
            with self.lock:
                if r.in_flight or r.boot not in self.boots(inb, k) or self.inbound.get(inb.rid) is not inb:
                    continue
                inb.revoked.add(k)
                self.stats.revoked += 1
                self.maybe_release(inb)

    def stage_verdict(
        self, addr: str, verdict: str | None, waits: list[tuple[InboundKv, int]], why: str | None = None
    ) -> None:
        """A liveness ping of stage `addr` said `verdict` (None: it answers; 'dead'; 'not answering'): the
        requests waiting for it fail, and a dead stage (or one that restarted: `why`) can no longer write their
        pages."""
        if verdict is None or not waits:
            return
        with self.lock:
            for inb, k in waits:
                if verdict == "dead":
                    inb.dead.add(k)
                if self.inbound.get(inb.rid) is not inb:
                    continue
                if inb.phase is Phase.AWAITING_KV:
                    self.fail(inb, f"prefill {inb.prefill} stage {k} at {addr} is {why or verdict}: request lost")
                self.maybe_release(inb)

    def revoke_loop(self) -> None:
        """The decode-revoke thread: revoke_failed every 50 ms (its calls never delay the deadlines)."""
        while not self.stopping.is_set():
            self.stopping.wait(0.05)
            self.revoke_failed()

    def monitor_loop(self) -> None:
        last_ping = 0.0
        stopping = self.stopping
        while not stopping.is_set():
            stopping.wait(0.05)
            self.check_deadlines()
            now = self.inbound.now()
            if now - last_ping < self.t.liveness_interval:
                continue
            with self.lock:
                waits = stage_waits(self.inbound.values())
            if not waits:
                continue
            last_ping = now
            for addr in [a for a in self.silent_since if a not in waits]:
                del self.silent_since[addr]
            for addr, items in waits.items():
                verdict, boot = ping_stage(addr, self.t.ping)
                if verdict == "not answering":  # one missed ping is a busy or descheduled stage, not a dead one:
                    first = self.silent_since.setdefault(addr, now)  # its requests fail once it stayed silent
                    if self.inbound.now() - first < self.t.silent:  # for t.silent (a refused connect: at once)
                        continue
                else:
                    self.silent_since.pop(addr, None)
                if verdict is None and boot is not None:  # it answers: as the process the requests wait for?
                    with self.lock:
                        gone = [(inb, k) for inb, k in items if boot not in self.boots(inb, k)]
                    self.stage_verdict(addr, "dead", gone, f"restarted (now boot {boot})")
                else:
                    self.stage_verdict(addr, verdict, items)


__all__ = ["InboundBook"]
