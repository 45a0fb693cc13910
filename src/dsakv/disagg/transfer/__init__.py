"""Disaggregated serving support: the KV transfer layer (manifest, handshake check, plan, backends).

    Manifest.from_pool(pool, backend.meta())   what a worker exposes, per BufferKey
    check_pair(sender, receiver) / pair(...)   handshake: key pairs, one-sided index-K skipped, else refused
    TransferPlan.build(pairs, src, dst)        page runs -> (src, dst, length) blocks, numpy
    make_backend("mooncake" | "nixl" | "local") register / meta / connect / submit / poll / wait

The transfer layer (manifest, compat, transfer_plan, backends, errors) imports only spec and cache. The
serving roles built on it import dsakv.engine as well: the control plane (messages, lifecycle, wire, router*:
engine.request / engine.backend, standard library only, no torch) and the workers (prefill_leader: an Engine;
prefill_follower: engine.sampling, model_runner.logits_at, read_eos_token_ids; decode_worker: an Engine).
Nothing in disagg imports serve or cli.

Serving roles (see docs/architecture.md "disagg: serving roles" for the RPC graph):
    messages / codec / rpc          typed control plane: message dataclasses, one codec, service specs
    lifecycle / timeouts            per-request state machines and ledgers; every time bound
    worker_service                  RPC service + liveness/health/integrity + threads of every worker
    prefill_worker                  PrefillStage: StageContext + make_role(PipelineLeader | PrefillFollower)
                                    + KvSender (kv_sender)
    decode_worker                   DecodeWorker: decode_outputs (DecodeOutputs), liveness (stage pings)
    router                          RouterBackend: router_peers (PeerTable), router_requests (RequestBook),
                                    router_dispatch (Dispatcher), router_events (EventPoller)
"""

from dsakv.disagg.protocol.errors import (
    IncompatiblePeer,
    ManifestError,
    RegistrationError,
    TransferError,
    TransferTimeout,
)
from dsakv.disagg.transfer.backends import (
    BACKENDS,
    Peer,
    TransferBackend,
    TransferHandle,
    TransferStatus,
    backend_names,
    deadline_in,
    make_backend,
)
from dsakv.disagg.transfer.compat import KeyPair, Pairing, SkippedKey, check_pair, pair
from dsakv.disagg.transfer.manifest import MANIFEST_VERSION, BackendMeta, Manifest, RegionInfo
from dsakv.disagg.transfer.metrics import TransferMetrics, TransferStats, TransferTotals
from dsakv.disagg.transfer.plan import Blocks, PairTable, TransferPlan, contiguous_runs

__all__ = [
    "BACKENDS",
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
