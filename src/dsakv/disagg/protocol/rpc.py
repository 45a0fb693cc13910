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

The implementation, by concept: rpc_errors (RpcError and the remote error kinds), rpc_frames (framing, caps,
deadlines), rpc_spec (Rpc, Service, bind), rpc_server (RpcServer: greeting, auth, connection caps, dispatch),
rpc_client (RpcClient); this module is their one public face.
"""

from __future__ import annotations

from dsakv.disagg.protocol.rpc_client import RpcClient
from dsakv.disagg.protocol.rpc_errors import (
    ERROR_KINDS,
    PeerUnavailable,
    RpcError,
    Unauthenticated,
    error_kind,
    remote_error,
)
from dsakv.disagg.protocol.rpc_frames import (
    AUTH_TIMEOUT,
    DEFAULT,
    FRAME_TIMEOUT,
    MAX_CONNECTIONS,
    MAX_MESSAGE,
    MAX_PENDING,
    MAX_PENDING_PER_PEER,
    MAX_PER_PEER,
    MAX_REQUEST,
    REFUSAL,
    Handler,
    error_frame,
    pack,
    recv_frame,
    recv_msg,
    reply_frame,
    request_frame,
    send_frame,
    send_msg,
    split_addr,
    unpack,
)
from dsakv.disagg.protocol.rpc_server import RpcServer
from dsakv.disagg.protocol.rpc_spec import Rpc, Service, acl_of, bind, services_table

__all__ = [
    "AUTH_TIMEOUT",
    "DEFAULT",
    "ERROR_KINDS",
    "FRAME_TIMEOUT",
    "MAX_CONNECTIONS",
    "MAX_MESSAGE",
    "MAX_PENDING",
    "MAX_PENDING_PER_PEER",
    "MAX_PER_PEER",
    "MAX_REQUEST",
    "REFUSAL",
    "Handler",
    "PeerUnavailable",
    "Rpc",
    "RpcClient",
    "RpcError",
    "RpcServer",
    "Service",
    "Unauthenticated",
    "acl_of",
    "bind",
    "error_frame",
    "error_kind",
    "pack",
    "recv_frame",
    "recv_msg",
    "remote_error",
    "reply_frame",
    "request_frame",
    "send_frame",
    "send_msg",
    "services_table",
    "split_addr",
    "unpack",
]
