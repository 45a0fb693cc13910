"""Registry of transfer backends: name -> class, one class per engine.

    make_backend("mooncake")            default; mooncake.engine.TransferEngine, P2P handshake, TCP here
    make_backend("nixl")                nixl_cu12 agent with the UCX plugin
    make_backend("local")               same-process memcpy, for unit tests

Importing a backend module never imports its engine; the engine is imported
when the backend is constructed. Imports disagg.backends.base only.
"""

from __future__ import annotations

from typing import Any, TypeVar

from dsakv.disagg.transfer.backends.base import TransferBackend
from dsakv.util import Registry

DEFAULT_BACKEND = "mooncake"
BACKENDS: Registry[type[TransferBackend]] = Registry("transfer backend")

B = TypeVar("B", bound=type[TransferBackend])


def register_backend(cls: B) -> B:
    """Class decorator: make `cls` available as make_backend(cls.name)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    BACKENDS.add(cls.name, cls)
    return cls


def backend_names() -> tuple[str, ...]:
    return BACKENDS.names()


def make_backend(name: str = DEFAULT_BACKEND, **options: Any) -> TransferBackend:
    """Construct the backend registered as `name` with its keyword options."""
    return BACKENDS.get(name)(**options)
