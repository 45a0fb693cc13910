"""Control-plane RPC: results, remote errors, dead and silent peers within their deadline."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from dsakv.disagg.rpc import PeerUnavailable, RpcClient, RpcError, RpcServer


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
