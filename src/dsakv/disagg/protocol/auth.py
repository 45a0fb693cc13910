"""Authentication of the control plane: a per-deployment secret, role keys, authenticated RPC frames.

    secret = load_secret(path)                  # --cluster-secret-file: >= 16 bytes, not readable by group/other
    use(ClusterAuth(Keyring(secret), "decode", require=True))   # once per process (dsakv serve does it)

Every process of a deployment holds the same secret. A caller signs its frames with the key of its role,
K_role = HMAC-SHA256(secret, "dsakv-role-v1:" + role), so a server knows which role sent a call and refuses an
RPC its spec does not allow that role (`Rpc.roles`); a process without the secret cannot call anything but is
refused before a byte of its frame is parsed.

Per connection (rpc.RpcServer / rpc.RpcClient):

    server ── greeting {"v": 1, "auth": "hmac-sha256" | "none", "nonce": 16 random bytes} ──► client
    client ── "A1" | u8 len(role) | role | u64 seq | tag(32) | msgpack request ──► server
              tag = HMAC(K_role, "dsakv-req-v1" | nonce | role | seq | body); seq = 1, 2, 3 ... per connection
    server ── "R1" | u64 seq | tag(32) | msgpack reply ──► client        tag = HMAC(K_role, "dsakv-rep-v1" | ...)
           or "X1" | msgpack error (an unauthenticated refusal; the connection is closed after it)

The nonce is the server's, fresh per connection, and seq must be exactly the next one, so a recorded frame
replayed on the same or another connection fails its tag. Bodies are authenticated, not encrypted: the control
plane carries token ids and page ids, no secret (the page-grant key travels in the handshake reply; see
grants.py); run it on loopback or a private network. Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path

from dsakv.util.secret import MIN_SECRET, SECRET_ENV, load_secret, new_secret, write_secret

ROLES = ("router", "prefill", "decode")
SCHEME = "hmac-sha256"
TAG = 32
_SEQ = struct.Struct(">Q")


class AuthError(Exception):
    """A frame that fails authentication (wrong or missing key, replayed, malformed header)."""


class Keyring:
    """The role keys derived from one deployment secret."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET:
            raise ValueError(f"a cluster secret needs at least {MIN_SECRET} bytes, got {len(secret)}")
        self._keys = {r: hmac.new(secret, f"dsakv-role-v1:{r}".encode(), hashlib.sha256).digest() for r in ROLES}
        self.fingerprint = hashlib.sha256(b"dsakv-fingerprint-v1:" + secret).hexdigest()[:12]

    def key(self, role: str) -> bytes:
        k = self._keys.get(role)
        if k is None:
            raise AuthError(f"unknown role {role!r} (roles: {', '.join(ROLES)})")
        return k


@dataclass(frozen=True)
class ClusterAuth:
    """One process's credentials: its keyring and role. `require`: its servers refuse unauthenticated calls
    and its clients refuse a peer that does not authenticate (dsakv serve); off for a test process that also
    talks to in-process workers without a secret."""

    keyring: Keyring
    role: str
    require: bool = True

    def __post_init__(self) -> None:
        self.keyring.key(self.role)


_current: ClusterAuth | None = None
_lock = threading.Lock()


def use(auth: ClusterAuth | None) -> None:
    """Set this process's credentials (servers and clients created without an explicit `auth` use them)."""
    global _current
    with _lock:
        _current = auth


def current() -> ClusterAuth | None:
    return _current


def launch_secret(path: str | Path, *, require: bool = True) -> Path:
    """For a launcher (the demo, benches, tests): write a fresh secret file at `path` for the roles it starts
    (--cluster-secret-file) and sign this process's own calls (health, routing) with it as the router."""
    p = write_secret(Path(path))
    use(ClusterAuth(Keyring(load_secret(p)), "router", require=require))
    return p


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


@dataclass
class Session:
    """One authenticated connection's state (either end): the server's nonce, the caller's role, the counter."""

    nonce: bytes
    keyring: Keyring
    role: str | None = None  # the client's (fixed on its first frame, server side)
    seq: int = 0
    _key: bytes = field(default=b"", repr=False)

    # client side
    def seal_request(self, role: str, body: bytes) -> bytes:
        self.seq += 1
        key = self.keyring.key(role)
        rb, sq = role.encode(), _SEQ.pack(self.seq)
        return b"A1" + bytes([len(rb)]) + rb + sq + _mac(key, b"dsakv-req-v1", self.nonce, rb, sq, body) + body

    def open_reply(self, role: str, frame: bytes) -> bytes:
        key = self.keyring.key(role)
        if frame[:2] != b"R1" or len(frame) < 2 + _SEQ.size + TAG:
            raise AuthError("the reply is not an authenticated frame")
        sq, tag, body = frame[2:10], frame[10 : 10 + TAG], frame[10 + TAG :]
        if _SEQ.unpack(sq)[0] != self.seq:
            raise AuthError(f"the reply is for call {_SEQ.unpack(sq)[0]}, expected {self.seq}")
        if not hmac.compare_digest(tag, _mac(key, b"dsakv-rep-v1", self.nonce, sq, body)):
            raise AuthError("the reply's tag does not verify (the peer does not hold this deployment's secret)")
        return body

    # server side
    def open_request(self, frame: bytes) -> tuple[str, bytes]:
        """(role, body) of an authenticated request frame; AuthError before the body is looked at otherwise."""
        if frame[:2] != b"A1" or len(frame) < 3:
            raise AuthError("the frame is not authenticated (no cluster secret?)")
        n = frame[2]
        rb = frame[3 : 3 + n]
        head = 3 + n
        if len(frame) < head + _SEQ.size + TAG:
            raise AuthError("the authenticated frame is truncated")
        sq, tag, body = frame[head : head + 8], frame[head + 8 : head + 8 + TAG], frame[head + 8 + TAG :]
        try:
            role = rb.decode("ascii")
        except UnicodeDecodeError:
            raise AuthError("the frame names no valid role") from None
        key = self.keyring.key(role)
        if self.role is not None and role != self.role:
            raise AuthError(f"the connection's role changed from {self.role} to {role}")
        seq = _SEQ.unpack(sq)[0]
        if not hmac.compare_digest(tag, _mac(key, b"dsakv-req-v1", self.nonce, rb, sq, body)):
            raise AuthError(f"the frame's tag does not verify for role {role} (wrong secret, or a replay)")
        if seq != self.seq + 1:
            raise AuthError(f"call number {seq} on this connection, expected {self.seq + 1} (a replayed frame)")
        self.role, self.seq, self._key = role, seq, key
        return role, body

    def seal_reply(self, body: bytes) -> bytes:
        sq = _SEQ.pack(self.seq)
        return b"R1" + sq + _mac(self._key, b"dsakv-rep-v1", self.nonce, sq, body) + body


__all__ = [
    "ROLES",
    "SECRET_ENV",
    "AuthError",
    "ClusterAuth",
    "Keyring",
    "Session",
    "current",
    "launch_secret",
    "load_secret",
    "new_secret",
    "use",
    "write_secret",
]
