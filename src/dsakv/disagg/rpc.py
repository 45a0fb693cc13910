"""A small control-plane RPC: length-prefixed msgpack over TCP, every call bounded in time.

Used for handshakes, page allocation, completion notices and the router. Bulk KV
bytes never travel here (they go through a TransferBackend).

Wire format, both directions:  | u32 big-endian length | msgpack map |   (frames built in one place:
request  {"id": int, "method": str, "params": any}                     request_frame / reply_frame /
response {"id": int, "ok": bool, "result": any}                        error_frame; a new frame field,
      or {"id": int, "ok": false, "error": str, "kind": str}           e.g. authentication, goes there)

Typed use (dsakv.disagg.messages lists every RPC as an `Rpc` spec: name, request type, reply type):

    server = RpcServer(bind(DECODE_SERVICE, {PREALLOC: worker.prealloc, ...}), host, port)
    reply = client.request(PREALLOC, Prealloc(rid=..., ...))     # -> Preallocated, checked by the codec

`bind` decodes each request into its dataclass before the handler runs (MessageError if it does not match)
and encodes the reply. A handler's exception travels back as `kind` = its class name; the client re-raises
it as that class when the kind is registered in ERROR_KINDS (a subclass of both the class and RpcError, so
`except NoFreePages` and `except RpcError` both catch it), else as RpcError. Must not import engine, serve or
torch.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgpack

from dsakv.cache.allocator import IntegrityError
from dsakv.disagg.codec import from_wire, to_wire
from dsakv.disagg.errors import (
    IncompatiblePeer,
    ManifestError,
    MessageError,
    TransferError,
    TransferTimeout,
    Unavailable,
)
from dsakv.errors import CapacityError, ConfigError, DsakvError, NoFreePages
from dsakv.util import Registry

log = logging.getLogger(__name__)

MAX_MESSAGE = 256 * 1024 * 1024
MAX_REQUEST = 16 * 1024 * 1024  # a request frame a server reads (manifests and event batches are far smaller)
FRAME_TIMEOUT = 10.0  # seconds for an announced request frame to arrive
MAX_CONNECTIONS = 256  # open connections per server (one thread each); more are closed at once
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


# ---- remote error kinds ----------------------------------------------------------------------------------

ERROR_KINDS: Registry[type[Exception]] = Registry("remote error kind")
"""Exception classes a peer's error is re-raised as, by class name. Only these: a kind off the list is a
plain RpcError (the wire never names an arbitrary class to instantiate)."""

for _cls in (
    ConfigError,
    CapacityError,
    NoFreePages,
    IncompatiblePeer,
    ManifestError,
    MessageError,
    Unavailable,
    TransferError,
    TransferTimeout,
    IntegrityError,
    ValueError,
    KeyError,
    TypeError,
):
    ERROR_KINDS.add(_cls.__name__, _cls)

_remote_classes: dict[type[Exception], type[RpcError]] = {}


def _remote_init(self: RpcError, message: str, kind: str = "RpcError") -> None:
    Exception.__init__(self, message)
    self.kind = kind


def error_kind(e: BaseException) -> str:
    """The kind an exception travels as: its nearest registered class (a re-raised remote error keeps its
    kind through a second hop), else its own class name."""
    for cls in type(e).__mro__:
        if cls.__name__ in ERROR_KINDS and ERROR_KINDS.get(cls.__name__) is cls:
            return cls.__name__
    return type(e).__name__


def remote_error(message: str, kind: str) -> RpcError:
    """The exception a client raises for a peer's error `kind`: an instance of the registered class (and of
    RpcError), or a plain RpcError for an unregistered kind."""
    cls = ERROR_KINDS.get(kind) if kind in ERROR_KINDS else None
    if cls is None:
        return RpcError(message, kind)
    sub = _remote_classes.get(cls)
    if sub is None:
        sub = type(f"Remote{cls.__name__}", (cls, RpcError), {"__init__": _remote_init})
        _remote_classes[cls] = sub
    return sub(message, kind)


# ---- typed RPCs --------------------------------------------------------------------------------------------

Q = TypeVar("Q")
R = TypeVar("R")


@dataclass(frozen=True)
class Rpc(Generic[Q, R]):
    """One RPC: its method name, request and reply types, and who calls it (the documented RPC graph)."""

    name: str
    request: type[Q]
    reply: type[R]
    caller: str
    doc: str


@dataclass(frozen=True)
class Service:
    """The RPCs one role serves."""

    name: str
    rpcs: tuple[Rpc[Any, Any], ...]

    def names(self) -> list[str]:
        return [r.name for r in self.rpcs]


def bind(service: Service, impl: Mapping[Rpc[Any, Any], Callable[[Any], Any]]) -> dict[str, Handler]:
    """Raw handlers for RpcServer: each decodes its request, calls impl[rpc] and encodes the reply. Every RPC
    of `service` needs an implementation, and nothing else may be given (the spec is the list)."""
    missing = [r.name for r in service.rpcs if r not in impl]
    extra = [r.name for r in impl if r not in service.rpcs]
    if missing or extra:
        raise ValueError(f"{service.name}: handlers missing for {missing}, not in the service spec: {extra}")

    def wrap(rpc: Rpc[Any, Any], fn: Callable[[Any], Any]) -> Handler:
        def handler(params: Any) -> Any:
            return to_wire(fn(from_wire(rpc.request, {} if params is None else params, f"{rpc.name} request")))

        return handler

    return {r.name: wrap(r, impl[r]) for r in service.rpcs}


def services_table(services: Sequence[Service]) -> str:
    """Text table of every RPC: service, method, request -> reply, caller (for docs and --help)."""
    rows = []
    for s in services:
        for r in s.rpcs:
            rows.append(
                f"{s.name:<16} {r.name:<16} {r.request.__name__} -> {getattr(r.reply, '__name__', r.reply)}"
                f"   (from {r.caller})"
            )
    return "\n".join(rows)


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


def recv_msg(sock: socket.socket, max_bytes: int = MAX_MESSAGE, body_timeout: float | None = None) -> Any:
    """One frame. A server passes max_bytes (a larger announced frame is refused before it is read) and
    body_timeout (the frame, once announced, must arrive within it; waiting for the next header is unbounded)."""
    (n,) = _HDR.unpack(_recv_exact(sock, _HDR.size))
    if n > max_bytes:
        raise ConnectionError(f"message of {n} bytes exceeds the {max_bytes}-byte limit")
    if body_timeout is not None:
        sock.settimeout(body_timeout)
    try:
        return msgpack.unpackb(_recv_exact(sock, n), raw=False, strict_map_key=False)
    finally:
        if body_timeout is not None:
            sock.settimeout(None)


Handler = Callable[[Any], Any]


class _ThreadingServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True


class RpcServer:
    """Serves `handlers[method](params) -> result` on (host, port), one thread per connection."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "rpc",
        max_request: int = MAX_REQUEST,
        frame_timeout: float = FRAME_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
    ):
        self.handlers = dict(handlers)
        self.name = name
        self.max_request = max_request
        self.frame_timeout = frame_timeout
        self.max_connections = max_connections
        self.open_connections = 0
        self.refused = {"too_large": 0, "timeout": 0, "connections": 0}
        self._count = threading.Lock()
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                with outer._count:
                    if outer.open_connections >= outer.max_connections:
                        outer.refused["connections"] += 1
                        log.warning("%s: %d connections open: refusing one more", outer.name, outer.open_connections)
                        return
                    outer.open_connections += 1
                try:
                    self._serve(sock)
                finally:
                    with outer._count:
                        outer.open_connections -= 1

            def _serve(self, sock: socket.socket) -> None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    try:
                        msg = recv_msg(sock, outer.max_request, outer.frame_timeout)
                    except TimeoutError:
                        outer.refused["timeout"] += 1
                        log.warning(
                            "%s: a request frame did not arrive within %.1f s: closed", outer.name, outer.frame_timeout
                        )
                        return
                    except ConnectionError as e:
                        if "exceeds" in str(e):
                            outer.refused["too_large"] += 1
                            log.warning("%s: %s: closed", outer.name, e)
                        return
                    except (OSError, ValueError):
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
            return error_frame(mid, f"{self.name}: unknown method {method!r}", "RpcError")
        try:
            return reply_frame(mid, fn(msg.get("params")))
        except Exception as e:  # the error travels to the caller; the server keeps serving
            log.debug("%s: %s failed: %s", self.name, method, e)
            return error_frame(mid, str(e), error_kind(e))

    def start(self) -> RpcServer:
        self._thread = threading.Thread(target=self._server.serve_forever, name=f"{self.name}-rpc", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


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
                send_msg(self._sock, request_frame(mid, method, params))
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
        if not isinstance(reply, dict):
            raise PeerUnavailable(f"peer {self.addr} answered {method!r} with a malformed frame")
        if not reply.get("ok"):
            raise remote_error(f"{self.addr} {method}: {reply.get('error')}", str(reply.get("kind", "RpcError")))
        return reply.get("result")

    def request(self, rpc: Rpc[Q, R], msg: Q, timeout: float | None = None) -> R:
        """Typed call: `msg` encoded, the reply checked and decoded as rpc.reply (MessageError if it is not)."""
        return from_wire(rpc.reply, self.call(rpc.name, to_wire(msg), timeout), f"{rpc.name} reply from {self.addr}")

    def close_locked(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
