"""The configuration tree: every option a process of dsakv runs with, as frozen dataclasses, built once.

    Config (tree.py)
    ├── engine: EngineConfig (engine.py)  what an Engine (colocated, decode) or a prefill stage runs with
    │   ├── layout: LayoutConfig      elide, kv_format, index_format, page_size  -> KVLayout per layer range
    │   ├── pool: PoolConfig          num_pages | max_tokens | kv_budget          -> pages (planner's figure)
    │   ├── scheduler: SchedulerConfig  max_batch_tokens, max_running_requests
    │   ├── cache: CacheConfig        prefix cache + host tier + disk tier        -> HiCacheConfig (cache/hicache)
    │   │   └── storage: StorageConfig  the storage (L3) tier                     -> cache/storage backends
    │   ├── hisparse: HiSparseConfig  HiSparse decode: hot KV rows on the device, KV on the host
    │   └── dtype, seed, speculative_num_steps (MTP speculative decoding; 0 = off)
    ├── transfer: TransferConfig (transfer.py)  KV transfer backend and control-plane bounds (disaggregated roles);
    │                                 the backends by name (lazy) and each one's typed options (BackendOptions)
    └── pipeline: PipelineConfig (parallel.py)  PP: stages, partition, rendezvous, stage timeout; split_layers

    roles.py     PrefillConfig / DecodeConfig = the tree + where the process runs + the role's options;
                 RouterConfig (addresses, time bounds, affinity); prefill_cache_error (the prefill's
                 cache rule and its --role prefill refusals)
    timeouts.py  Timeouts: every time bound of disaggregated serving (`cfg.timeouts` of each role);
                 MAX_KV_TIMEOUT, MAX_WAIT

`dsakv.cli.options` builds the tree from argv (`serve`, `generate`, `demo` and the benches share it) and
`dsakv.engine.argv` renders it back to argv for child processes. The layer sits between plan and cache: it
imports only util, errors, spec and plan (no torch), so building a tree stays light.
"""

from dsakv.config.engine import (
    DEFAULT_MAX_TOKENS,
    DTYPES,
    WEIGHT_DTYPES,
    CacheConfig,
    EngineConfig,
    HiSparseConfig,
    LayoutConfig,
    PoolConfig,
    SchedulerConfig,
    StorageConfig,
)
from dsakv.config.parallel import PipelineConfig, split_layers
from dsakv.config.roles import (
    DecodeConfig,
    PrefillConfig,
    RouterConfig,
    disk_tier_refusal,
    dp_prefill_tier_refusal,
    prefill_cache_error,
    storage_pp_error,
)
from dsakv.config.timeouts import MAX_KV_TIMEOUT, MAX_WAIT, Timeouts
from dsakv.config.transfer import (
    BACKEND_CHOICES,
    BACKEND_OPTIONS,
    DEFAULT_BACKEND,
    LOOPBACK_UCX_ENV,
    TRANSFER_BACKENDS,
    BackendOptions,
    LocalOptions,
    MooncakeOptions,
    NixlOptions,
    TransferConfig,
)
from dsakv.config.tree import Config

__all__ = [
    "BACKEND_CHOICES",
    "BACKEND_OPTIONS",
    "DEFAULT_BACKEND",
    "LOOPBACK_UCX_ENV",
    "TRANSFER_BACKENDS",
    "DEFAULT_MAX_TOKENS",
    "DTYPES",
    "MAX_KV_TIMEOUT",
    "MAX_WAIT",
    "WEIGHT_DTYPES",
    "BackendOptions",
    "CacheConfig",
    "Config",
    "DecodeConfig",
    "EngineConfig",
    "HiSparseConfig",
    "LayoutConfig",
    "LocalOptions",
    "MooncakeOptions",
    "NixlOptions",
    "PipelineConfig",
    "PoolConfig",
    "PrefillConfig",
    "RouterConfig",
    "SchedulerConfig",
    "StorageConfig",
    "Timeouts",
    "TransferConfig",
    "disk_tier_refusal",
    "dp_prefill_tier_refusal",
    "prefill_cache_error",
    "split_layers",
    "storage_pp_error",
]
