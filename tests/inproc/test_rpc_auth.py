"""Authenticated control-plane frames (protocol/auth.py, protocol/rpc.py), page grants (protocol/grants.py), message
bounds (codec) and the one-shot retry after a peer restart, on in-process servers: a call without the secret, with
another deployment's secret, replayed on the same or another connection, or from a role the RPC does not allow is
refused before its body is parsed, counted, and the server keeps serving; random and bit-flipped authenticated
frames never stop it."""

from __future__ import annotations

import os
import random
import socket
import struct
import time

import msgpack
import pytest

from dsakv.cli.main import main as cli_main
from dsakv.disagg.protocol import auth, grants
from dsakv.disagg.protocol.auth import ClusterAuth, Keyring, Session
from dsakv.disagg.protocol.codec import from_wire
from dsakv.disagg.protocol.errors import Forbidden, GrantRefused, MessageError
from dsakv.disagg.protocol.messages import STAGE_DONE, EventsQuery, Prealloc, StageDone, StageDoneReply, Submit
from dsakv.disagg.protocol.rpc import (
    PeerUnavailable,
    Rpc,
    RpcClient,
    RpcServer,
    Service,
    Unauthenticated,
    acl_of,
    bind,
    pack,
    recv_frame,
    recv_msg,
    send_frame,
)
from dsakv.disagg.protocol.worker_service import Notifier
from dsakv.util.procs import free_ports

KEYS = Keyring(b"s" * 32)
OTHER = Keyring(b"t" * 32)  # another deployment's secret
ROUTER = ClusterAuth(KEYS, "router")
PREFILL = ClusterAuth(KEYS, "prefill")


@pytest.fixture
def server():
    srv = RpcServer(
        {"echo": lambda p: p, "route": lambda p: "routed"},
        auth=ClusterAuth(KEYS, "decode"),
        acl={"echo": None, "route": ("router",)},
        max_request=4096,
    ).start()
    yield srv
    srv.stop()


def _raw(srv: RpcServer) -> tuple[socket.socket, bytes]:
    s = socket.create_connection((srv.host, srv.port), timeout=3)
    g = recv_msg(s)
    assert g["auth"] == "hmac-sha256" and len(g["nonce"]) == 16
    return s, g["nonce"]


def _refused(s: socket.socket) -> str:
    """The server's unauthenticated refusal, then the connection closes."""
    frame = recv_frame(s)
    assert frame[:2] == b"X1"
    err = msgpack.unpackb(frame[2:])
    assert s.recv(1) == b""
    return err["error"]


def _request(mid: int, method: str, params: object = None) -> bytes:
    return pack({"id": mid, "method": method, "params": params})


def test_authenticated_calls_and_roles(server):
    c = RpcClient(server.address, auth=ROUTER)
    assert c.call("echo", [1, 2]) == [1, 2] and c.call("route") == "routed" and c.call("echo", 3) == 3
    p = RpcClient(server.address, auth=PREFILL)
    assert p.call("echo", "x") == "x"
    with pytest.raises(Forbidden, match="route may be called by router only, not by a prefill"):
        p.call("route")
    assert p.call("echo", "still") == "still"  # a refused role keeps its connection
    assert server.refused.forbidden == 1 and server.refused.unauthenticated == 0


