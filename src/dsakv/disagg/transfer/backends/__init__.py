"""Transfer backends in a registry: mooncake (default), nixl, local. See base.py for the contract."""

from dsakv.disagg.transfer.backends.base import (
    Peer,
    Span,
    TransferBackend,
    TransferHandle,
    TransferStatus,
    deadline_in,
)
from dsakv.disagg.transfer.backends.local import LocalBackend
from dsakv.disagg.transfer.backends.mooncake import MooncakeBackend, mooncake_batch_limit
from dsakv.disagg.transfer.backends.nixl import NixlBackend
from dsakv.disagg.transfer.backends.registry import (
    BACKENDS,
    backend_class,
    backend_names,
    make_backend,
    register_backend,
)

__all__ = [
    "BACKENDS",
    "LocalBackend",
    "MooncakeBackend",
    "NixlBackend",
    "Peer",
    "Span",
    "TransferBackend",
    "TransferHandle",
    "TransferStatus",
    "backend_class",
    "backend_names",
    "deadline_in",
    "make_backend",
    "mooncake_batch_limit",
    "register_backend",
]
