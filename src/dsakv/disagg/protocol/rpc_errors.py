"""Errors of the control-plane RPC (dsakv.disagg.protocol.rpc): RpcError and its kinds, and the registry of
exception classes a peer's error is re-raised as (ERROR_KINDS: by class name, never an arbitrary class)."""

from __future__ import annotations

import logging

from dsakv.cache.allocator import IntegrityError
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
