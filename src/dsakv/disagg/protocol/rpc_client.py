"""The control-plane RPC client (dsakv.disagg.protocol.rpc): one cached connection per peer, authenticated frames,
a deadline on every call, one retry on a fresh connection for idempotent calls."""

from __future__ import annotations

import logging
import socket
import threading
import time
from typing import Any

from dsakv.disagg.protocol import auth as _auth
from dsakv.disagg.protocol.auth import AuthError, ClusterAuth, Session
from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.rpc_errors import PeerUnavailable, Unauthenticated, _NoGreeting, remote_error
from dsakv.disagg.protocol.rpc_frames import (
    DEFAULT,
    REFUSAL,
    _Default,
    pack,
    recv_frame,
    recv_msg,
    request_frame,
    send_frame,
    split_addr,
    unpack,
)
from dsakv.disagg.protocol.rpc_spec import Q, R, Rpc

log = logging.getLogger(__name__)


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
