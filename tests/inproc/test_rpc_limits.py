"""RPC server limits (protocol/rpc.py): a frame announced over the cap is refused unread, an announced frame that does
not arrive in time frees its thread, connections over the cap are closed at once, random frames never stop the
server, and normal calls keep working after each."""

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
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
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
    assert server.refused["too_large"] == 1
    _echo_ok(server)


def test_slow_frame_times_out(server):
    s = _open(server)
    s.sendall(struct.pack(">I", 100) + b"\x81")
    t0 = time.monotonic()
    assert _closed(s, 3.0)
    assert time.monotonic() - t0 < 2.5
    s.close()
    assert server.refused["timeout"] == 1
    _echo_ok(server)


def test_connection_cap(server):
    held = [socket.create_connection((server.host, server.port)) for _ in range(4)]
    time.sleep(0.2)
    extra = socket.create_connection((server.host, server.port))
    assert _closed(extra, 3.0)
    extra.close()
    assert server.refused["connections"] == 1
    for s in held:
        s.close()
    time.sleep(0.2)
    _echo_ok(server)


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
