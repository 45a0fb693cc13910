"""The transfer branch of the configuration tree (dsakv.config): the KV transfer backend and the control-plane
bounds of the disaggregated roles. Imports only errors.

TRANSFER_BACKENDS names every backend as "module:Class" (dsakv.disagg.transfer.backends.registry imports a
backend's module on first use), so the command line's --transfer-backend choices (BACKEND_CHOICES) and a config
check know the names without importing a backend or its engine. Each backend's constructor options are typed
here too (BackendOptions: MooncakeOptions, NixlOptions, LocalOptions; BACKEND_OPTIONS by name):
`TransferConfig.backend_options(host)` is what a role process at `host` hands its backend.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from dsakv.errors import ConfigError

_BACKENDS_PKG = "dsakv.disagg.transfer.backends"
TRANSFER_BACKENDS: dict[str, str] = {
    "mooncake": f"{_BACKENDS_PKG}.mooncake:MooncakeBackend",
    "nixl": f"{_BACKENDS_PKG}.nixl:NixlBackend",
    "local": f"{_BACKENDS_PKG}.local:LocalBackend",
}
BACKEND_CHOICES: tuple[str, ...] = tuple(TRANSFER_BACKENDS)
DEFAULT_BACKEND = "mooncake"
LOOPBACK_UCX_ENV: dict[str, str] = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}  # nixl on one host: tcp on lo
LOOPBACK_HOSTS = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class BackendOptions:
    """The constructor options a role passes its transfer backend (a backend without options: none).
    `kwargs()` is their keyword spelling, what the backend's class takes (make_backend(name, **kwargs()))."""

    def kwargs(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def of(cls, transfer: TransferConfig, host: str) -> BackendOptions:
        """The options of a process at `host` running the tree's transfer branch."""
        return cls()


@dataclass(frozen=True)
class MooncakeOptions(BackendOptions):
    """dsakv.disagg.transfer.backends.mooncake.MooncakeBackend's options."""

    hostname: str = "127.0.0.1"  # the address this process's transfer engine listens on (--host)
    engine_timeout_s: int | None = None  # MC_TRANSFER_TIMEOUT (--mooncake-timeout; None: the engine's own)

    def kwargs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hostname": self.hostname}
        if self.engine_timeout_s is not None:
            out["engine_timeout_s"] = self.engine_timeout_s
        return out

    @classmethod
    def of(cls, transfer: TransferConfig, host: str) -> MooncakeOptions:
        return cls(hostname=host, engine_timeout_s=transfer.mooncake_timeout)


@dataclass(frozen=True)
class NixlOptions(BackendOptions):
    """dsakv.disagg.transfer.backends.nixl.NixlBackend's options: the UCX environment it sets (LOOPBACK_UCX_ENV
    for a process on the loopback address, so one host exercises the network path)."""

    env: tuple[tuple[str, str], ...] = ()

    def kwargs(self) -> dict[str, Any]:
        return {"env": dict(self.env)} if self.env else {}

    @classmethod
    def of(cls, transfer: TransferConfig, host: str) -> NixlOptions:
        return cls(env=tuple(LOOPBACK_UCX_ENV.items()) if host in LOOPBACK_HOSTS else ())


@dataclass(frozen=True)
class LocalOptions(BackendOptions):
    """dsakv.disagg.transfer.backends.local.LocalBackend's options (same-process copies: none from a role)."""


BACKEND_OPTIONS: dict[str, type[BackendOptions]] = {
    "mooncake": MooncakeOptions,
    "nixl": NixlOptions,
    "local": LocalOptions,
}


@dataclass(frozen=True)
class TransferConfig:
    """KV transfer and control plane of the disaggregated roles."""

    backend: str = DEFAULT_BACKEND  # a TRANSFER_BACKENDS name
    mooncake_timeout: int | None = None  # MC_TRANSFER_TIMEOUT (s)
    rpc_timeout: float = 5.0  # bound on every control-plane call
    debug_transfer_delay: float = 0.0  # testing: hold each transfer this long before submitting it
    staging_size: int = 256 << 20  # prefill: staging buffer for fragmented sources; decode: its staging slots' region
    # (bytes, capped at the pool; 0: off)
    staging_slots: int = 4  # decode: destination staging slots the region is split into (0: none)

    def staging_bytes(self, pool_nbytes: int) -> int:
        """The staging buffer / slot region a role with a pool of `pool_nbytes` allocates: staging_size, capped at
        the pool (a request's pages never exceed it)."""
        return min(self.staging_size, pool_nbytes)

    debug_transfer_strategy: str = ""  # testing: "blocks" / "staged" overrides the measured rule ("": the rule)

    def backend_options(self, host: str) -> BackendOptions:
        """The options of this branch's backend for a role process at `host` (BACKEND_OPTIONS; a backend not in
        it: none)."""
        return BACKEND_OPTIONS.get(self.backend, BackendOptions).of(self, host)

    def check_options(self, options: BackendOptions) -> None:
        """ConfigError unless `options` are this branch's backend's (or none)."""
        want = BACKEND_OPTIONS.get(self.backend, BackendOptions)
        if type(options) not in (BackendOptions, want):
            raise ConfigError(
                f"backend options {type(options).__name__} are not transfer backend {self.backend!r}'s: give "
                f"{want.__name__} (TransferConfig.backend_options(host) builds them)"
            )
