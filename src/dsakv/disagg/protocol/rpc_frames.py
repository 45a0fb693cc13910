"""Framing of the control-plane RPC (dsakv.disagg.protocol.rpc): | u32 big-endian length | msgpack frame |, the
size caps and deadlines every server and client applies, the request / reply / error maps."""

from __future__ import annotations

import logging
import socket
import struct
from collections.abc import Callable
from typing import Any

import msgpack

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 * 1024 * 1024
MAX_REQUEST = 16 * 1024 * 1024  # a request frame a server reads (manifests and event batches are far smaller)
FRAME_TIMEOUT = 10.0  # seconds for an announced request frame to arrive
MAX_CONNECTIONS = 256  # open connections per server (one thread each); more are closed at once
MAX_PER_PEER = 128  # open connections from one peer address (host)
AUTH_TIMEOUT = 2.0  # seconds a new connection has to send its first (authenticated) frame, else it is closed
LATE_READ_S = 0.02  # a server past a read deadline still takes what already arrived, waiting at most this long
MAX_PENDING = 64  # connections not authenticated yet, in total; one more closes the oldest of them
MAX_PENDING_PER_PEER = 32  # ... and from one peer address
_HDR = struct.Struct(">I")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def unpack(data: bytes) -> Any:
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


def send_frame(sock: socket.socket, data: bytes) -> None:
    sock.sendall(_HDR.pack(len(data)) + data)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_MESSAGE, body_timeout: float | None = None) -> bytes:
    """One frame's bytes. A server passes max_bytes (a larger announced frame is refused before it is read) and
    body_timeout (the frame, once announced, must arrive within it; waiting for the next header is unbounded)."""
    (n,) = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if n > max_bytes:
        raise ConnectionError(f"message of {n} bytes exceeds the {max_bytes}-byte limit")
    if body_timeout is not None:
        sock.settimeout(body_timeout)
    try:
        return _recv_exact(sock, n)
    finally:
        if body_timeout is not None:
            sock.settimeout(None)


def send_msg(sock: socket.socket, obj: Any) -> None:
    send_frame(sock, pack(obj))


def recv_msg(sock: socket.socket, max_bytes: int = MAX_MESSAGE, body_timeout: float | None = None) -> Any:
    return unpack(recv_frame(sock, max_bytes, body_timeout))


class _Default:
    """RpcServer / RpcClient `auth` default: this process's credentials (dsakv.disagg.protocol.auth.current())."""


DEFAULT: Any = _Default()
REFUSAL = b"X1"


Handler = Callable[[Any], Any]


def request_frame(mid: int, method: str, params: Any) -> dict[str, Any]:
    return {"id": mid, "method": method, "params": params}


def reply_frame(mid: Any, result: Any) -> dict[str, Any]:
    return {"id": mid, "ok": True, "result": result}


def error_frame(mid: Any, error: str, kind: str) -> dict[str, Any]:
    return {"id": mid, "ok": False, "error": error, "kind": kind}


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {addr!r} must be host:port, e.g. 127.0.0.1:9000")
    return host, int(port)
