"""DecodeWorker: the decode side of disaggregated serving (one process).

    router ─ PREALLOC Prealloc(rid, prompt, params, prefill, num_stages, kv_timeout) ─► pages (held, WAITING_KV)
    prefill stage k ─ transfer (its layers' paired keys) ─► those pages
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
Imports torch, dsakv.engine and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsakv.disagg import grants
from dsakv.disagg.backends import make_backend
from dsakv.disagg.bootstrap import StageRegistry
from dsakv.disagg.errors import Forbidden
from dsakv.disagg.events import EventLog
from dsakv.disagg.lifecycle import DECODE, InboundKv, Ledger, Phase
from dsakv.disagg.manifest import Manifest
from dsakv.disagg.messages import (
    ABORT,
    DECODE_SERVICE,
    EVENTS,
    HANDSHAKE,
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
    Prealloc,
    Preallocated,
    StageDone,
    StageDoneReply,
    StageInfo,
    WireLogprobs,
    unpack_logprobs,
)
from dsakv.disagg.rpc import PeerUnavailable, RpcClient, RpcError, split_addr
from dsakv.disagg.timeouts import Timeouts
from dsakv.disagg.wire import page_list
from dsakv.disagg.worker_service import WorkerService
from dsakv.engine.engine import Engine
from dsakv.engine.request import RequestOutput
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

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        return Timeouts(
            rpc=self.rpc_timeout,
            connect=min(2.0, self.rpc_timeout),
            kv_grace=self.kv_grace,
            liveness_interval=self.liveness_interval,
        )


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


def draft_hidden_of(inb: InboundKv, hidden_size: int) -> torch.Tensor | None:
    """The prefill's draft hidden state (MTP) of `inb` as a tensor [H]; None if none came or it is malformed
    (then the first decode step drafts nothing, which changes no output)."""
    raw = inb.draft_hidden
    if raw is None:
        return None
    if len(raw) != 4 * hidden_size:
        log.warning("request %s: a %d-byte draft hidden state, expected %d: unused", inb.rid, len(raw), 4 * hidden_size)
        return None
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())


class DecodeWorker:
    def __init__(
        self, cfg: DecodeConfig, model: tuple[Any, Any] | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.cfg = cfg
        self.t = cfg.timeouts
        self.engine = Engine(model if model is not None else Path(cfg.model), model_dir=cfg.model, **cfg.engine)
        self.backend = make_backend(cfg.backend, **cfg.backend_options)
        self.backend.register(self.engine.pool.regions())
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
        self.boot = self.service.boot
        self.name = cfg.name or f"decode@{self.address}"
        self.manifest = Manifest.from_pool(self.engine.pool, self.backend.meta(), worker=self.name)
        self.registry = StageRegistry(self.manifest)
        self.grant_key = grants.new_key()  # signs this process's page grants; handed to handshaken stages only
        self.events = EventLog()
        self.inbound: Ledger[InboundKv] = Ledger(DECODE, clock, keep_done=False)
        self._suppress: set[str] = set()  # failed while inbound: their abort output is not an event
        self._choices: dict[str, int] = {}  # n > 1 requests: how many choices (the forks '<rid>/<i>' abort with it)
        self._forks_left: dict[str, int] = {}  # ... and how many of its forks have not finished
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self.counters = dict.fromkeys(
            ("prealloc", "busy", "started", "kv_failed", "finished", "tokens", "kv_bytes", "reports_refused"), 0
        )
        st = self.engine.stats()
        log.info(
            "decode %s: %d pages x %d tokens, %d B/token, elide=%s, backend %s, rpc %s",
            self.name,
            st.pages_total,
            st.page_size,
            st.bytes_per_token,
            self.engine.layout.elide,
            cfg.backend,
            self.address,
        )

    @property
    def address(self) -> str:
        return self.service.address

    def start(self) -> DecodeWorker:
        self.service.start([(self._step_loop, "decode-step"), (self._monitor_loop, "decode-monitor")])
        return self

    def request_stop(self) -> None:
        self.service.request_stop()

    def stop(self) -> None:
        self.service.request_stop()
        self._wake.set()
        self.service.stop(join_timeout=5)
        self.backend.close()

    def serve_forever(self) -> None:
        self.service.serve_forever()

    # ---- RPC ----------------------------------------------------------------------------------------

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
            failed_held = len(self.inbound.in_phase(Phase.FAILED))
            inbound = len(self.inbound) - failed_held
        return Health(
            ok=not self.service.stopping.is_set(),
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
            spec=self._spec_counters(),
        )

    def _spec_counters(self) -> dict[str, float] | None:
        """Engine.spec_stats() without the engine lock (plain counters): health must not wait for another step."""
        sp = self.engine.speculator
        return sp.stats.to_dict() if sp is not None else None

    def _rpc_handshake(self, hello: Hello) -> HelloReply:
        self.registry.accept(hello)  # IncompatiblePeer / ManifestError travel back to the stage
        return HelloReply(manifest=self.manifest.to_bytes(), boot=self.boot, name=self.name, grant_key=self.grant_key)

    def prealloc(self, p: Prealloc) -> Preallocated:
        """Reserve the request's pages (held, waiting for KV) and start tracking its stages' reports."""
        rid, prefill, n, kv_timeout, prompt = p.rid, p.prefill, p.num_stages, p.kv_timeout, p.prompt_ids
        stages = self.registry.stages_of(prefill, n)
        st = self.engine.stats()
        need = -(-(len(prompt) + 1) // st.page_size)
        if p.params.n > 1:  # the other choices recompute the prompt's last partial page in pages of their own
            tail = len(prompt) - (len(prompt) - 1) // st.page_size * st.page_size
            need += (p.params.n - 1) * -(-(tail + 1) // st.page_size)
        if st.pages_free - need < st.num_running:  # leave every running request room to grow a page
            self.counters["busy"] += 1
            raise NoFreePages(
                f"decode {self.name}: {st.pages_free} free pages, {need} needed + {st.num_running} kept for the "
                "running requests: retry when requests finish"
            )
        with self._lock:
            pages = self.engine.prealloc(rid, prompt, p.params)
            inb = InboundKv(
                rid=rid,
                prefill=prefill,
                num_stages=n,
                stage_rpc={e.stage: e.rpc for e in stages},
                stage_boot={e.stage: e.boot for e in stages},
                kv_timeout=kv_timeout,
            )
            self.inbound.add(inb)
            inb.deadline = self.inbound.now() + kv_timeout + self.t.kv_grace
            if p.params.n > 1:
                self._choices[rid] = p.params.n
                self._forks_left[rid] = p.params.n - 1
            inb.grant = grants.sign(
                self.grant_key,
                rid=rid,
                prefill=prefill,
                boot=self.boot,
                pages=page_list(pages),
                expires=time.time() + kv_timeout + self.t.kv_grace,
            )
            self.counters["prealloc"] += 1
        return Preallocated(pages=page_list(pages), boot=self.boot, grant=inb.grant)

    def _boots(self, inb: InboundKv, k: int) -> set[str]:
        """The processes that may report stage k of a request: the one registered at its prealloc, or the one
        registered now (the stage restarted and re-registered while the request was being dispatched)."""
        now = self.registry.boot_of(inb.prefill, k)
        return {b for b in (inb.stage_boot.get(k), now) if b}

    def _refuse_report(self, what: str, why: str) -> Forbidden:
        self.counters["reports_refused"] += 1
        log.warning("decode %s: refused %s: %s", self.name, what, why)
        return Forbidden(f"decode {self.name}: {what} refused: {why}")

    def stage_done(self, p: StageDone) -> StageDoneReply:
        """Stage p.stage reported its transfer: start decoding once all did, fail the request if it failed."""
        rid, stage, ok = p.rid, p.stage, p.ok
        with self._lock:
            inb = self.inbound.get(rid)
            if inb is None:
                return StageDoneReply(accepted=False)
            if not 0 <= stage < inb.num_stages:
                raise ConfigError(f"request {rid}: stage {stage} reported, but its prefill has {inb.num_stages} stages")
            if p.boot not in self._boots(inb, stage) or p.prefill != inb.prefill:
                raise self._refuse_report(
                    f"stage_done of {rid} stage {stage}",
                    f"from prefill {p.prefill!r} boot {p.boot or '(none)'}, but the request's stage {stage} is "
                    f"prefill {inb.prefill!r} boot {inb.stage_boot.get(stage)}",
                )
            if p.grant != inb.grant:
                raise self._refuse_report(f"stage_done of {rid} stage {stage}", "it does not carry the request's grant")
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
                self._fail(inb, f"prefill {inb.prefill} stage {stage}: {p.error or 'failed'}")
            elif waiting and len(inb.reported) == inb.num_stages and inb.first_token is not None:
                self._start(inb)
                return StageDoneReply(accepted=True, started=True)
            if inb.phase is Phase.FAILED:
                self._maybe_release(inb)
        return StageDoneReply(accepted=True)

    def kv_failed(self, p: KvFailed) -> bool:
        """A prefill dropped the request before transferring it."""
        with self._lock:
            inb = self.inbound.get(p.rid)
            if inb is None or inb.phase is not Phase.AWAITING_KV:
                return False
            if not any(p.boot in self._boots(inb, k) for k in range(inb.num_stages)):
                raise self._refuse_report(
                    f"kv_failed of {p.rid}", f"boot {p.boot or '(none)'} is none of the request's stages"
                )
            self._fail(inb, p.error or f"prefill {inb.prefill} failed the request")
            self._maybe_release(inb)
        return True

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
                    self._fail(inb, why, reason="abort")
                self._maybe_release(inb)
                return True
            if p.choice is not None:  # one choice of an n > 1 request (its stop string matched)
                return self.engine.abort(rid if p.choice == 0 else f"{rid}/{p.choice}") is not None
        return self._abort_choices(rid)

    def _abort_choices(self, rid: str) -> bool:
        """Abort every choice of request `rid`: the forks '<rid>/<i>' first (aborting choice 0 before it forked
        would queue them as requests of their own)."""
        found = False
        for i in range(self._choices.get(rid, 1) - 1, 0, -1):
            found = self.engine.abort(f"{rid}/{i}") is not None or found
        return self.engine.abort(rid) is not None or found

    # ---- inbound requests ------------------------------------------------------------------------------

    def _start(self, inb: InboundKv) -> None:
        first = inb.first_token if inb.first_token is not None else 0
        self.engine.start_decode(
            inb.rid,
            first,
            inb.first_logprobs,
            inb.prompt_logprobs or (),
            inb.cached_tokens,
            draft_hidden=draft_hidden_of(inb, self.engine.spec.hidden_size),
        )
        self.inbound.move(inb, Phase.DECODING)
        self.counters["started"] += 1
        self.counters["kv_bytes"] += inb.bytes
        self._wake.set()

    def _fail(self, inb: InboundKv, error: str, reason: str = "error") -> None:
        self.inbound.move(inb, Phase.FAILED, error)
        self.counters["kv_failed"] += 1
        self._suppress.add(inb.rid)
        self._suppress.update(f"{inb.rid}/{i}" for i in range(1, self._choices.get(inb.rid, 1)))
        self.events.append(inb.rid, [], True, reason, error if reason == "error" else None)
        log.warning("decode %s: request %s failed before decoding: %s", self.name, inb.rid, error)

    def _maybe_release(self, inb: InboundKv) -> None:
        """Free a failed request's pages once no prefill stage can still write them."""
        now = self.inbound.now()
        hard = inb.deadline + self.backend.quarantine_s
        if (inb.settled() and now >= inb.hold_until) or now >= max(hard, inb.hold_until):
            self.inbound.move(inb, Phase.DONE)
            self._abort_choices(inb.rid)
            self._choices.pop(inb.rid, None)
            self._forks_left.pop(inb.rid, None)
            self._wake.set()

    # ---- loops ---------------------------------------------------------------------------------------

    def _step_loop(self) -> None:
        eng = self.engine
        while not self.service.stopping.is_set():
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
        for o in outs:
            if o.request_id in self._suppress:
                if o.finished:
                    self._suppress.discard(o.request_id)
                continue
            self.counters["tokens"] += len(o.new_token_ids)
            if o.finished:
                self.counters["finished"] += 1
            self._event(o)
        return len(outs)

    def _event(self, o: RequestOutput) -> None:
        """One engine output as an event of its request (choice i > 0 of an n > 1 request runs as '<rid>/<i>')."""
        rid, i = o.request_id, o.choice_index
        if i:
            rid = rid[: -len(f"/{i}")]
            if o.finished:
                with self._lock:
                    left = self._forks_left.get(rid, 1) - 1
                    if left > 0:
                        self._forks_left[rid] = left
                    else:  # every fork finished: an abort of the request is choice 0's alone now
                        self._forks_left.pop(rid, None)
                        self._choices.pop(rid, None)
        reason = o.finish_reason.value if o.finish_reason is not None else None
        self.events.append(
            rid,
            list(o.new_token_ids),
            o.finished,
            reason,
            o.error,
            choice=i,
            logprobs=WireLogprobs.pack(o.new_logprobs) if o.new_logprobs else None,
            prompt_logprobs=WireLogprobs.pack(o.prompt_logprobs) if o.prompt_logprobs is not None else None,
            cached_tokens=o.num_cached_tokens if i == 0 else 0,
        )

    def check_deadlines(self) -> None:
        """Fail every request whose KV did not arrive by its deadline; free failed requests' pages once no
        stage can still write them (the monitor thread calls this every 50 ms)."""
        with self._lock:
            for inb in self.inbound.expired():
                if inb.phase is Phase.AWAITING_KV:
                    self._fail(
                        inb,
                        f"request {inb.rid}: the KV from prefill {inb.prefill} did not arrive within "
                        f"{inb.kv_timeout:g}s (+{self.t.kv_grace:g}s grace): stage(s) {inb.missing()} of "
                        f"{inb.num_stages} never reported",
                    )
            for inb in self.inbound.in_phase(Phase.FAILED):
                self._maybe_release(inb)

    def stage_verdict(
        self, addr: str, verdict: str | None, waits: list[tuple[InboundKv, int]], why: str | None = None
    ) -> None:
        """A liveness ping of stage `addr` said `verdict` (None: it answers; 'dead'; 'not answering'): the
        requests waiting for it fail, and a dead stage (or one that restarted: `why`) can no longer write their
        pages."""
        if verdict is None or not waits:
            return
        with self._lock:
            for inb, k in waits:
                if verdict == "dead":
                    inb.dead.add(k)
                if self.inbound.get(inb.rid) is not inb:
                    continue
                if inb.phase is Phase.AWAITING_KV:
                    self._fail(inb, f"prefill {inb.prefill} stage {k} at {addr} is {why or verdict}: request lost")
                self._maybe_release(inb)

    def _monitor_loop(self) -> None:
        last_ping = 0.0
        stopping = self.service.stopping
        while not stopping.is_set():
            stopping.wait(0.05)
            self.check_deadlines()
            now = self.inbound.now()
            if now - last_ping < self.t.liveness_interval:
                continue
            waits: dict[str, list[tuple[InboundKv, int]]] = {}
            with self._lock:
                for inb in self.inbound.values():
                    for k in inb.missing():
                        if k not in inb.dead:
                            waits.setdefault(inb.stage_rpc[k], []).append((inb, k))
            if not waits:
                continue
            last_ping = now
            for addr, items in waits.items():
                verdict, boot = self._ping(addr)
                if verdict is None and boot is not None:  # it answers: as the process the requests wait for?
                    with self._lock:
                        gone = [(inb, k) for inb, k in items if boot not in self._boots(inb, k)]
                    self.stage_verdict(addr, "dead", gone, f"restarted (now boot {boot})")
                else:
                    self.stage_verdict(addr, verdict, items)

    def _ping(self, addr: str) -> tuple[str | None, str | None]:
        """(None, its boot id) if the stage answers; ('dead', None) if nothing listens; ('not answering', None)
        if it does not reply."""
        if _refused(addr, self.t.ping / 2):
            return "dead", None
        c = RpcClient(addr, timeout=self.t.ping, connect_timeout=self.t.ping / 2)
        try:
            return None, c.request(PING, Ping(), timeout=self.t.ping).boot
        except PeerUnavailable:
            return ("dead" if _refused(addr, self.t.ping / 2) else "not answering"), None
        except RpcError:
            return None, None
        finally:
            c.close()