def test_unauthenticated_wrong_secret_and_replays_refused(server):
    before = server.refused.as_dict()
    # a plain frame (no secret): refused before its body is parsed (the body is not even msgpack)
    s, _ = _raw(server)
    send_frame(s, b"\xc1 not msgpack at all")
    assert "not authenticated" in _refused(s)
    # the client side says what is missing
    with pytest.raises(Unauthenticated, match="requires the deployment's cluster secret"):
        RpcClient(server.address, auth=None).call("echo", 1)
    # another deployment's secret
    with pytest.raises(Unauthenticated, match="tag does not verify for role router"):
        RpcClient(server.address, auth=ClusterAuth(OTHER, "router")).call("echo", 1)
    # a recorded frame replayed on the same connection (counter repeats) and on another one (other nonce)
    s, nonce = _raw(server)
    frame = Session(nonce, KEYS).seal_request("router", _request(1, "route"))
    send_frame(s, frame)
    reply = Session(nonce, KEYS, seq=1)
    assert msgpack.unpackb(reply.open_reply("router", recv_frame(s)))["result"] == "routed"
    send_frame(s, frame)
    assert "call number 1 on this connection, expected 2" in _refused(s)
    s2, _ = _raw(server)
    send_frame(s2, frame)
    assert "tag does not verify" in _refused(s2)
    # an unknown role, a truncated header
    s, nonce = _raw(server)
    send_frame(s, b"A1\x05admin" + b"\0" * 40)
    assert "unknown role 'admin'" in _refused(s)
    s, _ = _raw(server)
    send_frame(s, b"A1\x06router\0\0")
    assert "truncated" in _refused(s)
    assert server.refused.unauthenticated - before["unauthenticated"] == 6
    assert RpcClient(server.address, auth=ROUTER).call("echo", "ok") == "ok"


def test_client_refuses_unauthenticated_peer_when_required():
    srv = RpcServer({"echo": lambda p: p}, auth=None).start()
    try:
        assert RpcClient(srv.address, auth=ClusterAuth(KEYS, "router", require=False)).call("echo", 1) == 1
        with pytest.raises(Unauthenticated, match="does not authenticate its calls"):
            RpcClient(srv.address, auth=ROUTER).call("echo", 1)
    finally:
        srv.stop()


def test_fuzz_authenticated_frames(server):
    """Random bytes after a valid header, bit flips and truncations of valid frames, valid frames around
    garbage bodies: never a crash, never a call run; the server serves afterwards and holds no connection."""
    rng = random.Random(11)
    ran = []
    server.handlers["route"] = lambda p: ran.append(p) or "routed"
    for i in range(150):
        s, nonce = _raw(server)
        good = Session(nonce, KEYS).seal_request("router", _request(i, "route", i))
        kind = i % 5
        if kind == 0:  # flip one bit anywhere (header, tag or body)
            b = bytearray(good)
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
            frame = bytes(b)
        elif kind == 1:  # truncated
            frame = good[: rng.randrange(len(good))]
        elif kind == 2:  # a valid header with a random tag and body
            frame = good[:17] + bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
        elif kind == 3:  # random bytes
            frame = bytes(rng.randrange(256) for _ in range(rng.randint(0, 80)))
        else:  # a correctly signed frame whose body is garbage: authenticated, then dropped
            frame = Session(nonce, KEYS).seal_request("router", bytes(rng.randrange(256) for _ in range(20)))
        send_frame(s, frame)
        s.settimeout(3)
        try:
            data = s.recv(65536)
            while data:
                data = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            pass
        s.close()
    time.sleep(0.2)
    assert ran == []
    assert RpcClient(server.address, auth=ROUTER).call("route", "last") == "routed" and ran == ["last"]
    assert server.open_connections <= 1 and server.refused.unauthenticated >= 110


# ---- one-shot retry on a fresh connection after a peer restart --------------------------------------------

ONE_SHOT = Rpc("done", StageDone, StageDoneReply, "t", "t", ("prefill",), retry=True)
PLAIN = Rpc("done", StageDone, StageDoneReply, "t", "t", ("prefill",), retry=False)
SVC = Service("t", (ONE_SHOT,))


def _peer(port: int, got: list[str]) -> RpcServer:
    def done(p: StageDone) -> StageDoneReply:
        got.append(p.rid)
        return StageDoneReply(accepted=True)

    return RpcServer(bind(SVC, {ONE_SHOT: done}), port=port, auth=ClusterAuth(KEYS, "decode"), acl=acl_of(SVC)).start()


