"""The role branches of the configuration tree (dsakv.config): each disaggregated role's config is the tree (for
the workers) plus where the process runs plus its own options.

    PrefillConfig   model, config (the tree: engine, transfer, pipeline), host, port, name, decode peers
    DecodeConfig    model, config (the tree: its pipeline when pp_size > 1), host, port, name, kv_grace /
                    liveness / max_kv_timeout, tp
    RouterConfig    prefill / decode addresses, the router's time bounds, affinity, vocab_size

Each hands its code one `Timeouts` (`cfg.timeouts`, dsakv.config.timeouts). `prefill_cache_error` is the
prefill role's rule on the tree's cache branch (the prefix cache and host tier on every stage, the storage tier
on one stage only, no disk tier), with the refusal texts the CLI gives too. Imports only errors, spec and the
rest of dsakv.config (no torch): a router or a CLI check builds these without the engine.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from dsakv.config.engine import CacheConfig, EngineConfig
from dsakv.config.parallel import PipelineConfig, split_layers
from dsakv.config.timeouts import MAX_KV_TIMEOUT, MAX_WAIT, Timeouts
from dsakv.config.transfer import BackendOptions
from dsakv.config.tree import Config
from dsakv.errors import ConfigError
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec


def storage_pp_error(backend: str, pp_size: int) -> str:
    """The one-line refusal of a storage tier on a prefill pipeline of more than one stage."""
    return (
        f"--hicache-storage {backend} with --pp-size {pp_size}: only a single-stage prefill can use the storage "
        "tier (later stages would need their own L3 loads); use --pp-size 1 or drop --hicache-storage"
    )


def disk_tier_refusal(flags: Sequence[str]) -> str:
    """The refusal of the local disk tier on a prefill worker (`flags`: the options that asked for it)."""
    return (
        f"--role prefill does not support {', '.join(flags)} (the local disk tier of the prefix cache) yet: "
        "use --prefix-cache, optionally with --hicache-ratio or --hicache-size (host tier), and with "
        "--pp-size 1 --hicache-storage mooncake (the shared storage tier)"
    )


def prefill_cache_error(cache: CacheConfig, pp_size: int) -> str | None:
    """Why a prefill worker of `pp_size` stages cannot run this cache branch (None: it can). A prefill runs the
    prefix cache and host tier on every stage, the storage tier with one stage only, and no disk tier."""
    disk = [
        flag
        for flag, val in (("--hicache-disk-dir", cache.disk_dir), ("--hicache-disk-size", cache.disk_size))
        if val is not None
    ]
    if disk:
        return disk_tier_refusal(disk)
    if cache.storage is not None and pp_size > 1:
        return storage_pp_error(cache.storage.backend, pp_size)
    return None


def dp_prefill_tier_refusal() -> str:
    """The refusal of a host or storage tier on a prefill with DP attention (prefill/dp.py)."""
    return (
        "--enable-dp-attention with --role prefill and a host or storage tier (--hicache-ratio / --hicache-size / "
        "--hicache-storage) is not supported yet: the device prefix cache (--prefix-cache) works"
    )


@dataclass(frozen=True)
class PrefillConfig:
    """One stage of a prefill worker: the configuration tree and where this process runs. Stage k listens for
    control RPC on port + k. From the tree: `engine` (layout, pool, scheduler, cache: the prefix cache and host
    tier, with pp_size 1 also the storage tier; no disk tier), `transfer` (backend, rpc timeout, debug delay),
    `pipeline` (pp_size, pp_rank, partition, rendezvous, stage timeout)."""

    model: str
    config: Config = field(default_factory=Config)
    host: str = "127.0.0.1"
    port: int = 0  # base port (stage k: port + k); 0 = any free port (pp_size 1 only)
    name: str | None = None  # worker name; default prefill@<stage0 host>:<port>
    decode: tuple[str, ...] = ()  # decode workers to handshake with at startup (fail loudly if refused)
    backend_options: BackendOptions = field(default_factory=BackendOptions)  # TransferConfig.backend_options(host)
    debug_fail_transfer: tuple[int, int] | None = None  # testing: (decode stage j, n): the n-th transfer to j fails
    tp_size: int = 1  # --tp-size T > 1: this process is TP rank 0 of the stage (prefill/ranks.py), ranks 1..T-1 its
    rank_argv: tuple[str, ...] = ()  # children; the `dsakv` arguments the rank processes re-run (this argv)
    dp_size: int = 1  # --dp-size D > 1 with --enable-dp-attention: D DP ranks (prefill/dp.py), tp_size == D
    dp_rank: int = 0  # this process's DP rank (RPC: --port + dp_rank; with --pp-size P, + dp_rank (P + 1), dp_pp.py)

    def __post_init__(self) -> None:
        pipe, rpc = self.pipeline, self.config.transfer.rpc_timeout  # the pipeline validated itself (rank, timeout)
        if not 1 <= self.tp_size <= 256:
            raise ConfigError(f"--tp-size {self.tp_size} must be within 1-256 (tensor-parallel ranks of the prefill)")
        if self.dp_size > 1:
            self._check_dp()
        elif self.tp_size > 1:
            if self.draft_layers:
                raise ConfigError(
                    f"--tp-size {self.tp_size} with --role prefill and MTP (--speculative-num-steps) is not supported "
                    "yet: leave one of them out"
                )
            cache = self.engine.cache
            if cache.host_tier or cache.storage is not None:
                raise ConfigError(
                    f"--tp-size {self.tp_size} with --role prefill and a host or storage tier (--hicache-ratio / "
                    "--hicache-size / --hicache-storage) is not supported yet: the device prefix cache works"
                )
        if self.port == 0 and pipe.pp_size > 1:
            raise ConfigError("a pipeline of more than one stage needs an explicit --port (stage k uses port + k)")
        if rpc <= 0:
            raise ConfigError(f"--rpc-timeout {rpc} must be > 0 seconds")
        num_pages = self.engine.pool.num_pages
        if num_pages is not None and num_pages < 1:
            raise ConfigError(f"--num-pages {num_pages} must be >= 1")
        refusal = prefill_cache_error(self.engine.cache, pipe.pp_size)
        if refusal is not None:
            raise ConfigError(refusal)
        self.config.transfer.check_options(self.backend_options)

    def _check_dp(self) -> None:
        """DP attention on the prefill (prefill/dp.py; with --pp-size, prefill/dp_pp.py): attention TP 1 per rank,
        no MTP, no host or storage tier (each refused by name)."""
        dp = self.dp_size
        if self.tp_size != dp or not 0 <= self.dp_rank < dp:
            raise ConfigError(
                f"--dp-size {dp} (DP rank {self.dp_rank}) with --tp-size {self.tp_size}: DP attention runs attention "
                f"TP 1, give --tp-size {dp}"
            )
        if self.draft_layers:
            raise ConfigError(
                "--enable-dp-attention with --role prefill and MTP (--speculative-num-steps) is not supported yet: "
                "leave one of them out (a TP 1 prefill feeds an MTP decode)"
            )
        cache = self.engine.cache
        if cache.host_tier or cache.storage is not None:
            raise ConfigError(dp_prefill_tier_refusal())

    @property
    def engine(self) -> EngineConfig:
        return self.config.engine

    @property
    def attention_tp(self) -> int:
        """Attention-TP ranks of a stage (their pools share each key): --tp-size, or 1 with DP attention (each DP
        rank holds the whole KV of its own requests)."""
        return 1 if self.dp_size > 1 else self.tp_size

    @property
    def draft_layers(self) -> int:
        """Draft (MTP) layers on the last stage: 1 when the decode speculates (it reuses one layer K times); the
        last stage computes the draft layer's KV / INDEX_K for the prompt and sends it with its other keys."""
        return self.engine.draft_layers

    @property
    def pipeline(self) -> PipelineConfig:
        return self.config.pipeline

    @property
    def pp_rank(self) -> int:
        return self.pipeline.rank

    @property
    def pp_size(self) -> int:
        return self.pipeline.pp_size

    def ranges(self, spec: ModelSpec) -> list[tuple[int, int]]:
        """[start, end) of every stage's layers."""
        return split_layers(spec.num_layers, self.pp_size, self.pipeline.partition)

    def layouts(self, spec: ModelSpec) -> list[KVLayout]:
        """Every stage's KVLayout: its layer range, and on the last stage with MTP the draft layer's keys."""
        ranges = self.ranges(spec)
        drafts = [0] * (len(ranges) - 1) + [self.draft_layers]
        return [self.engine.layout.layout(spec, a, b, draft_layers=d) for (a, b), d in zip(ranges, drafts, strict=True)]

    def num_pages(self, spec: ModelSpec) -> int:
        """Pages of every stage's pool (the same on all: stage 0 decides page ids); with a KV budget, the planner's
        figure for the stage that holds the most per token."""
        return self.engine.pool.pages(self.layouts(spec))

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        return Timeouts.of(self.config.transfer.rpc_timeout, stage=self.pipeline.stage_timeout)

    @property
    def worker_name(self) -> str:
        return self.name or f"prefill@{self.pipeline.stage0_host or self.host}:{self.port}"


