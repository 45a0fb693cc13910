"""The control-plane RPC server (dsakv.disagg.protocol.rpc): one thread per connection, the greeting and its
authentication (dsakv.disagg.protocol.auth), connection caps (in total, per peer, not yet authenticated) with the
first frame's deadline, and the dispatch of each request to its handler under the method's role ACL."""

from __future__ import annotations

import logging
import os
import socket
import socketserver
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dsakv.disagg.protocol import auth as _auth
from dsakv.disagg.protocol.auth import AuthError, ClusterAuth, Session
from dsakv.disagg.protocol.rpc_errors import error_kind
from dsakv.disagg.protocol.rpc_frames import (
    _HDR,
    AUTH_TIMEOUT,
    DEFAULT,
    FRAME_TIMEOUT,
    LATE_READ_S,
    MAX_CONNECTIONS,
    MAX_PENDING,
    MAX_PENDING_PER_PEER,
    MAX_PER_PEER,
    MAX_REQUEST,
    REFUSAL,
    Handler,
    _Default,
    _recv_exact,
    error_frame,
    pack,
    recv_frame,
    reply_frame,
    send_frame,
    send_msg,
    unpack,
)
from dsakv.util.stats import Stats

log = logging.getLogger(__name__)


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


@dataclass
class RpcRefusals(Stats):
    """What a server refused, by why (WorkerService shows each in its health counters as rpc_refused_<why>)."""

    too_large: int = 0  # a request frame over max_request
    timeout: int = 0  # a request frame that did not arrive within frame_timeout
    connections: int = 0  # a connection past max_connections / max_per_peer
    unauthenticated: int = 0  # a call that failed authentication
    forbidden: int = 0  # a call from a role its RPC does not allow
    auth_timeout: int = 0  # a new connection that sent no frame within auth_timeout
    evicted: int = 0  # a connection not authenticated yet, closed for a newer one


class RpcServer:
    """Serves `handlers[method](params) -> result` on (host, port), one thread per connection.

    Connection limits (none needs the secret to be enforced): a new connection must send its first frame, which
    must authenticate, within `auth_timeout` seconds, else it is closed (refused.auth_timeout); at most
    `max_pending` connections (`max_pending_per_peer` from one peer host) may be waiting to authenticate: one more
    closes the oldest waiting one, silent ones before those whose first frame has begun to arrive
    (refused.evicted), so idle connections cannot lock a real caller out. At most `max_connections` connections are
    open (`max_per_peer` from one host); past that a new one is closed at once (refused.connections)."""

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
        self.refused = RpcRefusals()
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
                            if slow:
                                outer.refused.timeout += 1
                            else:
                                outer.refused.auth_timeout += 1
                        log.warning(
                            "%s: %s: closed", outer.name,
                            f"a request frame did not arrive within {outer.frame_timeout:g} s" if slow else
                            f"a new connection sent no frame within {outer.auth_timeout:g} s",
                        )  # fmt: skip
                        return
                    except ConnectionError as e:
                        if "exceeds" in str(e):
                            with outer._count:
                                outer.refused.too_large += 1
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
                            outer._refuse_unauthenticated(sock, f"call refused: {e}")
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
                self.refused.connections += 1
                log.warning(
                    "%s: %d connections open (%d from %s): refusing one more", self.name, len(conns), len(mine), peer
                )
                return None
            for c in evict:
                self._conns.pop(c.sock, None)
                self.refused.evicted += 1
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
            # past the deadline (a thread woken late), what already arrived is still taken: a short last read
            left = max(min(self.frame_timeout, deadline - time.monotonic()), LATE_READ_S)
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

    def _refuse_unauthenticated(self, sock: socket.socket, message: str) -> None:
        with self._count:
            self.refused.unauthenticated += 1
        try:
            host, port = sock.getpeername()[:2]
            peer = f"{host}:{port}"
        except OSError:
            peer = "?"
        log.warning("%s: unauthenticated from %s: %s", self.name, peer, message)
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
                self.refused.forbidden += 1
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
