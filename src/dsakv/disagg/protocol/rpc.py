"""A small control-plane RPC: length-prefixed msgpack over TCP, every call bounded in time.

Used for handshakes, page allocation, completion notices and the router. Bulk KV
bytes never travel here (they go through a TransferBackend).

Wire format, both directions:  | u32 big-endian length | frame |; the server speaks first, once per connection:
greeting {"v": 1, "auth": "hmac-sha256" | "none", "nonce": bytes}      (msgpack, public data only)
request  {"id": int, "method": str, "params": any}                     request_frame / reply_frame /
response {"id": int, "ok": bool, "result": any}                        error_frame (msgpack maps)
      or {"id": int, "ok": false, "error": str, "kind": str}
With "auth": "hmac-sha256" each request and reply map travels inside an authenticated frame (dsakv.disagg.protocol.auth:
role, per-connection counter, HMAC-SHA256 tag under the caller's role key); the server checks the tag and the
counter before it parses the map, then the caller's role against `Rpc.roles`. A refused frame is answered with
an unauthenticated error ("X1"), counted in `refused`, logged, and its connection closed.

Typed use (dsakv.disagg.protocol.messages lists every RPC as an `Rpc` spec: name, request type, reply type):

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
import os
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
from dsakv.disagg.protocol import auth as _auth
from dsakv.disagg.protocol.auth import AuthError, ClusterAuth, Session
from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.errors import (
    Forbidden,
    GrantRefused,
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
MAX_PER_PEER = 128  # open connections from one peer address (host)
AUTH_TIMEOUT = 2.0  # seconds a new connection has to send its first (authenticated) frame, else it is closed
MAX_PENDING = 64  # connections not authenticated yet, in total; one more closes the oldest of them
MAX_PENDING_PER_PEER = 32  # ... and from one peer address
_HDR = struct.Struct(">I")


class RpcError(DsakvError):
    """The remote handler raised; `kind` is the remote exception's class name."""

    def __init__(self, message: str, kind: str = "RpcError") -> None:
        super().__init__(message)
        self.kind = kind


class Unauthenticated(RpcError):
    """The peer refused the call's authentication (no or wrong cluster secret, replay), or did not
    authenticate itself where this process requires it."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "Unauthenticated")


class PeerUnavailable(RpcError):
    """The peer refused the connection, closed it, or did not answer within the deadline."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "PeerUnavailable")


class _NoGreeting(PeerUnavailable):
    """The peer closed a new connection before its greeting (nothing of the call was sent)."""


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
    Forbidden,
    GrantRefused,
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
    """One RPC: its method name, request and reply types, and who calls it (the documented RPC graph).
    `roles`: the caller roles an authenticating server accepts (dsakv.disagg.protocol.auth.ROLES; None: any role holding
    the secret). `retry`: a one-shot call whose cached connection turns out dead (the peer restarted) is sent
    once more on a fresh connection within its deadline (for idempotent calls only)."""

    name: str
    request: type[Q]
    reply: type[R]
    caller: str
    doc: str
    roles: tuple[str, ...] | None = None
    retry: bool = False


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


def acl_of(service: Service) -> dict[str, tuple[str, ...] | None]:
    """method -> the roles allowed to call it (for RpcServer)."""
    return {r.name: r.roles for r in service.rpcs}


