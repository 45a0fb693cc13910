"""The engine branch of the configuration tree (dsakv.config): what an Engine (colocated, decode) or a prefill
stage runs with, as frozen dataclasses.

    EngineConfig
    ├── layout: LayoutConfig      elide, kv_format, index_format, page_size  -> KVLayout per layer range
    ├── pool: PoolConfig          num_pages | max_tokens | kv_budget          -> pages (planner's figure)
    ├── scheduler: SchedulerConfig  max_batch_tokens, max_running_requests
    ├── cache: CacheConfig        prefix cache + host tier + disk tier        -> HiCacheConfig (cache/hicache)
    │   └── storage: StorageConfig  the storage (L3) tier's backend options  -> cache/storage backends
    ├── hisparse: HiSparseConfig  HiSparse decode: hot KV rows on the device, KV on the host
    └── dtype, seed, speculative_num_steps (MTP speculative decoding; 0 = off)

`Engine(model, config)` takes this branch (`EngineConfig()`: every default); the CLI and dsakv.LLM build it from
their flags (cli/options.py), the tests from flat keywords (dsakv.testing.config.engine_config). Which cache
branches a prefill worker can run is the prefill role's rule (config/roles.py). Imports only util, errors, spec
and plan (no torch), so building a tree stays light.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from dsakv.errors import ConfigError
from dsakv.spec.layout import DEFAULT_PAGE_SIZE, KVLayout
from dsakv.util import ceil_div

if TYPE_CHECKING:
    from dsakv.spec.model import ModelSpec

DEFAULT_MAX_TOKENS = 16384
DTYPES = ("float32", "bfloat16")
WEIGHT_DTYPES = ("model", "int8", "fp8")  # dsakv.model.quant.WEIGHT_DTYPES


@dataclass(frozen=True)
class LayoutConfig:
    """What a pool stores per token: index-K elision and the row formats, in pages of `page_size` tokens."""

    elide: bool = True
    kv_format: str = "fp32"
    index_format: str = "fp32"
    page_size: int = DEFAULT_PAGE_SIZE

    def layout(
        self, spec: ModelSpec, layer_start: int = 0, layer_end: int | None = None, draft_layers: int = 0
    ) -> KVLayout:
        """The KVLayout of the main layers [layer_start, layer_end) (all of them by default), plus `draft_layers`
        MTP draft layers (1 when the engine speculates)."""
        return KVLayout(
            spec,
            layer_start=layer_start,
            layer_end=layer_end,
            elide=self.elide,
            kv_format=self.kv_format,
            index_format=self.index_format,
            page_size=self.page_size,
            draft_layers=draft_layers,
        )


@dataclass(frozen=True)
class PoolConfig:
    """Device pool size: at most one of `num_pages`, `max_tokens` or `kv_budget` (bytes; pages as the planner
    sizes a pool, floored to whole pages). None of them: DEFAULT_MAX_TOKENS tokens."""

    num_pages: int | None = None
    max_tokens: int | None = None
    kv_budget: int | None = None

    def __post_init__(self) -> None:
        if self.num_pages is not None and self.max_tokens is not None:
            raise ConfigError(f"give num_pages ({self.num_pages}) or max_tokens ({self.max_tokens}), not both")
        if self.kv_budget is not None and (self.num_pages is not None or self.max_tokens is not None):
            raise ConfigError(
                f"give kv_budget ({self.kv_budget} B) or num_pages / max_tokens, not both (--kv-budget sizes the "
                "pool as the planner does)"
            )

    def pages_given(self, layouts: Sequence[KVLayout]) -> int | None:
        """Pages the options name, or None when none was given. With `kv_budget`, every layout (one per PP stage)
        gets the same count: the minimum over them of the planner's figure."""
        if self.kv_budget is not None:
            from dsakv.plan.capacity import max_total_num_tokens

            return min(max_total_num_tokens(self.kv_budget, lay) // lay.page_size for lay in layouts)
        if self.num_pages is not None:
            return self.num_pages
        if self.max_tokens is not None:
            return self.pages_for_tokens(self.max_tokens, layouts[0].page_size)
        return None

    def pages(self, layouts: Sequence[KVLayout]) -> int:
        """Pages of the pool: `pages_given`, else enough for DEFAULT_MAX_TOKENS."""
        given = self.pages_given(layouts)
        return self.pages_for_tokens(DEFAULT_MAX_TOKENS, layouts[0].page_size) if given is None else given

    @staticmethod
    def pages_for_tokens(tokens: int, page_size: int) -> int:
        if tokens < 1:
            raise ConfigError(f"max_tokens = {tokens} must be >= 1")
        return ceil_div(tokens, page_size)


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch_tokens: int = 512  # tokens per step (the chunked-prefill budget)
    max_running_requests: int | None = None  # requests per batch (None: the scheduler's default)


@dataclass(frozen=True)
class StorageConfig:
    """Options of a storage backend. `backend` names it in STORAGE_BACKENDS."""

    backend: str = "file"
    dir: str | None = None  # file: the directory
    max_bytes: int | None = None  # file: cap on page files (LRU eviction); None = unbounded
    master: str | None = None  # mooncake: master address HOST:PORT
    metadata: str | None = None  # mooncake: metadata server URL (default http://HOST:PORT+1/metadata)
    segment_bytes: int = 0  # mooncake: memory this instance adds to the store (0: objects live elsewhere)
    local_buffer_bytes: int = 16 << 20  # mooncake: the client's own transfer buffer
    protocol: str = "tcp"  # mooncake: tcp | rdma
    device_names: str = ""  # mooncake: RDMA devices
    local_hostname: str = "127.0.0.1"  # mooncake: the address this client's transfer engine listens on
    timeout: float = 2.0  # seconds one store operation may take before the request computes instead
    secret_file: str | None = None  # mooncake: the secret keying page MACs (None: $DSAKV_CLUSTER_SECRET_FILE)
    extra: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.timeout > 0 or self.timeout != self.timeout or self.timeout == float("inf"):
            raise ConfigError(f"storage timeout = {self.timeout} s must be a finite number > 0")
        if self.backend == "file" and not self.dir:
            raise ConfigError("storage backend 'file' needs a directory (--hicache-disk-dir DIR)")
        if self.backend == "mooncake" and not self.master:
            raise ConfigError(
                "storage backend 'mooncake' needs a master address (--mooncake-master HOST:PORT); "
                "start one with `dsakv store-master`"
            )
        if self.max_bytes is not None and self.max_bytes <= 0:
            raise ConfigError(f"storage size cap = {self.max_bytes} bytes must be > 0 (or no cap)")
        if self.segment_bytes < 0 or self.local_buffer_bytes < 0:
            raise ConfigError(
                f"mooncake segment {self.segment_bytes} B / local buffer {self.local_buffer_bytes} B must be >= 0"
            )


@dataclass(frozen=True)
class CacheConfig:
    """Prefix cache (`prefix_cache`) and its host / disk tiers; any tier option turns the cache on.

    The cache layer's HiCacheConfig (cache/hicache/config.py) is this branch plus what only the built cache knows
    (the weights fingerprint, host-pool pinning): its fields are declared here, once, and checked there, once,
    when the cache is built (the host layouts and write policies are the cache layer's registries)."""

    prefix_cache: bool = False
    hicache_ratio: float | None = None  # host pool = ratio x device pool bytes
    hicache_size: int | None = None  # or host pool bytes
    layout: str = "layer_first"  # host layout: layer_first | page_first (dsakv.cache.host_pool.HOST_LAYOUTS)
    # write_through | write_back | write_through_selective (dsakv.cache.write_policy.WRITE_POLICIES)
    write_policy: str = "write_through"
    selective_threshold: int = 2  # hits before write_through_selective backs a run up
    disk_dir: str | None = None  # third tier on local disk; None = off
    disk_size: int | None = None  # disk tier cap in bytes (page files, headers included); None = unbounded
    storage: StorageConfig | None = None  # the mooncake storage (L3) tier (the file tier is disk_dir)

    @property
    def host_tier(self) -> bool:
        return self.hicache_ratio is not None or self.hicache_size is not None

    @property
    def enabled(self) -> bool:
        return self.prefix_cache or self.host_tier or bool(self.disk_dir) or self.storage is not None

    @property
    def storage_config(self) -> StorageConfig | None:
        """The L3 tier: the storage given, else the disk tier's directory as a `file` storage, else none."""
        if self.storage is not None:
            return self.storage
        if self.disk_dir:
            return StorageConfig(backend="file", dir=self.disk_dir, max_bytes=self.disk_size)
        return None


@dataclass(frozen=True)
class HiSparseConfig:
    """HiSparse decode (dsakv.cache.hisparse): index-K of every token and a hot buffer of `device_buffer_size` KV
    rows per layer per request (+ one page for the newest tokens) on the device, the MLA KV of every token on the
    host. The pool options then size the logical pool: `kv_budget` is the device budget (the planner's
    --hisparse-ratio figures), `num_pages` / `max_tokens` the logical tokens, of which 1 / host_to_device_ratio
    are hot rows on the device."""

    enabled: bool = False
    top_k: int | None = None  # rows each query selects: the model's index_topk (checked against it)
    device_buffer_size: int | None = None  # hot rows per layer per request (None: 2 x top_k)
    host_to_device_ratio: float = 4.0  # logical tokens / device hot rows

    def __post_init__(self) -> None:
        from dsakv.plan.hisparse import check_buffer_size, check_ratio

        check_ratio(self.host_to_device_ratio)
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int)):
            raise ConfigError(f"hisparse top_k = {self.top_k!r} must be an integer (the model's index_topk)")
        check_buffer_size(self.device_buffer_size)

    def buffer_for(self, index_topk: int) -> int:
        """device_buffer_size for a model whose indexer selects `index_topk` rows (checked: top_k, >= top_k)."""
        if self.top_k is not None and self.top_k != index_topk:
            raise ConfigError(
                f"--hisparse-top-k {self.top_k} differs from the model's index_topk {index_topk}: every query selects "
                f"index_topk rows; leave --hisparse-top-k out or pass {index_topk}"
            )
        size = self.device_buffer_size if self.device_buffer_size is not None else 2 * index_topk
        if size < index_topk:
            raise ConfigError(
                f"--hisparse-device-buffer-size {size} is smaller than the top-k {index_topk}: one query's selected "
                f"rows must fit the buffer; pass at least {index_topk}"
            )
        return size

    def sizing(self, layout: KVLayout, pool: PoolConfig) -> tuple[int, int, int]:
        """(logical pages, hot request buffers, device_buffer_size) of a HiSparse pool of `layout`.

        kv_budget: the planner's figures (dsakv.plan.hisparse.hisparse_figures) for that device budget. Otherwise
        the logical tokens of num_pages / max_tokens (default DEFAULT_MAX_TOKENS), with device hot rows =
        floor(logical / host_to_device_ratio) cut into whole request buffers (at least one)."""
        from dsakv.plan.hisparse import hisparse_figures, hot_rows_per_request

        buf = self.buffer_for(layout.spec.index_topk)
        page = layout.page_size
        if pool.kv_budget is not None:
            fig = hisparse_figures(pool.kv_budget, layout, self.host_to_device_ratio, buf)
            if not fig.max_requests:
                raise ConfigError(
                    f"kv_budget {pool.kv_budget} B gives {fig.device_tokens} hot rows, less than one request buffer "
                    f"of {hot_rows_per_request(buf, page)} rows: raise --kv-budget or lower "
                    "--hisparse-device-buffer-size"
                )
            return fig.logical_tokens // page, fig.max_requests, buf
        pages = pool.pages([layout])
        hot = int(pages * page / self.host_to_device_ratio)
        return pages, max(1, hot // hot_rows_per_request(buf, page)), buf


@dataclass(frozen=True)
class EngineConfig:
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    pool: PoolConfig = field(default_factory=PoolConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    hisparse: HiSparseConfig = field(default_factory=HiSparseConfig)
    dtype: str = "float32"  # weights: float32 | bfloat16
    weight_dtype: str = "model"  # projection weights on a quantised grid: model (as loaded) | int8 | fp8
    int8_gemv: bool = False  # int8 weights: small-batch matmuls on the compiled int8 GEMV (model/quant.py)
    compile_decode: bool = False  # float weights: 1-2 row matmuls on the compiled GEMV (model/gemv.py, --compile)
    seed: int | None = None  # seed for requests that give none
    speculative_num_steps: int = 0  # MTP speculative decoding: drafts verified per step (0 = off)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} is unknown: use one of {', '.join(DTYPES)}")
        if self.weight_dtype not in WEIGHT_DTYPES:
            raise ConfigError(f"weight_dtype {self.weight_dtype!r} is unknown: use one of {', '.join(WEIGHT_DTYPES)}")
        if self.int8_gemv and self.weight_dtype != "int8":
            raise ConfigError(
                f"int8_gemv needs int8 weights, but weight_dtype is {self.weight_dtype!r}: add --weight-dtype int8 "
                "or drop --int8-gemv"
            )
        k = self.speculative_num_steps
        if isinstance(k, bool) or not isinstance(k, int):
            raise ConfigError(f"speculative_num_steps = {k!r} must be an integer >= 0")
        if k < 0:
            raise ConfigError(f"speculative_num_steps = {k} must be >= 0 (0 = no speculation)")

    @property
    def draft_layers(self) -> int:
        """MTP draft layers the pool holds: 1 when the engine speculates (its layout's `draft_layers`)."""
        return 1 if self.speculative_num_steps else 0
