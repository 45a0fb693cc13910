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


class StepRetry(Exception):
    """A collective of the step broke and its group re-forms (engine/dp.py, elastic EP): the engine keeps the
    step's schedule and runs the same rows again at its next step (nothing sampled, nothing failed)."""


class Unavailable(DsakvError):
    """The server cannot take requests right now (e.g. a rank of its group died): HTTP `status` 503."""

    status = 503
    code = "unavailable"