def test_one_shot_call_retried_after_peer_restart():
    port = free_ports(1)
    got: list[str] = []
    srv = _peer(port, got)
    c = RpcClient(f"127.0.0.1:{port}", timeout=3, auth=PREFILL)
    msg = StageDone("r1", "P", 0, True, boot="b")
    assert c.request(ONE_SHOT, msg).accepted
    srv.stop()  # the peer restarts: the client's cached connection is dead
    srv = _peer(port, got)
    try:
        assert c.request(ONE_SHOT, StageDone("r2", "P", 0, True, boot="b")).accepted  # retried once, delivered
        srv.stop()
        srv = _peer(port, got)
        with pytest.raises(PeerUnavailable):  # without retry the first call after a restart is lost
            c.request(PLAIN, StageDone("lost", "P", 0, True, boot="b"))
        assert got == ["r1", "r2"]
        # the notifier (fire-and-forget stage_done / released / kv_failed) goes through the same retry
        n = Notifier(3.0, 1.0)
        n._clients[c.addr] = c
        assert c.request(ONE_SHOT, StageDone("r3", "P", 0, True, boot="b")).accepted
        srv.stop()
        srv = _peer(port, got)
        n.post(c.addr, ONE_SHOT, StageDone("r4", "P", 0, True, boot="b"))
        end = time.monotonic() + 5
        while "r4" not in got and time.monotonic() < end:
            time.sleep(0.02)
        n.stop()
        assert got == ["r1", "r2", "r3", "r4"]
    finally:
        srv.stop()


def test_stage_done_and_kv_failed_are_retried_one_shots():
    from dsakv.disagg.protocol.messages import KV_FAILED, RELEASED

    assert STAGE_DONE.retry and RELEASED.retry and KV_FAILED.retry


# ---- numeric bounds of control messages ------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan"), 1e9, 0.0, -5.0, 3601])
def test_prealloc_kv_timeout_refused(value):
    data = {"rid": "r", "prompt_ids": [1], "params": {}, "prefill": "P", "num_stages": 1, "kv_timeout": value}
    with pytest.raises(MessageError, match=r"Prealloc\.kv_timeout: .*(finite|out of range)"):
        from_wire(Prealloc, data)


def test_message_bounds():
    ok = {"rid": "r", "prompt_ids": [1], "params": {}, "prefill": "P", "num_stages": 1, "kv_timeout": 30}
    assert from_wire(Prealloc, ok).kv_timeout == 30.0
    for field, bad, what in [
        ("num_stages", 0, "out of range"),
        ("num_stages", 10**6, "out of range"),
        ("prompt_ids", [1, -2], r"prompt_ids\[1\]: -2 is out of range"),
        ("prompt_ids", [2**70], "64-bit"),
    ]:
        with pytest.raises(MessageError, match=what):
            from_wire(Prealloc, {**ok, field: bad})
    sd = {"rid": "r", "prefill": "P", "stage": 0, "ok": False}
    for field, bad in [("quarantine_s", float("inf")), ("quarantine_s", 1e6), ("bytes", -1), ("stage", 999)]:
        with pytest.raises(MessageError, match=f"StageDone.{field}"):
            from_wire(StageDone, {**sd, field: bad})
    with pytest.raises(MessageError, match=r"EventsQuery.wait: .*out of range"):
        from_wire(EventsQuery, {"wait": 1e9})
    sub = {"rid": "r", "prompt_ids": [1], "params": {}, "seed": 0, "decode": "d", "decode_boot": "b",
           "dst_pages": [0], "kv_timeout": float("nan")}  # fmt: skip
    with pytest.raises(MessageError, match=r"Submit.kv_timeout"):
        from_wire(Submit, sub)


# ---- page grants ---------------------------------------------------------------------------------------------


