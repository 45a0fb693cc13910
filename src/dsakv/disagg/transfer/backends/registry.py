"""Registry of transfer backends: name -> class, one class per engine.

    make_backend("mooncake")            default; mooncake.engine.TransferEngine, P2P handshake, TCP here
    make_backend("nixl")                nixl_cu12 agent with the UCX plugin
    make_backend("local")               same-process memcpy, for unit tests

The names are dsakv.config.transfer.TRANSFER_BACKENDS ("name" -> "module:Class"): a backend's module is
imported (and registers its class) the first time its name is asked for. Importing a backend module never
imports its engine; the engine is imported when the backend is constructed. Imports disagg.backends.base and
dsakv.config only.
"""

from __future__ import annotations

import importlib
from typing import Any, TypeVar

from dsakv.config.transfer import DEFAULT_BACKEND, TRANSFER_BACKENDS
from dsakv.disagg.transfer.backends.base import TransferBackend
from dsakv.util import Registry

BACKENDS: Registry[type[TransferBackend]] = Registry("transfer backend")

B = TypeVar("B", bound=type[TransferBackend])


def register_backend(cls: B) -> B:
    """Class decorator: make `cls` available as make_backend(cls.name)."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    BACKENDS.add(cls.name, cls)
    return cls


def backend_names() -> tuple[str, ...]:
    """Every backend's name: the lazy table's, then any registered outside it."""
    return tuple(dict.fromkeys((*TRANSFER_BACKENDS, *BACKENDS.names())))


def backend_class(name: str) -> type[TransferBackend]:
    """The class registered as `name`, importing its module from TRANSFER_BACKENDS on first use (ConfigError
    naming the choices for an unknown name)."""
    if name not in BACKENDS and name in TRANSFER_BACKENDS:
        module, _, attr = TRANSFER_BACKENDS[name].partition(":")
        cls = getattr(importlib.import_module(module), attr)
        if name not in BACKENDS:  # a module that does not register under its table name is a wiring bug
            raise RuntimeError(f"{TRANSFER_BACKENDS[name]} did not register transfer backend {name!r}")
        assert BACKENDS.get(name) is cls, f"{TRANSFER_BACKENDS[name]} registered another class as {name!r}"
    return BACKENDS.get(name)


def make_backend(name: str = DEFAULT_BACKEND, **options: Any) -> TransferBackend:
    """Construct the backend registered as `name` with its keyword options."""
    return backend_class(name)(**options)
