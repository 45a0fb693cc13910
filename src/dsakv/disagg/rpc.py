"""A small control-plane RPC: length-prefixed msgpack over TCP, every call bounded in time.

Used for handshakes, page allocation, completion notices and the router. Bulk KV
bytes never travel here (they go through a TransferBackend).

Wire format, both directions:  | u32 big-endian length | msgpack map |
request  {"id": int, "method": str, "params": any}
response {"id": int, "ok": bool, "result": any} or {"id": int, "ok": false, "error": str, "kind": str}

Must not import engine, serve or torch.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

import msgpack

from dsakv.errors import DsakvError

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 * 1024 * 1024
_HDR = struct.Struct(">I")


class RpcError(DsakvError):
    """The remote handler raised; `kind` is the remote exception's class name."""

    def __init__(self, message: str, kind: str = "RpcError") -> None:
        super().__init__(message)
        self.kind = kind


class PeerUnavailable(RpcError):
    """The peer refused the connection, closed it, or did not answer within the deadline."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "PeerUnavailable")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return bytes(buf)


def send_msg(sock: socket.socket, obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    sock.sendall(_HDR.pack(len(data)) + data)


def recv_msg(sock: socket.socket) -> Any:
    (n,) = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if n > MAX_MESSAGE:
        raise ConnectionError(f"message of {n} bytes exceeds the {MAX_MESSAGE}-byte limit")
    return msgpack.unpackb(_recv_exact(sock, n), raw=False, strict_map_key=False)


Handler = Callable[[Any], Any]


class _ThreadingServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class RpcServer:
    """Serves `handlers[method](params) -> result` on (host, port), one thread per connection."""

    def __init__(self, handlers: dict[str, Handler], host: str = "127.0.0.1", port: int = 0, name: str = "rpc"):
        self.handlers = dict(handlers)
        self.name = name
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    try:
                        msg = recv_msg(sock)
                    except (ConnectionError, OSError, ValueError):
                        return
                    reply = outer._dispatch(msg)
                    try:
                        send_msg(sock, reply)
                    except OSError:
                        return

        self._server = _ThreadingServer((host, port), _Handler)
        addr = self._server.server_address
        self.host, self.port = str(addr[0]), int(addr[1])
        self._thread: threading.Thread | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _dispatch(self, msg: Any) -> dict[str, Any]:
        mid = msg.get("id") if isinstance(msg, dict) else None
        method = msg.get("method") if isinstance(msg, dict) else None
        fn = self.handlers.get(method) if isinstance(method, str) else None
        if fn is None:
            return {"id": mid, "ok": False, "error": f"{self.name}: unknown method {method!r}", "kind": "RpcError"}
        try:
            return {"id": mid, "ok": True, "result": fn(msg.get("params"))}
        except Exception as e:  # the error travels to the caller; the server keeps serving
            log.debug("%s: %s failed: %s", self.name, method, e)
            return {"id": mid, "ok": False, "error": str(e), "kind": type(e).__name__}

    def start(self) -> RpcServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"{self.name}-rpc", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address {addr!r} must be host:port, e.g. 127.0.0.1:9000")
    return host, int(port)


class RpcClient:
    """Calls one peer. Thread-safe; reconnects after a failure; every call has a deadline."""

    def __init__(self, addr: str, timeout: float = 10.0, connect_timeout: float = 2.0) -> None:
        self.addr = addr
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._sock: socket.socket | None = None
        self._lock = threading.Lock()
        self._next_id = 0

    def _connect(self, deadline: float) -> socket.socket:
        host, port = split_addr(self.addr)
        t = max(0.01, min(self.connect_timeout, deadline - time.monotonic()))
        try:
            sock = socket.create_connection((host, port), timeout=t)
        except OSError as e:
            raise PeerUnavailable(f"peer {self.addr} is unavailable: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock

    def call(self, method: str, params: Any = None, timeout: float | None = None) -> Any:
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            try:
                if self._sock is None:
                    self._sock = self._connect(deadline)
                self._sock.settimeout(max(0.01, deadline - time.monotonic()))
                send_msg(self._sock, {"id": mid, "method": method, "params": params})
                reply = recv_msg(self._sock)
            except PeerUnavailable:
                self.close_locked()
                raise
            except TimeoutError:
                self.close_locked()
                raise PeerUnavailable(f"peer {self.addr} did not answer {method!r} within the deadline") from None
            except (OSError, ConnectionError, ValueError) as e:
                self.close_locked()
                raise PeerUnavailable(f"peer {self.addr} failed during {method!r}: {e}") from None
        if not reply.get("ok"):
            raise RpcError(f"{self.addr} {method}: {reply.get('error')}", str(reply.get("kind", "RpcError")))
        return reply.get("result")

    def close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
