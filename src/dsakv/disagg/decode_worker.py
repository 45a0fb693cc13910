"""DecodeWorker: the decode side of disaggregated serving (one process).

    router ─ PREALLOC Prealloc(rid, prompt, params, prefill, num_stages, kv_timeout) ─► pages (held, WAITING_KV)
    prefill stage k ─ transfer (its layers' paired keys) ─► those pages
                    ─ STAGE_DONE StageDone(rid, k, ok, error, first token (last stage)) ─►
    when every stage reported ok and the first token is known: Engine.start_decode -> continuous batching
    router ◄─ EVENTS EventsQuery(since, wait) -> Events: token events of every request (EventLog, long-poll)
(the RPCs: messages.DECODE_SERVICE)

Bounded waits: a request whose stages have not all reported by its deadline (kv_timeout + grace) fails
with an error naming the missing stages; a prefill stage that a request still waits for is pinged, and
an unreachable one fails its requests at once. A failed request's pages are freed only once no stage can
still write them: every stage reported (plus the quarantine a timed-out transfer asks for) or is gone,
else at the deadline + the backend's quarantine.
Imports torch, dsakv.engine and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from dsakv.disagg.backends import make_backend
from dsakv.disagg.bootstrap import StageRegistry
from dsakv.disagg.events import EventLog
from dsakv.disagg.manifest import Manifest
from dsakv.disagg.messages import (
    ABORT,
    CHECK_INTEGRITY,
    DECODE_SERVICE,
    EVENTS,
    HANDSHAKE,
    HEALTH,
    KV_FAILED,
    PING,
    PREALLOC,
    STAGE_DONE,
    Abort,
    Events,
    EventsQuery,
    Health,
    Hello,
    HelloReply,
    KvFailed,
    Ping,
    PingReply,
    Prealloc,
    Preallocated,
    StageDone,
    StageDoneReply,
    StageInfo,
)
from dsakv.disagg.rpc import PeerUnavailable, RpcClient, RpcError, RpcServer, bind, split_addr
from dsakv.disagg.wire import new_boot_id, page_list
from dsakv.engine.engine import Engine
from dsakv.errors import ConfigError, NoFreePages

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecodeConfig:
    model: str
    host: str = "127.0.0.1"
    port: int = 0
    name: str | None = None
    engine: dict[str, Any] = field(default_factory=dict, hash=False)  # Engine keyword arguments
    backend: str = "mooncake"
    backend_options: dict[str, Any] = field(default_factory=dict, hash=False)
    rpc_timeout: float = 5.0
    kv_grace: float = 1.0  # wait this long past a request's prefill deadline before failing it
    liveness_interval: float = 0.5  # ping the prefill stages requests wait for this often


@dataclass
class Inbound:
    """A request whose KV is being transferred in."""

    rid: str
    prefill: str
    num_stages: int
    stage_rpc: dict[int, str]
    kv_timeout: float
    deadline: float  # monotonic: fail unless complete by then
    reported: dict[int, bool] = field(default_factory=dict)
    first_token: int | None = None
    failed: str | None = None
    hold_until: float = 0.0  # a timed-out transfer may still write until then
    dead: set[int] = field(default_factory=set)
    bytes: int = 0

    def missing(self) -> list[int]:
        return [k for k in range(self.num_stages) if k not in self.reported]


def _refused(addr: str, timeout: float = 0.5) -> bool:
    """True if nothing listens at addr (the process is gone); False if it accepts or does not answer."""
    host, port = split_addr(addr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


class DecodeWorker:
    def __init__(self, cfg: DecodeConfig, model: tuple[Any, Any] | None = None) -> None:
        self.cfg = cfg
        self.engine = Engine(model if model is not None else Path(cfg.model), **cfg.engine)
        self.boot = new_boot_id()
        self.backend = make_backend(cfg.backend, **cfg.backend_options)
        self.backend.register(self.engine.pool.regions())
        self.rpc = RpcServer(
            bind(
                DECODE_SERVICE,
                {
                    PING: self._rpc_ping,
                    HEALTH: lambda _: self.health(),
                    CHECK_INTEGRITY: lambda _: self.integrity(),
                    HANDSHAKE: self._rpc_handshake,
                    PREALLOC: self._rpc_prealloc,
                    STAGE_DONE: self._rpc_stage_done,
                    KV_FAILED: self._rpc_kv_failed,
                    EVENTS: self._rpc_events,
                    ABORT: self._rpc_abort,
                },
            ),
            cfg.host,
            cfg.port,
            name="decode",
        )
        self.name = cfg.name or f"decode@{self.rpc.address}"
        self.manifest = Manifest.from_pool(self.engine.pool, self.backend.meta(), worker=self.name)
        self.registry = StageRegistry(self.manifest)
        self.events = EventLog()
        self.inbound: dict[str, Inbound] = {}
        self._suppress: set[str] = set()  # failed while inbound: their abort output is not an event
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.counters = {
            "prealloc": 0,
            "busy": 0,
            "started": 0,
            "kv_failed": 0,
            "finished": 0,
            "tokens": 0,
            "kv_bytes": 0,
        }
        st = self.engine.stats()
        log.info(
            "decode %s: %d pages x %d tokens, %d B/token, elide=%s, backend %s, rpc %s",
            self.name,
            st.pages_total,
            st.page_size,
            st.bytes_per_token,
            self.engine.layout.elide,
            cfg.backend,
            self.rpc.address,
        )

    @property
    def address(self) -> str:
        return self.rpc.address

    def start(self) -> DecodeWorker:
        self.rpc.start()
        for target, name in ((self._step_loop, "decode-step"), (self._monitor_loop, "decode-monitor")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=5)
        self.rpc.stop()
        self.backend.close()

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(1.0)

    # ---- RPC ----------------------------------------------------------------------------------------

    def _rpc_ping(self, _: Ping) -> PingReply:
        return PingReply(pid=os.getpid(), boot=self.boot)

    def integrity(self) -> str:
        """'ok', or what does not balance (engine books; requests waiting for KV == the ones tracked)."""
        try:
            self.engine.check_integrity()
            with self._lock:
                waiting = set(self.engine.scheduler.awaiting_kv)
                ours = set(self.inbound)
            if waiting != ours:
                return (
                    f"requests waiting for KV in the engine {sorted(waiting - ours)[:4]} are not tracked, "
                    f"tracked ones {sorted(ours - waiting)[:4]} are not waiting"
                )
        except AssertionError as e:
            return str(e)
        return "ok"

    def health(self) -> Health:
        st = self.engine.stats()
        with self._lock:
            failed_held = sum(1 for i in self.inbound.values() if i.failed)
            inbound = len(self.inbound) - failed_held
        return Health(
            ok=not self._stop.is_set(),
            role="decode",
            name=self.name,
            pid=os.getpid(),
            boot=self.boot,
            elide=self.engine.layout.elide,
            backend=self.cfg.backend,
            page_size=st.page_size,
            pages_total=st.pages_total,
            pages_used=st.pages_used,
            pages_free=st.pages_free,
            capacity_tokens=st.capacity_tokens,
            bytes_per_token=st.bytes_per_token,
            max_prompt_tokens=st.capacity_tokens - 1,
            running=st.num_running,
            waiting=st.num_waiting,
            inbound=inbound,
            failed_held=failed_held,
            stages=[
                StageInfo(stage=e.stage, rpc=e.rpc, prefill=e.prefill, layers=[e.layer_start, e.layer_end - 1])
                for e in self.registry.entries()
            ],
            counters=dict(self.counters),
            integrity=self.integrity(),
        )

    def _rpc_handshake(self, hello: Hello) -> HelloReply:
        self.registry.accept(hello)  # IncompatiblePeer / ManifestError travel back to the stage
        return HelloReply(manifest=self.manifest.to_bytes(), boot=self.boot, name=self.name)

    def _rpc_prealloc(self, p: Prealloc) -> Preallocated:
        rid, prefill, n, kv_timeout, prompt = p.rid, p.prefill, p.num_stages, p.kv_timeout, p.prompt_ids
        stages = self.registry.stages_of(prefill, n)
        st = self.engine.stats()
        need = -(-(len(prompt) + 1) // st.page_size)
        if st.pages_free - need < st.num_running:  # leave every running request room to grow a page
            self.counters["busy"] += 1
            raise NoFreePages(
                f"decode {self.name}: {st.pages_free} free pages, {need} needed + {st.num_running} kept for the "
                "running requests: retry when requests finish"
            )
        with self._lock:
            pages = self.engine.prealloc(rid, prompt, p.params)
            self.inbound[rid] = Inbound(
                rid=rid,
                prefill=prefill,
                num_stages=n,
                stage_rpc={e.stage: e.rpc for e in stages},
                kv_timeout=kv_timeout,
                deadline=time.monotonic() + kv_timeout + self.cfg.kv_grace,
            )
            self.counters["prealloc"] += 1
        return Preallocated(pages=page_list(pages), boot=self.boot)

    def _rpc_stage_done(self, p: StageDone) -> StageDoneReply:
        rid, stage, ok = p.rid, p.stage, p.ok
        with self._lock:
            inb = self.inbound.get(rid)
            if inb is None:
                return StageDoneReply(accepted=False)
            if not 0 <= stage < inb.num_stages:
                raise ConfigError(f"request {rid}: stage {stage} reported, but its prefill has {inb.num_stages} stages")
            inb.reported[stage] = ok
            inb.bytes += p.bytes
            if p.quarantine_s > 0:
                inb.hold_until = max(inb.hold_until, time.monotonic() + p.quarantine_s)
            if p.first_token is not None:
                inb.first_token = p.first_token
            if inb.failed is None and not ok:
                self._fail(inb, f"prefill {inb.prefill} stage {stage}: {p.error or 'failed'}")
            elif inb.failed is None and len(inb.reported) == inb.num_stages and inb.first_token is not None:
                self._start(inb)
                return StageDoneReply(accepted=True, started=True)
            if inb.failed is not None:
                self._maybe_release(inb)
        return StageDoneReply(accepted=True)

    def _rpc_kv_failed(self, p: KvFailed) -> bool:
        with self._lock:
            inb = self.inbound.get(p.rid)
            if inb is None or inb.failed is not None:
                return False
            self._fail(inb, p.error or f"prefill {inb.prefill} failed the request")
            self._maybe_release(inb)
        return True

    def _rpc_events(self, p: EventsQuery) -> Events:
        wait = min(5.0, max(0.0, p.wait))
        return replace(self.events.since(p.since, wait), boot=self.boot)

    def _rpc_abort(self, p: Abort) -> bool:
        rid = p.rid
        why = p.why or "aborted"
        with self._lock:
            inb = self.inbound.get(rid)
            if inb is not None:
                if inb.failed is None:
                    self._fail(inb, why, reason="abort")
                self._maybe_release(inb)
                return True
        return self.engine.abort(rid) is not None

    # ---- inbound requests ------------------------------------------------------------------------------

    def _start(self, inb: Inbound) -> None:
        self.engine.start_decode(inb.rid, inb.first_token if inb.first_token is not None else 0)
        del self.inbound[inb.rid]
        self.counters["started"] += 1
        self.counters["kv_bytes"] += inb.bytes
        self._wake.set()

    def _fail(self, inb: Inbound, error: str, reason: str = "error") -> None:
        inb.failed = error
        self.counters["kv_failed"] += 1
        self._suppress.add(inb.rid)
        self.events.append(inb.rid, [], True, reason, error if reason == "error" else None)
        log.warning("decode %s: request %s failed before decoding: %s", self.name, inb.rid, error)

    def _maybe_release(self, inb: Inbound) -> None:
        """Free a failed request's pages once no prefill stage can still write them."""
        now = time.monotonic()
        settled = all(k in inb.reported or k in inb.dead for k in range(inb.num_stages))
        hard = inb.deadline + self.backend.quarantine_s
        if (settled and now >= inb.hold_until) or now >= max(hard, inb.hold_until):
            self.inbound.pop(inb.rid, None)
            self.engine.abort(inb.rid)
            self._wake.set()

    # ---- loops ---------------------------------------------------------------------------------------

    def _step_loop(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            try:
                outs = eng.step()
            except Exception:
                log.exception("decode %s: engine step failed", self.name)
                time.sleep(0.05)
                continue
            for o in outs:
                if o.request_id in self._suppress:
                    if o.finished:
                        self._suppress.discard(o.request_id)
                    continue
                self.counters["tokens"] += len(o.new_token_ids)
                if o.finished:
                    self.counters["finished"] += 1
                reason = o.finish_reason.value if o.finish_reason is not None else None
                self.events.append(o.request_id, list(o.new_token_ids), o.finished, reason, o.error)
            sch = eng.scheduler
            if not outs and not (sch.running or sch.ready or sch.waiting):
                self._wake.wait(0.005)
                self._wake.clear()

    def _monitor_loop(self) -> None:
        last_ping = 0.0
        while not self._stop.is_set():
            self._stop.wait(0.05)
            now = time.monotonic()
            with self._lock:
                for inb in list(self.inbound.values()):
                    if inb.failed is None and now >= inb.deadline:
                        self._fail(
                            inb,
                            f"request {inb.rid}: the KV from prefill {inb.prefill} did not arrive within "
                            f"{inb.kv_timeout:g}s (+{self.cfg.kv_grace:g}s grace): stage(s) {inb.missing()} of "
                            f"{inb.num_stages} never reported",
                        )
                    if inb.failed is not None:
                        self._maybe_release(inb)
                waits: dict[str, list[tuple[Inbound, int]]] = {}
                if now - last_ping >= self.cfg.liveness_interval:
                    for inb in self.inbound.values():
                        for k in inb.missing():
                            if k not in inb.dead:
                                waits.setdefault(inb.stage_rpc[k], []).append((inb, k))
            if not waits:
                continue
            last_ping = now
            for addr, items in waits.items():
                verdict = self._ping(addr)
                if verdict is None:
                    continue
                with self._lock:
                    for inb, k in items:
                        if verdict == "dead":
                            inb.dead.add(k)
                        if self.inbound.get(inb.rid) is inb and inb.failed is None:
                            self._fail(inb, f"prefill {inb.prefill} stage {k} at {addr} is {verdict}: request lost")
                        if self.inbound.get(inb.rid) is inb:
                            self._maybe_release(inb)

    def _ping(self, addr: str) -> str | None:
        """None if the stage answers; 'dead' if nothing listens; 'not answering' if it does not reply."""
        if _refused(addr):
            return "dead"
        c = RpcClient(addr, timeout=1.0, connect_timeout=0.5)
        try:
            c.request(PING, Ping(), timeout=1.0)
            return None
        except PeerUnavailable:
            return "dead" if _refused(addr) else "not answering"
        except RpcError:
            return None
        finally:
            c.close()
