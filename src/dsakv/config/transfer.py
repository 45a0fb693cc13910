"""The transfer branch of the configuration tree (dsakv.config): the KV transfer backend and the control-plane
bounds of the disaggregated roles. Standard library only.

TRANSFER_BACKENDS names every backend as "module:Class" (dsakv.disagg.transfer.backends.registry imports a
backend's module on first use), so the command line's --transfer-backend choices (BACKEND_CHOICES) and a config
check know the names without importing a backend or its engine.
"""

from __future__ import annotations

from dataclasses import dataclass

_BACKENDS_PKG = "dsakv.disagg.transfer.backends"
TRANSFER_BACKENDS: dict[str, str] = {
    "mooncake": f"{_BACKENDS_PKG}.mooncake:MooncakeBackend",
    "nixl": f"{_BACKENDS_PKG}.nixl:NixlBackend",
    "local": f"{_BACKENDS_PKG}.local:LocalBackend",
}
BACKEND_CHOICES: tuple[str, ...] = tuple(TRANSFER_BACKENDS)
DEFAULT_BACKEND = "mooncake"


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