@dataclass(frozen=True)
class DecodeConfig:
    """A decode worker: the configuration tree (its engine branch is the Engine's; transfer: backend and rpc
    timeout) and where this process runs."""

    model: str
    config: Config = field(default_factory=Config)
    host: str = "127.0.0.1"
    port: int = 0
    name: str | None = None
    backend_options: BackendOptions = field(default_factory=BackendOptions)  # TransferConfig.backend_options(host)
    kv_grace: float = 1.0  # wait this long past a request's prefill deadline before failing it
    liveness_interval: float = 0.5  # ping the prefill stages requests wait for this often
    max_kv_timeout: float = 120.0  # the longest kv_timeout a prealloc may ask for: bounds how long pages wait for KV
    tp_size: int = 1  # --tp-size T > 1: this process is TP rank 0 (decode/ranks.py) and starts ranks 1..T-1
    rank_argv: tuple[str, ...] = ()  # the `dsakv` arguments the rank processes re-run (this process's argv)
    dp_size: int = 1  # --dp-size D > 1 with --enable-dp-attention: D DP ranks (decode/dp.py), tp_size == D
    dp_rank: int = 0  # this process's DP rank (its RPC port: the instance's --port + dp_rank)

    def __post_init__(self) -> None:
        self.config.transfer.check_options(self.backend_options)
        if self.dp_size > 1 and (self.tp_size != self.dp_size or not 0 <= self.dp_rank < self.dp_size):
            raise ConfigError(
                f"--dp-size {self.dp_size} (DP rank {self.dp_rank}) with --tp-size {self.tp_size}: DP attention runs "
                f"attention TP 1, give --tp-size {self.dp_size}"
            )
        if not 0 < self.max_kv_timeout <= MAX_KV_TIMEOUT:
            raise ConfigError(
                f"--max-kv-timeout {self.max_kv_timeout} must be in (0, {MAX_KV_TIMEOUT:g}] seconds (the longest a "
                "request's pages wait for their KV), e.g. 120"
            )

    @property
    def pipeline(self) -> PipelineConfig | None:
        """The tree's one pipeline config when the decode is pipelined (--pp-size > 1: this process is stage
        `pipeline.rank`, decode/stage*.py), else None."""
        return self.config.pipeline if self.config.pipeline.pp_size > 1 else None

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        return Timeouts.of(
            self.config.transfer.rpc_timeout,
            kv_grace=self.kv_grace,
            liveness_interval=self.liveness_interval,
            max_kv=self.max_kv_timeout,
        )


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    kv_timeout: float = 30.0  # prefill + KV transfer of one request, from dispatch
    rpc_timeout: float = 5.0
    health_interval: float = 0.5
    queue_timeout: float = 60.0  # how long a request may wait for a free pair / decode pages
    poll_wait: float = 0.5
    connect_retry: float = 2.0  # seconds between handshake attempts of a pair that failed
    max_prompt_tokens: int | None = None
    seed: int | None = None
    affinity_min_gain_pages: int = 1  # prefix affinity only when it saves >= this many pages (routing.py)
    affinity_max_imbalance: int = 4  # ... and the affine prefill has <= this many more requests in flight
    vocab_size: int | None = None  # token ids are below it (--model); None: the decodes' health reports it

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        return Timeouts.of(
            self.rpc_timeout,
            kv=self.kv_timeout,
            queue=self.queue_timeout,
            health_interval=self.health_interval,
            poll_wait=self.poll_wait,
            connect_retry=self.connect_retry,
        )

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError(
                f"a router needs at least one prefill and one decode worker (got prefill={list(self.prefill)}, "
                f"decode={list(self.decode)}): pass --prefill HOST:PORT and --decode HOST:PORT"
            )
        for name, hi in (
            ("kv_timeout", MAX_KV_TIMEOUT),
            ("rpc_timeout", MAX_WAIT),
            ("queue_timeout", 86400.0),
            ("health_interval", MAX_WAIT),
            ("poll_wait", MAX_WAIT),
            ("connect_retry", MAX_WAIT),
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= hi:
                flag = "--" + name.replace("_", "-")
                raise ConfigError(f"{name} = {v!r} ({flag}) must be a number of seconds in (0, {hi:g}]")
        if self.affinity_min_gain_pages < 1:
            raise ConfigError(
                f"affinity_min_gain_pages = {self.affinity_min_gain_pages} must be >= 1 page "
                "(--affinity-min-gain-pages; a large value routes prefill by load only)"
            )
        if self.affinity_max_imbalance < 0:
            raise ConfigError(f"affinity_max_imbalance = {self.affinity_max_imbalance} must be >= 0 requests")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ConfigError(f"vocab_size = {self.vocab_size!r} must be a positive number of token ids")
