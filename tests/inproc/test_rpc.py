"""Control-plane RPC: results, remote errors, dead and silent peers within their deadline; the typed messages,
their codec (malformed messages refused), remote errors re-raised as their classes, the service specs."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dsakv.disagg.prefill.step import PrefillRow, PrefillStep
from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.errors import IncompatiblePeer, MessageError
from dsakv.disagg.protocol.messages import (
    DECODE_SERVICE,
    PREFILL_FOLLOWER_SERVICE,
    PREFILL_LEADER_SERVICE,
    SERVICES,
    Abort,
    JobSpec,
    Submit,
)
from dsakv.disagg.protocol.rpc import (
    PeerUnavailable,
    Rpc,
    RpcClient,
    RpcError,
    RpcServer,
    Service,
    bind,
    remote_error,
    services_table,
)
from dsakv.engine.request import SamplingParams
from dsakv.errors import NoFreePages
from dsakv.pipeline.host_replay import HostOp
from dsakv.pipeline.stage_comm import StageLinkError
from dsakv.pipeline.step import STEP, TICK, PipeStep


def _boom(params: object) -> None:
    raise ValueError(f"bad params {params!r}")


def test_call_result_and_remote_error() -> None:
    srv = RpcServer({"add": lambda p: p["a"] + p["b"], "boom": _boom}).start()
    try:
        c = RpcClient(srv.address)
        assert c.call("add", {"a": 2, "b": 40}) == 42
        with pytest.raises(RpcError) as e:
            c.call("boom", [1])
        assert e.value.kind == "ValueError" and "bad params [1]" in str(e.value)
        with pytest.raises(RpcError, match="unknown method 'nope'"):
            c.call("nope")
        assert c.call("add", {"a": 1, "b": 1}) == 2  # the connection survives errors
    finally:
        srv.stop()


def test_dead_peer_fails_fast() -> None:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="unavailable"):
        RpcClient(f"127.0.0.1:{port}").call("x", timeout=5)
    assert time.monotonic() - t0 < 5


def test_silent_peer_times_out_within_deadline() -> None:
    release = threading.Event()
    srv = RpcServer({"hang": lambda p: release.wait(10)}).start()
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnavailable, match="did not answer 'hang'"):
            RpcClient(srv.address).call("hang", timeout=0.5)
        assert time.monotonic() - t0 < 3
    finally:
        release.set()
        srv.stop()


# ---- the typed control plane (messages + codec + service specs) ------------------------------------------


def test_codec_round_trip_and_refusals() -> None:
    sp = SamplingParams(max_new_tokens=3, temperature=0.5, top_k=4, seed=9, stop_token_ids=(1, 2))
    msg = Submit("r1", [1, 2, 3], sp, 9, "127.0.0.1:1", "boot1", [4, 5], 2.5)
    wire = to_wire(msg)
    assert wire["params"]["stop_token_ids"] == [1, 2] and wire["dst_pages"] == [4, 5]
    assert from_wire(Submit, wire) == msg
    step = PipeStep(STEP, {}, {"r1": [3]}, [], PrefillStep([PrefillRow("r1", 0, 16, True)], cache=b"\x01\x00\x00\x00"))
    assert PipeStep.of_meta(step.meta(), "stage 1", PrefillStep.of_meta) == step
    with pytest.raises(MessageError, match=r"Submit.prompt_ids\[1\]: got 'x' \(str\), expected int"):
        from_wire(Submit, {**wire, "prompt_ids": [1, "x"]})
    with pytest.raises(MessageError, match=r"Submit: required field 'kv_timeout' is missing"):
        from_wire(Submit, {k: v for k, v in wire.items() if k != "kv_timeout"})
    with pytest.raises(MessageError, match=r"Submit: unknown field\(s\) \['evil'\]"):
        from_wire(Submit, {**wire, "evil": 1})
    with pytest.raises(MessageError, match=r"Submit.params: unknown field\(s\) \['beams'\]"):
        from_wire(Submit, {**wire, "params": {"beams": 2}})
    with pytest.raises(MessageError, match=r"Submit.seed: got True \(bool\), expected int"):
        from_wire(Submit, {**wire, "seed": True})


def test_prefill_step_payload_round_trip_and_refusals() -> None:
    sp = SamplingParams(max_new_tokens=3, seed=9)
    job = JobSpec("r1", 20, "127.0.0.1:1", "boot1", [4, 5], 2.5, sp, 9, prompt_ids=list(range(20)), grant=b"g")
    payload = PrefillStep(
        [PrefillRow("r1", 0, 16, False, 7)], {"r1": job}, b"\x01\x00\x00\x00", [HostOp("o", b"\0" * 8, b"\1" * 8)]
    )
    step = PipeStep(STEP, {"input_ids": [[1], b"\0" * 8]}, {"r1": [4, 5]}, ["r0"], payload)
    assert PipeStep.of_meta(step.meta(), "stage 1", PrefillStep.of_meta) == step
    tick: PipeStep[PrefillStep] = PipeStep(TICK, payload=PrefillStep())
    assert PipeStep.of_meta(tick.meta(), "stage 1", PrefillStep.of_meta) == tick
    meta, raw = step.meta(), step.meta()["payload"]

    def refused(payload: object, match: str) -> None:
        with pytest.raises(StageLinkError, match=match):
            PipeStep.of_meta({**meta, "payload": payload}, "stage 1", PrefillStep.of_meta)

    where = r"stage 1: malformed pipeline step: payload: "
    refused(None, where + r"missing")
    refused({**raw, "rows": [{**raw["rows"][0], "start": "x"}]}, where + r"PrefillStep.rows\[0\].start: got 'x'")
    refused({**raw, "evil": 1}, where + r"PrefillStep: unknown field\(s\) \['evil'\]")
    refused({**raw, "jobs": {"r2": raw["jobs"]["r1"]}}, where + r"PrefillStep.jobs\['r2'\]: the job of request 'r1'")
    refused({**raw, "cache": b"\0" * 5}, where + r"PrefillStep.cache: 5 bytes are not int32 page ids")
    refused(
        {**raw, "host_ops": [{"kind": "x", "src": b"", "dst": b""}]}, where + r"PrefillStep.host_ops\[0\]: kind 'x'"
    )
    bad_pair = [{"kind": "l", "src": b"\0" * 8, "dst": b""}]
    refused({**raw, "host_ops": bad_pair}, where + r"PrefillStep.host_ops\[0\]: 8 source and 0 destination bytes")
    with pytest.raises(StageLinkError, match=r"a payload, but this pipeline's steps carry none"):
        PipeStep.of_meta(meta, "stage 1")  # a round-trip stage (decode, colocated) takes none


ADD: Rpc[Abort, bool] = Rpc("add", Abort, bool, "test", "")
SERVICE = Service("test", (ADD,))


def test_typed_rpc_remote_errors_are_the_real_classes() -> None:
    seen: list[Abort] = []

    def add(msg: Abort) -> bool:
        seen.append(msg)
        if msg.rid == "busy":
            raise NoFreePages("no pages now")
        if msg.rid == "bad":
            raise IncompatiblePeer("page size differs")
        return True

    with pytest.raises(ValueError, match=r"handlers missing for \['add'\], not in the service spec: \[\]"):
        bind(SERVICE, {})
    srv = RpcServer(bind(SERVICE, {ADD: add})).start()
    try:
        c = RpcClient(srv.address)
        assert c.request(ADD, Abort("r1", "why")) is True
        assert seen == [Abort("r1", "why")]
        with pytest.raises(NoFreePages, match="no pages now") as e:
            c.request(ADD, Abort("busy"))
        assert isinstance(e.value, RpcError) and e.value.kind == "NoFreePages"
        with pytest.raises(IncompatiblePeer, match="page size differs"):
            c.request(ADD, Abort("bad"))
        # a malformed message is refused before the handler runs (nothing reaches it)
        with pytest.raises(MessageError, match=r"add request.rid: got 5 \(int\), expected str"):
            c.call("add", {"rid": 5})
        assert len(seen) == 3
        # a kind off the registry stays a plain RpcError (the wire never names a class to instantiate)
        assert type(remote_error("x", "SystemExit")) is RpcError
    finally:
        srv.stop()


def test_service_specs_cover_every_role() -> None:
    assert DECODE_SERVICE.names() == [
        "ping", "health", "check_integrity", "handshake", "prealloc", "stage_done", "kv_failed", "events", "abort",
    ]  # fmt: skip
    assert PREFILL_LEADER_SERVICE.names() == [
        "ping", "health", "check_integrity", "connect", "submit", "abort", "released", "cache_events", "revoke",
    ]  # fmt: skip
    assert PREFILL_FOLLOWER_SERVICE.names() == ["ping", "health", "check_integrity", "connect", "revoke"]
    table = services_table(SERVICES)
    assert "decode           prealloc         Prealloc -> Preallocated   (from router; roles router)" in table
