"""RPC server limits (protocol/rpc.py): a frame announced over the cap is refused unread, an announced frame that does
not arrive in time frees its thread, connections over the cap (in total, per peer host) are closed at once, a
connection that does not authenticate within the deadline is closed, waiting connections over their caps close the
oldest waiting one, 300 idle connections do not stop a caller, random frames never stop the server, and normal calls
keep working after each."""

from __future__ import annotations

import random
import socket
import struct
import time

import msgpack
import pytest

from dsakv.disagg.protocol.rpc import RpcClient, RpcServer, recv_msg


@pytest.fixture
def server():
    s = RpcServer({"echo": lambda p: p}, max_request=4096, frame_timeout=0.5, max_connections=4).start()
    yield s
    s.stop()


def _open(server: RpcServer) -> socket.socket:
    """A raw connection past the server's greeting (unauthenticated: the server has no credentials)."""
    s = socket.create_connection((server.host, server.port))
    assert recv_msg(s)["auth"] == "none"
    return s


def _closed(sock: socket.socket, within: float) -> bool:
    """True if the server closed `sock` (whatever it sent before, e.g. its greeting, is read and dropped)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _echo_ok(server: RpcServer) -> None:
    c = RpcClient(server.address, timeout=5)
    try:
        assert c.call("echo", {"x": [1, 2, 3]}) == {"x": [1, 2, 3]}
    finally:
        c.close()


def test_oversized_frame_refused_unread(server):
    s = _open(server)
    s.sendall(struct.pack(">I", 200 * 2**20))  # announces 200 MB, sends nothing more
    assert _closed(s, 3.0)
    s.close()
    assert server.refused.too_large == 1
    _echo_ok(server)


def test_slow_frame_times_out(server):
    s = _open(server)
    s.sendall(struct.pack(">I", 100) + b"\x81")
    assert _closed(s, 3.0)  # closed by the 0.5 s frame timeout (a server without one keeps it open)
    s.close()
    assert server.refused.timeout == 1  # the timeout path, not another refusal (no wall-clock bound: load-proof)
    _echo_ok(server)


def test_connection_cap(server):
    """Four callers that authenticated (made a call) hold the cap: a fifth connection is closed at once."""
    held = [RpcClient(server.address, timeout=5) for _ in range(4)]
    for c in held:
        assert c.call("echo", 1) == 1
    extra = socket.create_connection((server.host, server.port))
    assert _closed(extra, 3.0)
    extra.close()
    assert server.refused.connections == 1 and server.refused.evicted == 0
    for c in held:
        c.close()
    _wait(lambda: server.open_connections == 0)
    _echo_ok(server)


def _wait(pred, what: str = "the server's books", timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


def _raw(server: RpcServer, source: str = "127.0.0.1") -> socket.socket:
    """A connection that reads the greeting and then stays idle (never authenticates)."""
    s = socket.create_connection((server.host, server.port), source_address=(source, 0))
    assert recv_msg(s)["auth"] == "none"
    return s


def test_idle_connections_are_closed_at_the_auth_deadline():
    # 1 s: the legit caller below must send its first frame within it, starved test process or not
    srv = RpcServer({"echo": lambda p: p}, auth_timeout=1.0).start()
    try:
        idle = [_raw(srv) for _ in range(10)]
        _wait(lambda: srv.refused.auth_timeout == 10 and srv.open_connections == 0)
        assert all(_closed(s, 5.0) for s in idle)
        assert srv.refused.evicted == 0 and srv.pending_connections == 0
        c = RpcClient(srv.address, timeout=5)  # a caller that authenticated stays, idle or not
        assert c.call("echo", 1) == 1
        assert srv.pending_connections == 0 and srv.open_connections == 1
        for s in idle:
            s.close()
        assert c.call("echo", 2) == 2 and srv.refused.auth_timeout == 10
        c.close()
    finally:
        srv.stop()


def test_pending_caps_per_peer_and_in_total_close_the_oldest():
    srv = RpcServer({"echo": lambda p: p}, auth_timeout=60, max_pending=5, max_pending_per_peer=3).start()
    try:
        a = [_raw(srv, "127.0.0.2") for _ in range(5)]  # one peer: its 4th and 5th close its 1st and 2nd
        _wait(lambda: srv.refused.evicted == 2)
        assert _closed(a[0], 5.0) and _closed(a[1], 5.0) and not any(_closed(s, 0.05) for s in a[2:])
        b = [_raw(srv, "127.0.0.3") for _ in range(3)]  # 6 waiting > 5 in total: the oldest (a[2]) is closed
        _wait(lambda: srv.refused.evicted == 3)
        assert _closed(a[2], 5.0) and not any(_closed(s, 0.05) for s in a[3:] + b)
        assert srv.pending_connections == 5
        _echo_ok(srv)  # a real caller always gets in: the 6th waiting one closes the oldest (a[3])
        assert _closed(a[3], 5.0) and srv.refused.evicted == 4
        for _ in range(3):  # 4 waiting now: a caller gets in without closing anyone
            _echo_ok(srv)
        assert srv.refused.evicted == 4 and srv.refused.connections == 0 and srv.pending_connections == 4
        for s in a + b:
            s.close()
    finally:
        srv.stop()


def test_a_connection_that_began_its_frame_is_closed_after_the_silent_ones():
    srv = RpcServer({"echo": lambda p: p}, auth_timeout=60, max_pending=3, max_pending_per_peer=3).start()
    try:
        began = _raw(srv)
        began.sendall(b"\x00")  # the first byte of a frame header: most likely a real caller on a slow path
        _wait(lambda: any(c.speaking for c in srv._conns.values()), "the server to see the first byte")
        silent = [_raw(srv) for _ in range(2)]
        newer = [_raw(srv) for _ in range(2)]  # each closes the oldest silent one, never `began`
        _wait(lambda: srv.refused.evicted == 2)
        assert _closed(silent[0], 5.0) and _closed(silent[1], 5.0) and not _closed(began, 0.05)
        last = _raw(srv)  # only `began` and the newer silent ones wait: the oldest silent (newer[0]) goes first
        _wait(lambda: srv.refused.evicted == 3)
        assert _closed(newer[0], 5.0) and not _closed(began, 0.05) and srv.pending_connections == 3
        for x in [began, *silent, *newer, last]:
            x.close()
    finally:
        srv.stop()


def test_connections_per_peer_are_capped():
    srv = RpcServer({"echo": lambda p: p}, max_connections=8, max_per_peer=2).start()
    try:
        mine = [RpcClient(srv.address, timeout=5) for _ in range(2)]
        for c in mine:
            assert c.call("echo", 1) == 1
        extra = socket.create_connection((srv.host, srv.port))
        assert _closed(extra, 3.0)  # a third from the same host: refused at once
        assert srv.refused.connections == 1
        other = socket.create_connection((srv.host, srv.port), source_address=("127.0.0.2", 0))
        assert recv_msg(other)["auth"] == "none"  # another host still gets in
        for c in mine:
            c.close()
        other.close()
        extra.close()
    finally:
        srv.stop()


def test_three_hundred_idle_connections_do_not_stop_callers():
    srv = RpcServer({"echo": lambda p: p}, auth_timeout=2.0).start()  # as above, starved or not
    try:
        idle = [socket.create_connection((srv.host, srv.port)) for _ in range(300)]
        for i in range(20):
            c = RpcClient(srv.address, timeout=10)
            assert c.call("echo", i) == i
            c.close()
        _wait(lambda: srv.refused.evicted + srv.refused.auth_timeout == 300 and srv.open_connections == 0)
        assert srv.refused.connections == 0
        assert all(_closed(s, 5.0) for s in idle)
        for s in idle:
            s.close()
    finally:
        srv.stop()


def test_random_frames_never_stop_the_server(server):
    rng = random.Random(7)
    for i in range(120):
        s = _open(server)
        kind = i % 4
        if kind == 0:
            payload = bytes(rng.randrange(256) for _ in range(rng.randint(0, 64)))
            s.sendall(struct.pack(">I", len(payload)) + payload)
        elif kind == 1:
            obj = rng.choice([None, 1, "x", [1], {"id": "a", "method": 3}, {"method": "echo", "params": {"a": b"b"}}])
            data = msgpack.packb(obj, use_bin_type=True)
            s.sendall(struct.pack(">I", len(data)) + data)
        elif kind == 2:
            s.sendall(bytes(rng.randrange(256) for _ in range(rng.randint(1, 8))))
        else:
            data = msgpack.packb({"id": i, "method": "nope"}, use_bin_type=True)
            s.sendall(struct.pack(">I", len(data)) + data)
        s.close()
    time.sleep(0.2)
    _echo_ok(server)
    assert server.open_connections <= 1


def test_peer_clients_keep_one_connection_per_peer_process(server):
    """PeerClients (the V4 prefill's STAGE_DONE / KV_FAILED, the Notifier): five calls to one decode process use
    one connection; a new boot of the peer gets a new client (the old connection is closed)."""
    from dsakv.disagg.protocol.worker_service import PeerClients

    peers = PeerClients(5.0, 2.0)
    try:
        first = peers.client(server.address, "boot-1")
        for i in range(5):
            assert peers.client(server.address, "boot-1").call("echo", {"i": i}) == {"i": i}
        assert peers.client(server.address, "boot-1") is first and server.open_connections == 1
        second = peers.client(server.address, "boot-2")
        assert second is not first and second.call("echo", {"i": 9}) == {"i": 9}
        deadline = time.monotonic() + 30.0  # ends as soon as it holds; generous for a loaded box
        while server.open_connections != 1 and time.monotonic() < deadline:  # the server sees the close
            time.sleep(0.02)
        assert server.open_connections == 1
    finally:
        peers.close()
