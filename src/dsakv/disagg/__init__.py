"""Disaggregated serving support: the KV transfer layer (manifest, handshake check, plan, backends).

    Manifest.from_pool(pool, backend.meta())   what a worker exposes, per BufferKey
    check_pair(sender, receiver) / pair(...)   handshake: key pairs, one-sided index-K skipped, else refused
    TransferPlan.build(pairs, src, dst)        page runs -> (src, dst, length) blocks, numpy
    make_backend("mooncake" | "nixl" | "local") register / meta / connect / submit / poll / wait

May import spec and cache; never engine or serve. See /work/notes/transfer_api.md.
"""

from dsakv.disagg.backends import (
    BACKENDS,
    DEFAULT_BACKEND,
    LOOPBACK_UCX_ENV,
    Peer,
    TransferBackend,
    TransferHandle,
    TransferStatus,
    backend_names,
    deadline_in,
    make_backend,
)
from dsakv.disagg.compat import KeyPair, Pairing, SkippedKey, check_pair, pair
from dsakv.disagg.errors import IncompatiblePeer, ManifestError, RegistrationError, TransferError, TransferTimeout
from dsakv.disagg.manifest import MANIFEST_VERSION, BackendMeta, Manifest, RegionInfo
from dsakv.disagg.metrics import TransferMetrics, TransferStats, TransferTotals
from dsakv.disagg.transfer_plan import Blocks, PairTable, TransferPlan, contiguous_runs

__all__ = [
    "BACKENDS",
    "DEFAULT_BACKEND",
    "LOOPBACK_UCX_ENV",
    "MANIFEST_VERSION",
    "BackendMeta",
    "Blocks",
    "IncompatiblePeer",
    "KeyPair",
    "Manifest",
    "ManifestError",
    "PairTable",
    "Pairing",
    "Peer",
    "RegionInfo",
    "RegistrationError",
    "SkippedKey",
    "TransferBackend",
    "TransferError",
    "TransferHandle",
    "TransferMetrics",
    "TransferPlan",
    "TransferStats",
    "TransferStatus",
    "TransferTimeout",
    "TransferTotals",
    "backend_names",
    "check_pair",
    "contiguous_runs",
    "deadline_in",
    "make_backend",
    "pair",
]
