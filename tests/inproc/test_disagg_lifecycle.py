"""Per-request lifecycles in one process, table-driven, on a fake clock.

The state machines of the router, a prefill stage and the decode worker (every edge allowed, every other refused);
the decode worker's ledger through every transition, timeout and failure path (its RPC handlers called directly,
no threads); prefill stage 0's ledger (an in-process stage, its loop stepped by hand); the router's (dispatch and
event polls stepped by hand against scripted peers behind the real RPC server and service specs). Every case ends
with the pages accounted for: exact counts held, then none, and the books balance."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from dsakv.cache.device_pool import DevicePool
from dsakv.config import DecodeConfig, PrefillConfig, RouterConfig
from dsakv.disagg.decode.worker import DecodeWorker
from dsakv.disagg.prefill.worker import PrefillStage
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.errors import Unavailable
from dsakv.disagg.protocol.lifecycle import (
    DECODE,
    PREFILL_STAGE,
    ROUTER,
    IllegalTransition,
    Ledger,
    Machine,
    Phase,
    Tracked,
)
from dsakv.disagg.protocol.messages import (
    ABORT,
    CACHE_EVENTS,
    CONNECT,
    DECODE_SERVICE,
    EVENTS,
    HANDSHAKE,
    KV_FAILED,
    PREALLOC,
    PREFILL_LEADER_SERVICE,
    RELEASED,
    REVOKE,
    STAGE_DONE,
    SUBMIT,
    Abort,
    CacheEvents,
    Connected,
    DecodeHealth,
    EventRow,
    Events,
    Health,
    Hello,
    KvFailed,
    Prealloc,
    Preallocated,
    PrefillHealth,
    Revoked,
    StageDone,
    StageDoneReply,
    Submit,
    Submitted,
)
from dsakv.disagg.protocol.rpc import RpcClient
from dsakv.disagg.protocol.worker_service import WorkerService
from dsakv.disagg.router.backend import RouterBackend
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError, NoFreePages
from dsakv.testing.cluster import role_config
from dsakv.testing.engines import tiny_model

pytestmark = [pytest.mark.timeout(120)]

P = Phase
EDGES = {
    "router": (
        ROUTER,
        [
            (P.QUEUED, P.DISPATCHED),
            (P.QUEUED, P.DONE),
            (P.DISPATCHED, P.DECODING),
            (P.DISPATCHED, P.DONE),
            (P.DISPATCHED, P.QUEUED),
            (P.DECODING, P.DONE),
        ],
    ),
    "prefill stage": (
        PREFILL_STAGE,
        [(P.COMPUTING, P.DONE), (P.COMPUTING, P.TRANSFERRING), (P.TRANSFERRING, P.DONE)],
    ),
    "decode": (DECODE, [(P.AWAITING_KV, P.DECODING), (P.AWAITING_KV, P.FAILED), (P.FAILED, P.DONE)]),
}


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("name", list(EDGES))
def test_machine_tables_allow_exactly_their_edges(name):
    machine, edges = EDGES[name]
    assert sorted(machine.transitions(), key=str) == sorted(edges, key=str)
    for a in machine.phases():
        for b in machine.phases():
            led: Ledger[Tracked] = Ledger(machine, Clock(), keep_done=True)
            rec = led.add(Tracked(rid="r"))
            rec.phase = a
            if (a, b) in edges:
                led.move(rec, b)
                assert rec.phase is b and led.moves == {(a, b): 1}
            else:
                with pytest.raises(IllegalTransition, match=f"{machine.name}: request r cannot go {a.value} -> "):
                    led.move(rec, b)


def test_ledger_clock_deadlines_and_terminal_records():
    clock = Clock()
    led: Ledger[Tracked] = Ledger(Machine("m", P.QUEUED, {P.QUEUED: frozenset({P.DONE})}, frozenset({P.DONE})), clock)
    a = led.add(Tracked(rid="a", deadline=1005.0))
    led.add(Tracked(rid="b"))
    assert (a.phase, a.since, led.expired()) == (P.QUEUED, 1000.0, [])
    clock.t = 1005.0
    assert led.expired() == [a]
    led.move(a, P.DONE, "late")
    assert "a" not in led and a.error == "late" and len(led) == 1 and list(led) == ["b"]
    with pytest.raises(Exception, match="request id 'b' is already in use on this m"):
        led.add(Tracked(rid="b"))


# ---- decode --------------------------------------------------------------------------------------------

ENGINE = dict(kv_format="fp32", index_format="fp32", page_size=16, num_pages=16)
PROMPT = list(range(2, 22))  # 20 tokens: 2 pages with the first token
RPC = ["127.0.0.1:1", "127.0.0.1:2"]  # the stages' addresses (never called: liveness verdicts are given)


def _decode(clock: Clock, stages: int) -> DecodeWorker:
    model = tiny_model("glm_moe_dsa")
    dec = DecodeWorker(DecodeConfig(model="", config=role_config(ENGINE), kv_grace=1.0), model, clock)
    spec, mdl = model
    bounds = [(0, spec.num_layers)] if stages == 1 else [(0, 5), (5, spec.num_layers)]
    for k, (a, b) in enumerate(bounds):
        pool = DevicePool(mdl.layout_for(elide=True, kv_format="fp32", index_format="fp32", page_size=16,
                                         layer_start=a, layer_end=b), 2)  # fmt: skip
        be = make_backend("local")
        be.register(pool.regions())
        manifest = Manifest.from_pool(pool, be.meta(), worker=f"P/stage{k}")
        dec._rpc_handshake(Hello("P", k, stages, RPC[k], manifest.to_bytes(), boot=f"boot{k}"))
        be.close()
    return dec


def _ok(k: int, first: int | None = None) -> StageDone:
    return StageDone("r", "P", k, True, None, 0.0, 100, first, boot=f"boot{k}")


def _bad(k: int, quarantine: float = 0.0) -> StageDone:
    return StageDone("r", "P", k, False, f"stage {k} broke", quarantine, boot=f"boot{k}")


# (name, stages, steps, phase after the steps, error in the request's event, pages held after the steps,
#  seconds to advance before the pages come back (None: decoding, freed by its abort))
# a step: a message to a handler, ("clock", seconds) + check_deadlines, or ("verdict", stage, verdict)
DECODE_CASES = [
    ("all stages ok", 2, [_ok(1), _ok(0, 7)], P.DECODING, None, 2, None),
    ("first token last", 2, [_ok(0), _ok(1, 7)], P.DECODING, None, 2, None),
    ("stage failed, other reported", 2, [_ok(0), _bad(1)], P.DONE, "prefill P stage 1: stage 1 broke", 0, 0.0),
    ("stage failed, other still writing", 2, [_bad(0)], P.FAILED, "stage 0 broke", 2, 5.0),
    ("failed with quarantine", 1, [_bad(0, 3.0)], P.FAILED, "stage 0 broke", 2, 3.0),
    ("kv_failed", 1, [KvFailed("r", "prefill P dropped it", "P", "boot0", 0)], P.FAILED, "dropped it", 2, 5.0),
    ("kv deadline", 1, [("clock", 5.0)], P.DONE, "did not arrive within 4s (+1s grace): stage(s) [0] of 1", 0, 0.0),
    ("stage dead", 1, [("verdict", 0, "dead")], P.DONE, "stage 0 at 127.0.0.1:1 is dead: request lost", 0, 0.0),
    ("stage not answering", 2, [_ok(1), ("verdict", 0, "not answering")], P.FAILED, "is not answering", 2, 5.0),
    ("abort while waiting", 1, [Abort("r", "client left")], P.FAILED, None, 2, 5.0),
    ("late report after failure", 1, [_bad(0), _ok(0, 7)], P.DONE, "stage 0 broke", 0, 0.0),
]


@pytest.mark.parametrize(("name", "stages", "steps", "phase", "error", "held", "release_after"), DECODE_CASES,
                         ids=[c[0] for c in DECODE_CASES])  # fmt: skip
def test_decode_lifecycle(name, stages, steps, phase, error, held, release_after):
    clock = Clock()
    dec = _decode(clock, stages)
    try:
        params = SamplingParams(max_new_tokens=4, ignore_eos=True)
        got = dec.prealloc(Prealloc("r", PROMPT, params, "P", stages, kv_timeout=4.0))
        assert got.pages == [0, 1] and dec.engine.stats().pages_used == 2
        inb = dec.inbound.get("r")
        assert inb is not None and (inb.phase, inb.deadline) == (P.AWAITING_KV, 1005.0)
        for step in steps:
            if isinstance(step, StageDone):
                dec.stage_done(replace(step, grant=got.grant))  # a stage reports with the grant it was given
            elif isinstance(step, KvFailed):
                dec.kv_failed(replace(step, grant=got.grant))  # the stage's report carries its grant too
            elif isinstance(step, Abort):
                dec.abort(step)
            elif step[0] == "clock":
                clock.t += step[1]
                dec.check_deadlines()
            else:
                dec.stage_verdict(RPC[step[1]], step[2], [(inb, step[1])])
        assert inb.phase is phase, (inb.phase, inb.error)
        assert dec.engine.stats().pages_used == held and dec.integrity() == "ok"
        events = dec.events.since(0).events
        if phase is P.DECODING:
            assert events == [] and dec.stats.started == 1 and dec.stats.kv_bytes == 100 * stages
            assert dec.abort(Abort("r"))  # the engine owns it now: abort frees its pages
        else:
            (ev,) = events
            assert (ev.rid, ev.tokens, ev.finished) == ("r", [], True)
            assert ev.reason == ("abort" if error is None else "error")
            assert error is None or (ev.error is not None and error in ev.error), ev.error
            # pages stay until no stage can still write them, not a moment earlier
            if release_after:
                clock.t += release_after - 0.01
                dec.check_deadlines()
                assert dec.engine.stats().pages_used == held
                clock.t += 0.01
            dec.check_deadlines()
        dec.engine.step()
        assert dec.engine.stats().pages_used == 0 and "r" not in dec.inbound and dec.integrity() == "ok"
    finally:
        dec.backend.close()


# ---- prefill stage 0 ---------------------------------------------------------------------------------------


def _stage(clock: Clock) -> PrefillStage:
    cfg = PrefillConfig(model="", config=role_config({"page_size": 16, "num_pages": 8}), name="P")
    return PrefillStage(cfg, model=tiny_model("glm_moe_dsa"), clock=clock)


GRANT_KEY = b"k" * 32  # the decode's grant key as the stage's (stubbed) link to it holds it


def _submit(rid: str, n: int = 20) -> Submit:
    grant = grants.sign(GRANT_KEY, rid=rid, prefill="P", boot="b", pages=[0, 1], expires=time.time() + 60)
    return Submit(rid, list(range(2, 2 + n)), SamplingParams(max_new_tokens=4), 0, "127.0.0.1:1", "b", [0, 1], 4.0,
                  grant)  # fmt: skip


# (name, what happens after the submit, phase after, pages held after, kv_failed error told to the decode)
LEADER_CASES = [
    ("computed, transferred, released", ["step", "transferred"], P.DONE, 0, None),
    ("computed, transfer pending", ["step"], P.TRANSFERRING, 2, None),
    ("release never came: freed past the deadline", ["step", "late"], P.DONE, 0, None),
    ("aborted while queued", ["abort"], P.DONE, 0, "prefill P: aborted by the router"),
    ("kv deadline while queued", ["clock"], P.DONE, 0, "was not prefilled before its KV deadline (20 prompt tokens"),
    ("abort after compute is ignored", ["step", "abort"], P.TRANSFERRING, 2, None),
    ("pipeline broke while queued", ["break"], P.DONE, 0, "prefill P: pipeline broke (test)"),
    ("pipeline broke while transferring", ["step", "break"], P.DONE, 0, None),
]


@pytest.mark.parametrize(("name", "steps", "phase", "held", "told"), LEADER_CASES, ids=[c[0] for c in LEADER_CASES])
def test_prefill_leader_lifecycle(name, steps, phase, held, told):
    clock = Clock()
    stage = _stage(clock)
    leader, ctx = stage.leader, stage.ctx
    posted = []
    ctx.sender.fail = lambda job, why: posted.append((job.rid, why))  # type: ignore[method-assign]
    stage.links.get = lambda addr, boot=None, timeout=None: SimpleNamespace(grant_key=GRANT_KEY, boot=boot)  # type: ignore[method-assign]
    try:
        leader.submit(_submit("r"))
        job = ctx.jobs.get("r")
        assert job is not None and (job.phase, job.deadline) == (P.COMPUTING, 1004.0)
        for step in steps:
            if step == "step":
                leader.iteration()
            elif step == "transferred":
                leader.on_transferred(job, True)
                leader.iteration()
            elif step == "abort":
                leader.abort(Abort("r", "aborted by the router"))
                leader.iteration()
            elif step == "clock":
                clock.t += 4.0
                leader.iteration()
            elif step == "late":  # no release (a lost notice): KV deadline + quarantine + an RPC's time
                clock.t += 4.0 + ctx.sender.backend.quarantine_s + ctx.t.rpc - 0.01
                leader.iteration()
                assert job.phase is P.TRANSFERRING and stage.pages_used() == 2
                clock.t += 0.01
                leader.iteration()
            elif step == "break":
                leader.on_break("prefill P: pipeline broke (test)")
        assert job.phase is phase
        assert stage.pages_used() == held and stage.integrity() == "ok"
        if told is None:
            assert posted == []
        else:
            assert len(posted) == 1 and posted[0][0] == "r" and told in posted[0][1], posted
        if phase is P.TRANSFERRING:
            assert job.pending == {0} and ctx.sender.in_flight == 1
            leader.on_transferred(job, False)  # a failed transfer releases the pages just the same
            leader.iteration()
        assert stage.pages_used() == 0 and stage.idle() and stage.integrity() == "ok"
    finally:
        stage.backend.close()
        ctx.notifier.stop()


# ---- router -------------------------------------------------------------------------------------------------


class FakeDecode:
    """A scripted decode worker behind the real RPC server and service spec: books the pages it preallocates."""

    def __init__(self) -> None:
        self.held: dict[str, list[int]] = {}
        self.busy = 0  # refuse this many preallocs with NoFreePages
        self.down: str | None = None  # its health says not ok (a TP rank died), though it still answers
        self.events: list[EventRow] = []
        self.service = WorkerService(
            DECODE_SERVICE,
            {
                HANDSHAKE: lambda h: None,
                PREALLOC: self.prealloc,
                STAGE_DONE: lambda d: StageDoneReply(False),
                KV_FAILED: lambda f: False,
                EVENTS: lambda q: Events(len(self.events), [e for e in self.events if e.seq > q.since], False, "db"),
                ABORT: lambda a: self.held.pop(a.rid, None) is not None,
            },
            "127.0.0.1",
            0,
            "fake-decode",
            health=lambda: replace(
                _health("decode", "db", 64 - sum(map(len, self.held.values()))), ok=self.down is None, down=self.down
            ),
            integrity=lambda: "ok",
        )
        self.service.start([])

    def prealloc(self, p: Prealloc) -> Preallocated:
        if self.busy:
            self.busy -= 1
            raise NoFreePages("no pages now")
        self.held[p.rid] = pages = [len(self.held) * 2, len(self.held) * 2 + 1]
        return Preallocated(pages, "db")

    def emit(
        self, rid: str, tokens: list[int], finished: bool, reason: str | None = None, error: str | None = None
    ) -> None:
        self.events.append(EventRow(len(self.events) + 1, rid, tokens, finished, reason, error))
        if finished:
            self.held.pop(rid, None)


class FakePrefill:
    def __init__(self) -> None:
        self.refuse: list[Exception] = []  # raised by the next submits, in order
        self.submitted: list[str] = []
        self.service = WorkerService(
            PREFILL_LEADER_SERVICE,
            {
                CONNECT: lambda c: Connected(c.decode, "db", "e1", []),
                SUBMIT: self.submit,
                ABORT: lambda a: True,
                RELEASED: lambda r: True,
                REVOKE: lambda r: Revoked(in_flight=False),
                CACHE_EVENTS: lambda q: CacheEvents("pb", "e1", 16, 0, True, b"", b"", 0, 64),  # no prefix cache
            },
            "127.0.0.1",
            0,
            "fake-prefill",
            health=lambda: _health("prefill", "pb", 64),
            integrity=lambda: "ok",
        )
        self.service.start([])

    def submit(self, p: Submit) -> Submitted:
        if self.refuse:
            raise self.refuse.pop(0)
        self.submitted.append(p.rid)
        return Submitted(True, "e1")


def _health(role: str, boot: str, free: int) -> Health:
    common = dict(
        ok=True, role=role, name=f"{role}-x", pid=1, boot=boot, elide=True, backend="local", page_size=16,
        pages_total=64, pages_used=64 - free, pages_free=free, capacity_tokens=1024, integrity="ok", counters={},
    )  # fmt: skip
    if role == "prefill":
        return PrefillHealth(**common, epoch="e1")
    return DecodeHealth(**common, max_prompt_tokens=1023)


# (name, what happens, phase of the router's record after, the client's last event (reason, error part),
#  submits the prefill took, pages the decode still holds)
ROUTER_CASES = [
    ("dispatched, decoded, finished", ["dispatch", "tokens", "finish"], P.DONE, ("length", None), 1, 0),
    ("dispatched, aborted", ["dispatch", "abort"], P.DONE, ("abort", None), 1, 0),
    ("aborted while queued", ["abort"], P.DONE, ("abort", None), 0, 0),
    ("decode busy, then dispatched", ["busy", "dispatch"], P.DISPATCHED, None, 1, 2),
    ("prefill unavailable: retried", ["unavailable", "dispatch"], P.DISPATCHED, None, 1, 2),
    ("prefill refused it", ["refused"], P.DONE, ("error", "prefill 127.0.0.1:"), 0, 0),
    ("queue deadline", ["busy", "late"], P.DONE, ("error", "no prefill/decode pair could take it within 2s"), 0, 0),
    # the error names what refused it (the decode had no free pages), not "no pair handshaken yet"
    ("queue deadline names the refusal", ["busy", "late"], P.DONE, ("error", "prealloc: no pages now)"), 0, 0),
    # ci14: a TP decode whose rank died says not ok on /health and fails its requests; the router must still read
    # those failures (it stopped polling a not-ok decode's events: the request stayed 'decoding' for ever)
    (
        "decode says it is down, then fails it",
        ["dispatch", "tokens", "down", "failed"],
        P.DONE,
        ("error", "tp rank 1 was killed"),
        1,
        0,
    ),
]


@pytest.mark.parametrize(("name", "steps", "phase", "last", "submits", "held"), ROUTER_CASES,
                         ids=[c[0] for c in ROUTER_CASES])  # fmt: skip
def test_router_lifecycle(name, steps, phase, last, submits, held):
    clock = Clock()
    dec, pre = FakeDecode(), FakePrefill()
    r = RouterBackend(
        RouterConfig(prefill=(pre.service.address,), decode=(dec.service.address,), queue_timeout=2.0), clock
    )
    client = RpcClient(dec.service.address)
    try:
        r.poll_health()
        assert r.poll_events(dec.service.address, client, 0)  # the cursor of this decode's boot
        assert r.wait_ready(5)
        r.submit("q", [3, 4, 5], SamplingParams(max_new_tokens=2))
        rec = r.record("q")
        assert rec is not None and (rec.phase, rec.deadline) == (P.QUEUED, 1002.0)
        for step in steps:
            if step == "dispatch":
                assert r.dispatch_next() is True and rec.wire == "q#" + str(rec.attempt)
            elif step == "busy":
                dec.busy = 1
                assert r.dispatch_next() is False and rec.phase is P.QUEUED
                time.sleep(r.t.busy_backoff)
            elif step == "unavailable":
                pre.refuse.append(Unavailable("pipeline not formed"))
                assert r.dispatch_next() is False and rec.phase is P.QUEUED and rec.wire is None
                r.poll_health()  # the prefill said it is down: it is up again on the next poll
            elif step == "refused":
                pre.refuse.append(ConfigError("prompt token id(s) [9999] are outside the vocabulary"))
                assert r.dispatch_next() is True
            elif step == "late":
                clock.t += 2.0
                dec.busy = 1
                assert r.dispatch_next() is False
            elif step == "tokens":
                dec.emit(rec.wire, [7], False)
                r.poll_events(dec.service.address, client, 0)
                assert rec.phase is P.DECODING and rec.tokens == 1
            elif step == "finish":
                dec.emit(rec.wire, [8], True, "length")
                r.poll_events(dec.service.address, client, 0)
            elif step == "down":
                dec.down = "tp rank 1 was killed by signal 9"
                r.poll_health()
            elif step == "failed":
                dec.emit(rec.wire, [], True, "error", "tp rank 1 was killed by signal 9 (SIGKILL)")
                assert r.poll_events(dec.service.address, client, 0)
            elif step == "abort":
                r.abort("q")
            r.drain_side()  # the aborts the router sent on the side
        assert rec.phase is phase, rec
        assert len(pre.submitted) == submits and sum(map(len, dec.held.values())) == held
        if last is not None:
            evs = list(r.events("q", 5))
            assert (evs[-1].finished, evs[-1].finish_reason) == (True, last[0])
            assert last[1] is None or (evs[-1].error is not None and last[1] in evs[-1].error), evs[-1]
            assert r.record("q") is None and r.metrics()["router_in_flight"] == 0
        r.stop()  # aborts what is still live: the decode gets its pages back
        r.drain_side()
        assert dec.held == {}
    finally:
        client.close()
        r.stop()
        dec.service.stop(1)
        pre.service.stop(1)
