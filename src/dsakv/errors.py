"""Error types shared by every layer of dsakv. Imports nothing from dsakv."""

from __future__ import annotations


class DsakvError(Exception):
    """Base class: a user-facing error with a message that says what to change."""


class ConfigError(DsakvError, ValueError):
    """A model config, deployment option or CLI value is invalid."""


class CapacityError(DsakvError, ValueError):
    """A budget, pool or request does not fit."""


class NoFreePages(CapacityError):
    """The pool has too few free pages right now (it would fit later): retry after requests finish."""


class Unavailable(DsakvError):
    """The server cannot take requests right now (e.g. a rank of its group died): HTTP `status` 503."""

    status = 503
    code = "unavailable"