def test_grants():
    key = grants.new_key()
    now = time.time()
    g = grants.sign(key, rid="r#1", prefill="P", boot="B", pages=[4, 5, 6], expires=now + 10)
    ok = dict(rid="r#1", boot="B", pages=[4, 5, 6], prefill="P")
    assert grants.verify(key, g, **ok).pages == (4, 5, 6)
    assert grants.verify(key, g, **{**ok, "pages": [4, 5]}).rid == "r#1"  # a stage writes a prefix
    cases = [
        (dict(ok, rid="r#2"), "is for request 'r#1', not 'r#2'"),
        (dict(ok, boot="C"), "from decode boot B, not C"),
        (dict(ok, prefill="Q"), "for prefill 'P', not 'Q'"),
        (dict(ok, pages=[7, 8]), "are not the granted pages"),
        (dict(ok, pages=[5]), "are not the granted pages"),
        (dict(ok, now=now + 11), "expired 1.0s ago"),
    ]
    for kw, match in cases:
        with pytest.raises(GrantRefused, match=match):
            grants.verify(key, g, **kw)
    with pytest.raises(GrantRefused, match="does not verify"):
        grants.verify(grants.new_key(), g, **ok)  # another decode process's key
    with pytest.raises(GrantRefused, match="does not verify"):
        grants.verify(key, g[:-1] + bytes([g[-1] ^ 1]), **ok)
    with pytest.raises(GrantRefused, match="no page grant"):
        grants.verify(key, b"", **ok)
    spent = grants.SpentGrants()
    parsed = grants.parse(key, g)
    spent.spend(parsed, now)
    with pytest.raises(GrantRefused, match="used already"):
        spent.spend(parsed, now)
    spent.spend(grants.parse(key, grants.sign(key, rid="x", prefill="P", boot="B", pages=[1], expires=now)), now)
    assert len(spent) == 2
    spent.spend(grants.parse(key, grants.sign(key, rid="y", prefill="P", boot="B", pages=[1], expires=now)), now + 20)
    assert len(spent) == 1  # expired ones are forgotten


# ---- the secret file and the roles' refusal to start without one ------------------------------------------------


def test_secret_file_checks(tmp_path):
    p = auth.write_secret(tmp_path / "s")
    assert os.stat(p).st_mode & 0o777 == 0o600 and len(auth.load_secret(p)) == 64
    os.chmod(p, 0o644)
    with pytest.raises(ValueError, match="readable by group or others .*chmod 600"):
        auth.load_secret(p)
    short = tmp_path / "short"
    short.write_text("abc")
    os.chmod(short, 0o600)
    with pytest.raises(ValueError, match="holds 3 bytes, at least 16 needed"):
        auth.load_secret(short)
    with pytest.raises(ValueError, match="No such file"):
        auth.load_secret(tmp_path / "missing")


def test_roles_refuse_to_start_without_a_secret(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(auth.SECRET_ENV, raising=False)
    argv = ["serve", "--role", "router", "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:10"]
    assert cli_main(argv) == 2
    assert "--role router needs the deployment's cluster secret: create one with `dsakv cluster-secret" in (
        capsys.readouterr().err
    )
    loose = tmp_path / "loose"
    loose.write_text("x" * 40)
    os.chmod(loose, 0o640)
    assert cli_main([*argv, "--cluster-secret-file", str(loose)]) == 2
    assert f"chmod 600 {loose}" in capsys.readouterr().err
    assert cli_main(["cluster-secret", str(tmp_path / "new")]) == 0
    assert len(auth.load_secret(tmp_path / "new")) == 64
    assert cli_main(["cluster-secret", str(tmp_path / "new")]) == 2  # no overwrite without --force
    assert "exists: pass --force" in capsys.readouterr().err


def test_frame_header_layout():
    """The frame layout the module docstring documents (a peer in another language can implement it)."""
    s = Session(b"n" * 16, KEYS)
    f = s.seal_request("router", b"body")
    assert f[:2] == b"A1" and f[2] == 6 and f[3:9] == b"router" and struct.unpack(">Q", f[9:17]) == (1,)
    assert len(f) == 17 + 32 + 4 and f.endswith(b"body")
