"""The transfer branch of the configuration tree (dsakv.config): the KV transfer backend and the control-plane
bounds of the disaggregated roles. Standard library only.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferConfig:
    """KV transfer and control plane of the disaggregated roles."""

    backend: str = "mooncake"  # dsakv.disagg.transfer.backends registry name
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
