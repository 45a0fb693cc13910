"""V4DecodeWorker: the decode role of disaggregated serving for a DeepSeek-V4 checkpoint (one process).

    prefill stage k ─ HANDSHAKE Hello(V4Manifest of its layers) ─► check_v4_pair(this layout, it): its keys paired
                      (IncompatiblePeer naming the kind and both sizes) ◄─ HelloReply(this V4Manifest, grant key)
    router ─ PREALLOC ─► V4ServingEngine.accept: pages for prompt + max_new_tokens and one state slot, parked;
                      the grant signs (rid, prefill, boot, pages, expiry, slot = the STATE slot)
    prefill stage k ═ v4_blocks: its paged kinds into those pages, its state keys into that slot ═► this pool
                    ─ STAGE_DONE(rid, k, ok, bytes, first token (last stage)) ─►
    every stage reported ok, the first token known ─► V4ServingEngine.start ─► continuous batching (V4Engine)
    router ◄─ EVENTS (EventLog, long-poll): the same token events as the DSA decode worker's

Every decode key must come from some handshaken stage of the request's prefill (the stages' keys together cover
this layout), else PREALLOC refuses with IncompatiblePeer (the router pairs them again). A request whose stages
have not all reported by its deadline (kv_timeout + grace) fails naming the missing stages, and at once when the
prefill process it waits for is gone (pinged every liveness interval: nothing listens, or another boot answers);
a failed or aborted request frees its pages and slot once every stage reported (no write can still land), its
process is gone, or its deadline plus the quarantine a timed-out write asked for passed. Greedy or seeded
sampling (the router's seed: the prefill drew token 0, this decode 1..), one choice, no logprobs or penalties:
those are refused at PREALLOC naming the parameter. Imports torch (through
the engine), dsakv.engine and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from dsakv.config import DecodeConfig
from dsakv.disagg.decode.events import EventLog
from dsakv.disagg.decode.liveness import ping_stage
from dsakv.disagg.decode.outputs import DecodeOutputs
from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.errors import Forbidden, IncompatiblePeer
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
    KvFailed,
    Prealloc,
    Preallocated,
    StageDone,
    StageDoneReply,
    StageInfo,
)
from dsakv.disagg.protocol.worker_service import WorkerService
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.v4 import V4Manifest, check_v4_pair
from dsakv.engine.v4_serve import check_v4_params
from dsakv.errors import CapacityError, ConfigError, NoFreePages
from dsakv.spec.layout import BufferKey

log = logging.getLogger(__name__)


@dataclass
class V4Stage:
    """A prefill stage that handshook: its process (boot), address, layers and the keys it writes here."""

    prefill: str
    stage: int
    num_stages: int
    rpc: str
    boot: str
    layers: tuple[int, int]
    keys: frozenset[BufferKey]


@dataclass
class V4Inbound:
    """A request whose pages and state slot wait for its prefill stages' KV."""

    rid: str
    prefill: str
    boots: dict[int, str]  # stage -> the process registered for it at prealloc
    deadline: float
    grant: bytes
    reported: dict[int, bool] = field(default_factory=dict)
    first_token: int | None = None
    cached_tokens: int = 0
    bytes: int = 0
    failed: str | None = None
    hold_until: float = 0.0  # a timed-out write may land until then

    @property
    def missing(self) -> list[int]:
        return sorted(set(self.boots) - set(self.reported))