def services_table(services: Sequence[Service]) -> str:
    """Text table of every RPC: service, method, request -> reply, caller (for docs and --help)."""
    rows = []
    for s in services:
        for r in s.rpcs:
            rows.append(
                f"{s.name:<16} {r.name:<16} {r.request.__name__} -> {getattr(r.reply, '__name__', r.reply)}"
                f"   (from {r.caller}; roles {'/'.join(r.roles) if r.roles else 'any'})"
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


class _ThreadingServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 512  # a burst of connects (a flood, then a real caller) is accepted, not dropped


class _SlowFrame(TimeoutError):
    """An announced frame whose bytes did not all arrive in time."""


@dataclass(eq=False)
class _Conn:
    """One open connection, as the server's books hold it."""

    sock: socket.socket
    peer: str  # the peer's host (the per-peer caps count by it)
    opened: float
    pending: bool = True  # no frame has authenticated yet
    speaking: bool = False  # its first frame has begun to arrive (closed for a new one only after the silent ones)


class RpcServer:
    """Serves `handlers[method](params) -> result` on (host, port), one thread per connection.

    Connection limits (none needs the secret to be enforced): a new connection must send its first frame, which
    must authenticate, within `auth_timeout` seconds, else it is closed (refused["auth_timeout"]); at most
    `max_pending` connections (`max_pending_per_peer` from one peer host) may be waiting to authenticate: one more
    closes the oldest waiting one, silent ones before those whose first frame has begun to arrive
    (refused["evicted"]), so idle connections cannot lock a real caller out. At most `max_connections` connections are
    open (`max_per_peer` from one host); past that a new one is closed at once (refused["connections"])."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "rpc",
        max_request: int = MAX_REQUEST,
        frame_timeout: float = FRAME_TIMEOUT,
        max_connections: int = MAX_CONNECTIONS,
        auth: ClusterAuth | None | _Default = DEFAULT,
        acl: Mapping[str, tuple[str, ...] | None] | None = None,
        *,
        auth_timeout: float = AUTH_TIMEOUT,
        max_per_peer: int | None = None,
        max_pending: int = MAX_PENDING,
        max_pending_per_peer: int = MAX_PENDING_PER_PEER,
    ):
        """`auth`: the credentials every call must be authenticated with (default: this process's, when they
        `require` it; None: unauthenticated, for in-process tests). `acl`: method -> allowed caller roles."""
        for what, v in (("max_connections", max_connections), ("max_pending", max_pending),
                        ("max_pending_per_peer", max_pending_per_peer)):  # fmt: skip
            if v < 1:
                raise ValueError(f"RpcServer {name}: {what} = {v} must be >= 1")
        if not auth_timeout > 0 or not frame_timeout > 0:
            raise ValueError(
                f"RpcServer {name}: auth_timeout {auth_timeout} and frame_timeout {frame_timeout} must be > 0"
            )
        self.handlers = dict(handlers)
        self.name = name
        self.max_request = max_request
        self.frame_timeout = frame_timeout
        self.max_connections = max_connections
        self.max_per_peer = min(max_connections, MAX_PER_PEER) if max_per_peer is None else max_per_peer
        self.auth_timeout = auth_timeout
        self.max_pending = max_pending
        self.max_pending_per_peer = max_pending_per_peer
        if isinstance(auth, _Default):
            cur = _auth.current()
            auth = cur if cur is not None and cur.require else None
        self.auth: ClusterAuth | None = auth
        self.acl = dict(acl or {})
        self.refused = dict.fromkeys(
            ("too_large", "timeout", "connections", "unauthenticated", "forbidden", "auth_timeout", "evicted"), 0
        )
        self._count = threading.Lock()
        self._conns: dict[socket.socket, _Conn] = {}  # insertion order: the oldest first
        outer = self

        class _Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                sock: socket.socket = self.request
                if outer._admit(sock) is None:
                    return
                try:
                    self._serve(sock)
                finally:
                    with outer._count:
                        outer._conns.pop(sock, None)

            def _serve(self, sock: socket.socket) -> None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                session = outer._greet(sock)
                first = True
                while True:
                    try:
                        frame = (
                            outer._recv_first(sock)
                            if first
                            else recv_frame(sock, outer.max_request, outer.frame_timeout)
                        )
                    except TimeoutError as e:
                        slow = not first or isinstance(e, _SlowFrame)
                        with outer._count:
                            outer.refused["timeout" if slow else "auth_timeout"] += 1
                        log.warning(
                            "%s: %s: closed", outer.name,
                            f"a request frame did not arrive within {outer.frame_timeout:g} s" if slow else
                            f"a new connection sent no frame within {outer.auth_timeout:g} s",
                        )  # fmt: skip
                        return
                    except ConnectionError as e:
                        if "exceeds" in str(e):
                            with outer._count:
                                outer.refused["too_large"] += 1
                            log.warning("%s: %s: closed", outer.name, e)
                        return
                    except (OSError, ValueError):
                        return
                    if session is None:
                        try:
                            msg = unpack(frame)
                        except (ValueError, TypeError):  # not msgpack, or an unhashable map key
                            return
                        role = None
                    else:
                        try:
                            role, body = session.open_request(frame)
                        except AuthError as e:
                            outer._refuse(sock, "unauthenticated", f"call refused: {e}")
                            return
                        try:
                            msg = unpack(body)
                        except (ValueError, TypeError):
                            return
                    if first:
                        first = False
                        outer._established(sock)
                    try:
                        out = pack(outer._dispatch(msg, role))
                        reply = out if session is None else session.seal_reply(out)
                    except (ValueError, TypeError):  # an unpackable result
                        return
                    try:
                        send_frame(sock, reply)
                    except OSError:
                        return

        self._server = _ThreadingServer((host, port), _Handler)
        addr = self._server.server_address
        self.host, self.port = str(addr[0]), int(addr[1])
        self._thread: threading.Thread | None = None

    # ---- connection books ------------------------------------------------------------------------------

    @property
    def open_connections(self) -> int:
        with self._count:
            return len(self._conns)

    @property
    def pending_connections(self) -> int:
        """Open connections that have not authenticated yet."""
        with self._count:
            return sum(c.pending for c in self._conns.values())

    def _admit(self, sock: socket.socket) -> _Conn | None:
        """Book a new connection under the caps (closing the oldest unauthenticated one to make room for it);
        None if it is refused (then it is closed)."""
        try:
            peer = str(sock.getpeername()[0])
        except OSError:
            return None
        evict: list[_Conn] = []
        with self._count:
            conns = list(self._conns.values())
            # waiting connections, the first to close first: silent ones (oldest first), then those whose first
            # frame has begun to arrive (a real caller's, most likely)
            pending = [c for c in conns if c.pending and not c.speaking] + [
                c for c in conns if c.pending and c.speaking
            ]
            mine = [c for c in conns if c.peer == peer]
            mine_pending = [c for c in pending if c.peer == peer]
            if len(mine_pending) >= self.max_pending_per_peer:
                evict.append(mine_pending[0])
            elif len(pending) >= self.max_pending:
                evict.append(pending[0])
            full = len(conns) - len(evict) >= self.max_connections
            if full and not evict and pending:
                evict.append(pending[0])
                full = False
            mine_full = len(mine) - sum(c.peer == peer for c in evict) >= self.max_per_peer
            if mine_full and not any(c.peer == peer for c in evict) and mine_pending:
                evict.append(mine_pending[0])
                mine_full = False
            if full or mine_full:
                self.refused["connections"] += 1
                log.warning(
                    "%s: %d connections open (%d from %s): refusing one more", self.name, len(conns), len(mine), peer
                )
                return None
            for c in evict:
                self._conns.pop(c.sock, None)
                self.refused["evicted"] += 1
            conn = self._conns[sock] = _Conn(sock, peer, time.monotonic())
        for c in evict:
            log.info(
                "%s: closed a connection from %s that had not authenticated, to admit a new one", self.name, c.peer
            )
            try:
                c.sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it leaves the books (already out)
            except OSError:
                pass
        return conn

    def _established(self, sock: socket.socket) -> None:
        with self._count:
            c = self._conns.get(sock)
            if c is not None:
                c.pending = False

    def _recv_first(self, sock: socket.socket) -> bytes:
        """A connection's first frame, whole, within auth_timeout (TimeoutError otherwise)."""
        deadline = time.monotonic() + self.auth_timeout
        sock.settimeout(self.auth_timeout)
        try:
            head = _recv_exact(sock, 1)
            with self._count:
                c = self._conns.get(sock)
                if c is not None:
                    c.speaking = True
            (n,) = _HDR.unpack(head + _recv_exact(sock, _HDR.size - 1))
            if n > self.max_request:
                raise ConnectionError(f"message of {n} bytes exceeds the {self.max_request}-byte limit")
            left = min(self.frame_timeout, deadline - time.monotonic())
            if left <= 0:
                raise TimeoutError
            sock.settimeout(left)
            try:
                return _recv_exact(sock, n)
            except TimeoutError:
                raise _SlowFrame from None
        finally:
            sock.settimeout(None)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def _greet(self, sock: socket.socket) -> Session | None:
        """Send the connection's greeting; the Session that authenticates its frames (None: unauthenticated)."""
        nonce = os.urandom(16)
        try:
            send_msg(sock, {"v": 1, "auth": _auth.SCHEME if self.auth else "none", "nonce": nonce})
        except OSError:
            return None
        return Session(nonce, self.auth.keyring) if self.auth is not None else None

    def _refuse(self, sock: socket.socket, why: str, message: str) -> None:
        with self._count:
            self.refused[why] += 1
        try:
            host, port = sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        log.warning("%s: %s from %s: %s", self.name, why, peer, message)
        try:
            send_frame(sock, REFUSAL + pack(error_frame(None, f"{self.name}: {message}", "Unauthenticated")))
        except OSError:
            pass

    def _dispatch(self, msg: Any, role: str | None = None) -> dict[str, Any]:
        mid = msg.get("id") if isinstance(msg, dict) else None
        method = msg.get("method") if isinstance(msg, dict) else None
        fn = self.handlers.get(method) if isinstance(method, str) else None
        if fn is None:
            return error_frame(mid, f"{self.name}: unknown method {method!r}", "RpcError")
        allowed = self.acl.get(method) if isinstance(method, str) else None
        if self.auth is not None and allowed is not None and role not in allowed:
            with self._count:
                self.refused["forbidden"] += 1
            log.warning("%s: refused %s from role %s (allowed: %s)", self.name, method, role, ", ".join(allowed))
            return error_frame(
                mid, f"{self.name}: {method} may be called by {'/'.join(allowed)} only, not by a {role}", "Forbidden"
            )
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
        """Stop serving: the listener and every open connection (as the process's exit would)."""
        self._server.shutdown()
        self._server.server_close()
        with self._count:
            socks = list(self._conns)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


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
    """Calls one peer. Thread-safe; reconnects after a failure; every call has a deadline.

    `auth`: the credentials its calls are signed with when the peer asks (default: this process's); None:
    anonymous (a peer that requires authentication refuses every call)."""

    def __init__(
        self,
        addr: str,
        timeout: float = 10.0,
        connect_timeout: float = 2.0,
        auth: ClusterAuth | None | _Default = DEFAULT,
    ) -> None:
        self.addr = addr
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._auth = auth
        self._sock: socket.socket | None = None
        self._session: Session | None = None
        self._role: str | None = None
        self._lock = threading.Lock()
        self._next_id = 0

    def _credentials(self) -> ClusterAuth | None:
        return _auth.current() if isinstance(self._auth, _Default) else self._auth

    def _connect(self, deadline: float) -> socket.socket:
        host, port = split_addr(self.addr)
        t = max(0.01, min(self.connect_timeout, deadline - time.monotonic()))
        try:
            sock = socket.create_connection((host, port), timeout=t)
        except OSError as e:
            raise PeerUnavailable(f"peer {self.addr} is unavailable: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            greeting = recv_msg(sock, 4096)
        except TimeoutError:  # accepts, never speaks: the call's "did not answer within the deadline"
            sock.close()
            raise
        except ConnectionError as e:  # closed before its greeting (e.g. to admit a newer connection): unsent
            sock.close()
            raise _NoGreeting(f"peer {self.addr} sent no greeting: {e}") from None
        except (OSError, ValueError) as e:
            sock.close()
            raise PeerUnavailable(f"peer {self.addr} sent no greeting: {e}") from None
        scheme = greeting.get("auth") if isinstance(greeting, dict) else None
        nonce = greeting.get("nonce") if isinstance(greeting, dict) else None
        cred = self._credentials()
        self._session, self._role = None, None
        if scheme == _auth.SCHEME and isinstance(nonce, bytes) and len(nonce) >= 16:
            if cred is None:
                sock.close()
                raise Unauthenticated(
                    f"peer {self.addr} requires the deployment's cluster secret and this process has none: "
                    f"pass --cluster-secret-file (or set {_auth.SECRET_ENV})"
                )
            self._session, self._role = Session(nonce, cred.keyring), cred.role
        elif scheme == "none":
            if cred is not None and cred.require:
                sock.close()
                raise Unauthenticated(
                    f"peer {self.addr} does not authenticate its calls (started without a cluster secret): refused"
                )
        else:
            sock.close()
            raise PeerUnavailable(f"peer {self.addr} sent a malformed greeting")
        return sock

    def _roundtrip(self, sock: socket.socket, mid: int, method: str, params: Any) -> Any:
        body = pack(request_frame(mid, method, params))
        if self._session is None:
            send_frame(sock, body)
            data = recv_frame(sock)
        else:
            assert self._role is not None
            send_frame(sock, self._session.seal_request(self._role, body))
            frame = recv_frame(sock)
            if frame[:2] == REFUSAL:
                err = unpack(frame[2:])
                msg = err.get("error") if isinstance(err, dict) else None
                raise Unauthenticated(f"peer {self.addr} refused {method!r}: {msg}")
            try:
                data = self._session.open_reply(self._role, frame)
            except AuthError as e:
                raise Unauthenticated(f"peer {self.addr} answered {method!r} unauthenticated: {e}") from None
        return unpack(data)

    def call(self, method: str, params: Any = None, timeout: float | None = None, retry: bool = False) -> Any:
        """One call. `retry`: if a cached connection turns out dead before the reply (the peer restarted since),
        reconnect and send it once more, within the same deadline (only for calls that are safe to repeat)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        with self._lock:
            self._next_id += 1
            mid = self._next_id
            for attempt in (0, 1):
                reused = self._sock is not None
                try:
                    if self._sock is None:
                        self._sock = self._connect(deadline)
                    self._sock.settimeout(max(0.01, deadline - time.monotonic()))
                    reply = self._roundtrip(self._sock, mid, method, params)
                    break
                except _NoGreeting:  # nothing was sent: one more connection, within the deadline
                    self.close_locked()
                    if attempt == 0 and time.monotonic() < deadline:
                        continue
                    raise
                except (PeerUnavailable, Unauthenticated):
                    self.close_locked()
                    raise
                except TimeoutError:
                    self.close_locked()
                    raise PeerUnavailable(f"peer {self.addr} did not answer {method!r} within the deadline") from None
                except (OSError, ConnectionError, ValueError, TypeError) as e:
                    self.close_locked()
                    if retry and reused and attempt == 0 and time.monotonic() < deadline:
                        log.info("%s %s: cached connection dead (%s): retrying on a new one", self.addr, method, e)
                        continue
                    raise PeerUnavailable(f"peer {self.addr} failed during {method!r}: {e}") from None
        if not isinstance(reply, dict):
            raise PeerUnavailable(f"peer {self.addr} answered {method!r} with a malformed frame")
        if not reply.get("ok"):
            raise remote_error(f"{self.addr} {method}: {reply.get('error')}", str(reply.get("kind", "RpcError")))
        return reply.get("result")

    def request(self, rpc: Rpc[Q, R], msg: Q, timeout: float | None = None) -> R:
        """Typed call: `msg` encoded, the reply checked and decoded as rpc.reply (MessageError if it is not)."""
        reply = self.call(rpc.name, to_wire(msg), timeout, retry=rpc.retry)
        return from_wire(rpc.reply, reply, f"{rpc.name} reply from {self.addr}")

    def close_locked(self) -> None:
        self._session = None
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def close(self) -> None:
        with self._lock:
            self.close_locked()
