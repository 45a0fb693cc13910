"""Errors of the KV transfer layer. Imports only dsakv.errors.

DsakvError
├── ManifestError      a manifest is malformed, foreign or inconsistent with its layout
├── IncompatiblePeer   two manifests cannot be paired (handshake refused)
├── Unavailable        a worker cannot take requests now (pipeline not formed, stopping): route elsewhere
├── Forbidden          an authenticated caller's role or identity may not make this call (refused, counted)
│   └── GrantRefused   a page grant is missing, forged, expired, spent or for other pages / another request
├── ConfigError
│   └── MessageError   a control-plane message does not match its type (refused before any handler runs)
└── TransferError      an engine refused a registration or a transfer (carries the engine's code)
    ├── RegistrationError
    └── TransferTimeout  a transfer did not finish before its deadline
"""

from __future__ import annotations

from dsakv.errors import ConfigError, DsakvError


class ManifestError(DsakvError, ValueError):
    """A manifest could not be read, or describes buffers its layout does not hold."""


class IncompatiblePeer(DsakvError):
    """Handshake refused: the peers disagree on model, page size, format, layers or buffer sizes."""


class Unavailable(DsakvError):
    """This worker cannot take requests now (pipeline not formed, stopping): route elsewhere."""


class Forbidden(DsakvError):
    """The caller may not make this call: its role is not one the RPC allows, or it is not the registered
    stage (boot id) the request belongs to. Nothing was changed."""


class GrantRefused(Forbidden):
    """A page grant (grants.py) is missing, does not verify, expired, was used already, or names another
    request, decode, prefill or other pages. Nothing was written."""


class MessageError(ConfigError):
    """A control-plane message is malformed: a field is missing, unknown or of the wrong type."""


class TransferError(DsakvError):
    """A transfer-engine call failed. `code` is the engine's own return code (int) or error name (str)."""

    def __init__(self, message: str, *, backend: str = "", code: int | str | None = None) -> None:
        super().__init__(message)
        self.backend = backend
        self.code = code


class RegistrationError(TransferError):
    """A memory registration was refused (by dsakv before the engine, or by the engine)."""


class TransferTimeout(TransferError):
    """A transfer was still unfinished at its deadline; it has been cancelled."""