class V4DecodeWorker:
    """RPCs, the step loop and the deadline monitor of a DeepSeek-V4 decode (see the module docstring)."""

    def __init__(self, cfg: DecodeConfig) -> None:
        from dsakv.engine.choose import open_engine

        if cfg.tp_size > 1 or (cfg.pipeline is not None and cfg.pipeline.pp_size > 1):
            raise ConfigError("a DeepSeek-V4 decode runs on one rank and one stage for now: drop --tp-size / --pp-size")
        self.cfg = cfg
        self.t = cfg.timeouts
        self.engine = open_engine(Path(cfg.model), cfg.config.engine)  # V4ServingEngine
        self.pool = self.engine.engine.pool
        self.layout = self.engine.layout
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.backend.register(self.pool.regions())
        self.service = WorkerService(
            DECODE_SERVICE,
            {
                HANDSHAKE: self.handshake,
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
        self.manifest = V4Manifest.from_pool(self.pool, self.backend.meta(), self.name)
        self.grant_key = grants.new_key()
        self.stages: dict[tuple[str, int], V4Stage] = {}
        self.inbound: dict[str, V4Inbound] = {}
        self.events = EventLog()
        self.stats = DecodeStats()
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self.outputs = DecodeOutputs(self.events, self.stats, self._lock)
        log.info(
            "decode %s (DeepSeek-V4): %d pages x %d tokens, %d request slots, %d B/token + %d B state per request, "
            "backend %s, rpc %s", self.name, self.engine.engine.pages.num_pages, self.layout.page,
            self.engine.engine.slots.num_slots, int(self.layout.bytes_per_token), self.layout.state_bytes_per_request,
            cfg.config.transfer.backend, self.address,
        )  # fmt: skip

    @property
    def address(self) -> str:
        return self.service.address

    def start(self) -> V4DecodeWorker:
        self.service.start([(self._step_loop, "v4-decode-step"), (self._monitor_loop, "v4-decode-monitor")])
        return self

    def request_stop(self) -> None:
        self.service.request_stop()

    def stop(self) -> None:
        self.service.request_stop()
        self._wake.set()
        self.service.stop(join_timeout=5)
        self.backend.close()
        self.engine.close()

    def serve_forever(self) -> None:
        self.service.serve_forever()

    # ---- RPC -------------------------------------------------------------------------------------------

    def handshake(self, hello: Hello) -> HelloReply:
        """Pair the stage's keys with this layout (IncompatiblePeer / ManifestError travel back) and register it
        under its boot; a stage's re-handshake from a new process replaces the old registration."""
        theirs = V4Manifest.from_bytes(hello.manifest)
        pairs = check_v4_pair(self.layout, theirs)
        if hello.stage >= hello.num_stages:
            raise ConfigError(f"handshake: stage {hello.stage} of a {hello.num_stages}-stage prefill")
        start, end = theirs.identity["layers"]
        entry = V4Stage(
            hello.prefill, hello.stage, hello.num_stages, hello.rpc, hello.boot, (int(start), int(end)),
            frozenset(p.key for p in pairs),
        )  # fmt: skip
        with self._lock:
            old = self.stages.get((hello.prefill, hello.stage))
            self.stages[(hello.prefill, hello.stage)] = entry
        if old is None or old.boot != entry.boot:
            log.info(
                "decode %s: prefill %s stage %d/%d (layers %d-%d, boot %s) paired %d keys", self.name, hello.prefill,
                hello.stage, hello.num_stages, start, end - 1, hello.boot, len(pairs),
            )  # fmt: skip
        return HelloReply(manifest=self.manifest.to_bytes(), boot=self.boot, name=self.name, grant_key=self.grant_key)

    def _stages_of(self, prefill: str, n: int) -> dict[int, V4Stage]:
        """Stages 0..n-1 of `prefill`, each handshaken with n stages, covering every key of this layout."""
        with self._lock:
            got = {k: s for (p, k), s in self.stages.items() if p == prefill and s.num_stages == n and k < n}
        if len(got) != n:
            missing = sorted(set(range(n)) - set(got))
            raise IncompatiblePeer(
                f"decode {self.name}: prefill {prefill!r} stage(s) {', '.join(map(str, missing))} of {n} have not "
                "handshaken with it"
            )
        held: set[BufferKey] = set().union(*(s.keys for s in got.values()))
        uncovered = sorted(set(self.layout.keys) - held)
        if uncovered:
            raise IncompatiblePeer(
                f"decode {self.name}: no stage of prefill {prefill!r} holds {uncovered[0]} ({len(uncovered)} keys "
                "uncovered): the prefill's stages must hold every layer the decode holds"
            )
        return got

    def prealloc(self, p: Prealloc) -> Preallocated:
        if p.kv_timeout > self.t.max_kv:
            raise ConfigError(
                f"decode {self.name}: request {p.rid} asks its pages be held {p.kv_timeout:g}s for its KV, more than "
                f"this decode's --max-kv-timeout {self.t.max_kv:g}s: lower the router's --kv-timeout"
            )
        ps = p.params
        check_v4_params(ps)  # ConfigError naming n > 1, logprobs, penalties
        stages = self._stages_of(p.prefill, p.num_stages)
        with self._lock:
            if p.rid in self.inbound:
                raise ConfigError(f"request id {p.rid!r} is already inbound on decode {self.name}")
            try:  # the first token is a placeholder until the last stage reports it
                pages, slot = self.engine.accept(p.rid, p.prompt_ids, 0, ps)
            except CapacityError as e:
                self.stats.busy += 1
                raise NoFreePages(f"decode {self.name}: {e}") from None
            deadline = time.monotonic() + p.kv_timeout + self.t.kv_grace
            grant = grants.sign(
                self.grant_key,
                rid=p.rid,
                prefill=p.prefill,
                boot=self.boot,
                pages=pages,
                expires=time.time() + p.kv_timeout + self.t.kv_grace,
                slot=slot,  # a V4 grant's slot is the request's state slot
            )
            self.inbound[p.rid] = V4Inbound(p.rid, p.prefill, {k: s.boot for k, s in stages.items()}, deadline, grant)
            self.outputs.add(p.rid, 1)
            self.stats.prealloc += 1
        return Preallocated(pages=pages, boot=self.boot, grant=grant)

    def _check_report(self, inb: V4Inbound, what: str, stage: int, boot: str, grant: bytes) -> None:
        if stage not in inb.boots or boot != inb.boots[stage] or not hmac.compare_digest(grant, inb.grant):
            self.stats.reports_refused += 1
        if stage not in inb.boots:
            raise Forbidden(f"decode {self.name}: {what} refused: stage {stage} is not one of its stages")
        if boot != inb.boots[stage]:
            raise Forbidden(
                f"decode {self.name}: {what} refused: boot {boot or '(none)'} is not its stage {stage} "
                f"(boot {inb.boots[stage]})"
            )
        if not hmac.compare_digest(grant, inb.grant):
            raise Forbidden(f"decode {self.name}: {what} refused: it does not carry the request's grant")

    def stage_done(self, p: StageDone) -> StageDoneReply:
        with self._lock:
            inb = self.inbound.get(p.rid)
            if inb is None or p.prefill != inb.prefill:
                return StageDoneReply(accepted=False)
            self._check_report(inb, f"stage_done of {p.rid}", p.stage, p.boot, p.grant)
            inb.reported[p.stage] = p.ok
            inb.bytes += p.bytes
            if p.quarantine_s > 0:
                inb.hold_until = max(inb.hold_until, time.monotonic() + p.quarantine_s)
            if p.first_token is not None:
                inb.first_token = p.first_token
            if p.stage == 0:
                inb.cached_tokens = p.cached_tokens
            if inb.failed is None and not p.ok:
                self._fail(inb, f"prefill {inb.prefill} stage {p.stage}: {p.error or 'failed'}")
            if inb.failed is not None:
                self._maybe_release(inb)
                return StageDoneReply(accepted=True)
            if inb.missing or inb.first_token is None:
                return StageDoneReply(accepted=True)
            del self.inbound[inb.rid]
            self.engine.start(inb.rid, inb.first_token, inb.cached_tokens)
            self.stats.started += 1
            self.stats.kv_bytes += inb.bytes
        self._wake.set()
        return StageDoneReply(accepted=True, started=True)

    def kv_failed(self, p: KvFailed) -> bool:
        with self._lock:
            inb = self.inbound.get(p.rid)
            if inb is None or inb.failed is not None:
                return False
            self._check_report(inb, f"kv_failed of {p.rid}", p.stage, p.boot, p.grant)
            inb.reported[p.stage] = False
            self._fail(inb, p.error or f"prefill {inb.prefill} failed the request")
            self._maybe_release(inb)
        return True

    def _rpc_events(self, p: EventsQuery) -> Events:
        wait = min(self.t.max_poll_wait, max(0.0, p.wait))
        return replace(self.events.since(p.since, wait), boot=self.boot)

    def abort(self, p: Abort) -> bool:
        with self._lock:
            inb = self.inbound.get(p.rid)
            if inb is not None:
                if inb.failed is None:
                    self._fail(inb, p.why or "aborted", reason="abort")
                self._maybe_release(inb)
                return True
            return self.engine.abort(p.rid) is not None

    # ---- failures (under the lock) -----------------------------------------------------------------------

    def _fail(self, inb: V4Inbound, why: str, reason: str = "error") -> None:
        inb.failed = why
        self.stats.kv_failed += 1
        self.outputs.failed(inb.rid, reason, why)
        log.warning("decode %s: request %s failed: %s", self.name, inb.rid, why)

    def _maybe_release(self, inb: V4Inbound) -> None:
        """Free a failed request's pages and slot once no stage can still write them."""
        now = time.monotonic()
        if (inb.missing and now < inb.deadline) or now < inb.hold_until:
            return
        self.inbound.pop(inb.rid, None)
        self.engine.drop_inbound(inb.rid)
        self.outputs.forget(inb.rid)

    # ---- loops ---------------------------------------------------------------------------------------------

    def _step_loop(self) -> None:
        while not self.service.stopping.is_set():
            try:
                n = self.outputs.publish(self.engine.step())
            except Exception:
                log.exception("decode %s: engine step failed", self.name)
                time.sleep(0.05)
                continue
            if not n and not self.engine.has_unfinished():
                self._wake.wait(0.005)
                self._wake.clear()

    def check_deadlines(self) -> None:
        """Fail the requests whose stages did not all report by the deadline; free failed ones' pages when safe."""
        now = time.monotonic()
        with self._lock:
            for inb in list(self.inbound.values()):
                if inb.failed is None and now >= inb.deadline:
                    self._fail(
                        inb,
                        f"request {inb.rid}: prefill {inb.prefill} stage(s) {', '.join(map(str, inb.missing))} did not "
                        "report its KV by the deadline (--kv-timeout)" if inb.missing else
                        f"request {inb.rid}: its first token never came by the deadline",
                    )  # fmt: skip
                if inb.failed is not None:
                    self._maybe_release(inb)

    def check_liveness(self) -> None:
        """Ping the prefill processes that inbound requests still wait for: one that is gone (nothing listens) or
        restarted (another boot answers) fails its requests at once, and their pages and slot come back (a dead
        process's write cannot land). One that does not answer keeps them until the deadline."""
        with self._lock:
            waits: dict[str, list[tuple[V4Inbound, int]]] = {}
            for inb in self.inbound.values():
                for k in inb.missing if inb.failed is None else ():
                    st = self.stages.get((inb.prefill, k))
                    if st is not None:
                        waits.setdefault(st.rpc, []).append((inb, k))
        for addr, ws in waits.items():
            verdict, boot = ping_stage(addr, self.t.ping)
            gone = "nothing listens there" if verdict == "dead" else None
            if verdict is None and boot is not None and any(boot != inb.boots[k] for inb, k in ws):
                gone = f"it restarted (boot {boot})"
            if gone is None:
                continue
            with self._lock:
                for inb, k in ws:
                    if inb.failed is None and boot != inb.boots[k]:
                        inb.reported[k] = False
                        self._fail(
                            inb, f"prefill {inb.prefill} stage {k} at {addr} is gone ({gone}): its KV will not come"
                        )
                    if inb.failed is not None:
                        for j in inb.missing:  # every stage of a dead process is that process
                            inb.reported[j] = False
                        self._maybe_release(inb)

    def _monitor_loop(self) -> None:
        last_ping = 0.0
        while not self.service.stopping.wait(0.05):
            try:
                self.check_deadlines()
                if time.monotonic() - last_ping >= self.t.liveness_interval:
                    last_ping = time.monotonic()
                    self.check_liveness()
            except Exception:
                log.exception("decode %s: deadline / liveness check failed", self.name)

    # ---- views ---------------------------------------------------------------------------------------------

    def integrity(self) -> str:
        with self._lock, self.engine.lock:  # the worker's books, then the engine's (the order stage_done takes)
            try:
                self.engine.engine.check_integrity()
            except AssertionError as e:
                return str(e)
            parked = set(self.engine.engine.parked)
            want = {self.engine._rid[r] for r in self.inbound if r in self.engine._rid}
            if parked != want:
                return f"parked requests {sorted(parked)} are not the inbound ones {sorted(want)}"
        return "ok"

    def health(self) -> DecodeHealth:
        st = self.engine.stats()
        with self._lock:
            stages = [
                StageInfo(
                    stage=s.stage, rpc=s.rpc, boot=s.boot, prefill=s.prefill, layers=[s.layers[0], s.layers[1] - 1]
                )
                for s in self.stages.values()
            ]
            inbound = len(self.inbound)
            failed_held = sum(1 for i in self.inbound.values() if i.failed is not None)
        out_room = self.layout.page  # a prompt must leave its output at least one page of the pool
        return DecodeHealth(
            ok=True,
            role="decode",
            name=self.name,
            pid=os.getpid(),
            boot=self.boot,
            elide=True,
            backend=self.cfg.config.transfer.backend,
            page_size=st.page_size,
            pages_total=st.pages_total,
            pages_used=st.pages_used,
            pages_free=st.pages_free,
            capacity_tokens=st.capacity_tokens,
            integrity=self.integrity(),
            counters=self.stats.as_dict(),
            stages=stages,
            waiting=st.num_waiting,
            running=st.num_running,
            bytes_per_token=st.bytes_per_token,
            max_prompt_tokens=max(0, st.capacity_tokens - out_room),
            inbound=inbound,
            failed_held=failed_held,
            vocab_size=int(self.engine.spec.vocab_size),
            features=sorted(self.engine.features),
        )
