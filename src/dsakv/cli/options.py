"""The command-line spelling of the configuration tree (dsakv.config), shared by `serve`, `generate`,
`demo` and the benches: each option is declared once here, read back into the tree once, and rendered back to
argv for child processes (the demo's workers, the tests' and benches' clusters).

    add_layout_arguments / add_pool_arguments / add_cache_arguments / add_engine_arguments   (argparse groups)
    add_speculative_argument / add_hisparse_arguments                                         (serve, generate)
    add_transfer_arguments / add_pipeline_arguments                                           (serve's roles)
    config_from_args(args) -> Config      engine_config(args) -> EngineConfig     layout_config(args) ...
    engine_argv(EngineConfig) -> ["--page-size", "16", ...]       (the inverse: dsakv.engine.argv, re-exported)

No torch: `dsakv --help` and `dsakv plan` stay light.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from dsakv.config import (
    BACKEND_CHOICES,
    DEFAULT_BACKEND,
    DTYPES,
    WEIGHT_DTYPES,
    CacheConfig,
    Config,
    EngineConfig,
    HiSparseConfig,
    LayoutConfig,
    PipelineConfig,
    PoolConfig,
    SchedulerConfig,
    StorageConfig,
    TransferConfig,
)
from dsakv.engine.argv import engine_argv as engine_argv  # re-exported: the inverse of engine_config
from dsakv.engine.argv import layout_argv as layout_argv
from dsakv.errors import ConfigError
from dsakv.plan.units import parse_size
from dsakv.spec.layout import INDEX_FORMATS, KV_FORMATS

# ---- declaring options ------------------------------------------------------------------------------------------


def add_layout_arguments(
    g: argparse._ActionsContainer, defaults: LayoutConfig = LayoutConfig(), elide: bool = True
) -> None:
    """--elide/--no-elide (unless elide=False: a bench that runs both), --kv-format, --index-format, --page-size."""
    if elide:
        g.add_argument(
            "--elide",
            action=argparse.BooleanOptionalAction,
            default=defaults.elide,
            help="index-K only for producer layers (--no-elide: for shared layers too)",
        )
    kv_note = ", exact" if defaults.kv_format == "fp32" else ""
    g.add_argument(
        "--kv-format",
        choices=KV_FORMATS,
        default=defaults.kv_format,
        help=f"MLA KV row format (default {defaults.kv_format}{kv_note})",
    )
    g.add_argument(
        "--index-format",
        choices=INDEX_FORMATS,
        default=defaults.index_format,
        help=f"index-K format (default {defaults.index_format})",
    )
    g.add_argument("--page-size", type=int, default=defaults.page_size, help=f"tokens per page ({defaults.page_size})")


def add_pool_arguments(g: argparse._ActionsContainer, kv_budget: bool = True) -> None:
    """--kv-budget (optional) | --num-pages | --max-tokens, mutually exclusive."""
    size = g.add_mutually_exclusive_group()
    if kv_budget:
        size.add_argument(
            "--kv-budget", default=None, metavar="SIZE", help="pool bytes, e.g. 64MiB (pages = planner's)"
        )
    size.add_argument("--num-pages", type=int, default=None, help="pool pages")
    size.add_argument("--max-tokens", type=int, default=None, help="pool tokens (default 16384)")


def add_cache_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """--prefix-cache and the --hicache-* options; returns their group (callers may add to it)."""
    hc = p.add_argument_group("prefix cache and host tier (HiCache); any --hicache-* option turns the cache on")
    hc.add_argument("--prefix-cache", action="store_true", help="reuse cached prefixes (device pool only)")
    hc.add_argument("--hicache-ratio", type=float, default=None, help="host tier = ratio x device pool bytes")
    hc.add_argument("--hicache-size", default=None, metavar="SIZE", help="host tier bytes, e.g. 2GiB")
    hc.add_argument("--hicache-layout", default="layer_first", help="host layout: layer_first (default), page_first")
    hc.add_argument(
        "--hicache-write-policy",
        default="write_through",
        help="write_through (default), write_back (offload on eviction), write_through_selective (after N hits)",
    )
    hc.add_argument("--hicache-selective-threshold", type=int, default=2, help="hits before a selective backup")
    hc.add_argument("--hicache-disk-dir", default=None, metavar="DIR", help="disk tier (survives a restart)")
    hc.add_argument(
        "--hicache-disk-size",
        default=None,
        metavar="SIZE",
        help="cap on the disk tier's page files, e.g. 1GiB; least recently used pages are deleted (default: no cap)",
    )
    hc.add_argument(
        "--hicache-storage",
        default=None,
        choices=("file", "mooncake"),
        help="storage (L3) tier: file (page files in --hicache-disk-dir) or mooncake (a Mooncake Store shared by "
        "every instance on one master; needs a host tier and --mooncake-master). Default: file when "
        "--hicache-disk-dir is given, else none",
    )
    hc.add_argument(
        "--mooncake-master",
        default=None,
        metavar="HOST:PORT",
        help="Mooncake master of the storage tier (start one with `dsakv store-master --port PORT`)",
    )
    hc.add_argument(
        "--mooncake-metadata",
        default=None,
        metavar="URL",
        help="its HTTP metadata server (default http://HOST:PORT+1/metadata, as dsakv store-master runs it)",
    )
    hc.add_argument(
        "--mooncake-segment-size",
        default="0",
        metavar="SIZE",
        help="memory this instance adds to the store, e.g. 4GiB (default 0: pages live in the store-master's "
        "memory and outlive this server)",
    )
    hc.add_argument("--mooncake-protocol", default="tcp", help="Mooncake transport: tcp (default) or rdma")
    hc.add_argument("--mooncake-device-names", default="", help="RDMA devices for --mooncake-protocol rdma")
    hc.add_argument(
        "--hicache-storage-secret-file",
        default=None,
        metavar="PATH",
        help="the deployment's secret that keys the shared tier's page MACs (a forged object is refused); "
        "default: --cluster-secret-file, else $DSAKV_CLUSTER_SECRET_FILE. Every server sharing the store needs it",
    )
    hc.add_argument(
        "--hicache-storage-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="longest a storage-tier call may delay a request; past it the request computes instead (default 2)",
    )
    return hc


def add_engine_arguments(
    g: argparse._ActionsContainer,
    defaults: SchedulerConfig = SchedulerConfig(),
    running: bool = True,
    threads: int | None = None,
) -> None:
    """--max-batch-tokens, --max-running-requests (unless running=False), --dtype, --threads."""
    g.add_argument(
        "--max-batch-tokens",
        type=int,
        default=defaults.max_batch_tokens,
        help="tokens per step (chunked prefill budget)",
    )
    if running:
        g.add_argument("--max-running-requests", type=int, default=None, help="requests per batch (default 64)")
    g.add_argument("--dtype", choices=DTYPES, default="float32", help="weights (float32)")
    g.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default="model",
        help="projection weights on a quantised grid: int8 (per output channel) or fp8 (e4m3, 128x128 blocks), "
        "computed in --dtype; model: as loaded (default)",
    )
    g.add_argument(
        "--int8-gemv",
        action="store_true",
        help="with --weight-dtype int8: matmuls of up to 16 rows (decode) read the int8 weights in one "
        "torch.compile'd kernel (compiled on first use) instead of dequantising per call",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="float32 on CPU, decode: small matmuls, attention input, o_proj + MoE (batch 1) compiled (inductor); "
        "attention over the fp32 pool, 5-16 row matmuls on C kernels (model/native); built on first use; off: eager",
    )
    default = "torch's choice" if threads is None else str(threads)
    g.add_argument("--threads", type=int, default=threads, help=f"torch CPU threads (default: {default})")


def add_parallel_arguments(g: argparse._ActionsContainer) -> None:
    """--tp-size T, --dp-size D, --enable-dp-attention, --ep-size E (engine/ranks.py, model/parallel.py)."""
    g.add_argument(
        "--tp-size",
        type=int,
        default=1,
        metavar="T",
        help="tensor-parallel ranks, one process each (torch.distributed on 127.0.0.1): attention heads, dense MLP "
        "and experts split over T, MLA latent KV and index-K replicated on every rank; with --role prefill "
        "--pp-size N every stage has T ranks (the rank grid: each sends its share of its stage's keys), as with a "
        "colocated --pp-size N (default 1)",
    )
    g.add_argument(
        "--dp-size",
        type=int,
        default=1,
        metavar="D",
        help="with --enable-dp-attention: D attention ranks (of the --tp-size ranks), each with its own pool, "
        "scheduler and requests (default 1)",
    )
    g.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="data-parallel attention over --dp-size ranks (generate; serve colocated: rank 0 places each request on "
        "the rank with the fewest in flight; --role decode / prefill: rank r on --port + r; with --pp-size P, stage "
        "s of DP rank d on --port + d P + s (decode) or --port + d (P + 1) + s (prefill))",
    )
    g.add_argument(
        "--ep-size",
        type=int,
        default=1,
        metavar="E",
        help="expert-parallel ranks of the MoE (all-to-all dispatch and combine; with DP attention: = --tp-size)",
    )


def add_speculative_argument(g: argparse._ActionsContainer, note: str = "") -> None:
    """--speculative-num-steps K (EngineConfig.speculative_num_steps); `note` ends its help (what the command adds)."""
    g.add_argument(
        "--speculative-num-steps",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding with the checkpoint's MTP layer reused K times: K drafts verified per step "
        "(default 0 = off); greedy output is unchanged, sampled output keeps the target's distribution; with "
        "--tp-size T the draft layer is sharded like the target layers; with --enable-dp-attention (not on a "
        "prefill role, nor with a decode's --pp-size) each rank holds the whole draft layer for its own "
        "requests" + note,
    )


def add_hisparse_arguments(p: argparse.ArgumentParser, note: str = "") -> None:
    """--hisparse, --hisparse-top-k, --hisparse-device-buffer-size, --hisparse-host-to-device-ratio."""
    d = HiSparseConfig()
    g = p.add_argument_group(
        "HiSparse decode (index-K of every token + a hot buffer of KV rows on the device, all KV on the host)"
    )
    g.add_argument(
        "--hisparse",
        action="store_true",
        help="HiSparse decode: each step copies only the missing top-k rows host -> device per layer; pool options "
        "size the logical pool (--kv-budget: the device budget; --max-tokens / --num-pages: logical tokens); with "
        "--tp-size T each rank its own pool, checked equal every step (not with DP attention, PP, a TP prefill)" + note,
    )
    g.add_argument(
        "--hisparse-top-k",
        type=int,
        default=None,
        metavar="K",
        help="rows each query selects (default and only value: the model's index_topk; checked)",
    )
    g.add_argument(
        "--hisparse-device-buffer-size",
        type=int,
        default=None,
        metavar="ROWS",
        help="hot KV rows per layer per request, >= top-k (default 2 x top-k), plus one page for the newest tokens",
    )
    g.add_argument(
        "--hisparse-host-to-device-ratio",
        type=float,
        default=d.host_to_device_ratio,
        metavar="R",
        help=f"logical tokens per device hot row (default {d.host_to_device_ratio:g})",
    )


def hisparse_config(args: argparse.Namespace) -> HiSparseConfig:
    return HiSparseConfig(
        enabled=bool(getattr(args, "hisparse", False)),
        top_k=getattr(args, "hisparse_top_k", None),
        device_buffer_size=getattr(args, "hisparse_device_buffer_size", None),
        host_to_device_ratio=getattr(args, "hisparse_host_to_device_ratio", HiSparseConfig().host_to_device_ratio),
    )


def add_backend_argument(g: argparse._ActionsContainer) -> None:
    g.add_argument(
        "--transfer-backend",
        choices=BACKEND_CHOICES,
        default=DEFAULT_BACKEND,
        help="KV transfer engine (default mooncake; both peers must use the same)",
    )


def add_transfer_arguments(g: argparse._ActionsContainer) -> None:
    add_backend_argument(g)
    g.add_argument("--rpc-timeout", type=float, default=5.0, help="bound on every control-plane call (default 5 s)")
    g.add_argument(
        "--mooncake-timeout",
        type=int,
        default=None,
        help="mooncake's own per-transfer timeout in seconds (MC_TRANSFER_TIMEOUT, min 5; default 30)",
    )
    g.add_argument(
        "--transfer-staging-size",
        default="256MiB",
        metavar="SIZE",
        help="prefill: a registered staging buffer (capped at the stage's pool) that a request with a fragmented "
        "source is gathered into and sent from in one block per destination run, when the measured rule "
        "(dsakv.disagg.transfer.plan.choose_strategy) says the saved descriptors cost more than the copy; "
        "decode: the registered region (capped at its pool) split into --transfer-staging-slots slots that a "
        "request with fragmented destination pages is written into and then scattered from "
        "(transfer_plan.choose_destination); 0 turns it off (default 256MiB)",
    )
    g.add_argument(
        "--transfer-staging-slots",
        type=int,
        default=4,
        metavar="N",
        help="decode: destination staging slots (requests staged at once; a request that finds none free, or "
        "does not fit one, has its pages written directly); 0 turns destination staging off; not used by a "
        "pipelined decode (--pp-size > 1) (default 4)",
    )
    g.add_argument("--debug-transfer-strategy", choices=("", "blocks", "staged"), default="", help=argparse.SUPPRESS)
    g.add_argument("--debug-transfer-delay", type=float, default=0.0, help=argparse.SUPPRESS)


PP_SIZE_HELP = (
    "pipeline stages, one process each (colocated: this command is stage 0 and starts the others on 127.0.0.1; "
    "prefill / decode: stage k on --port + k); a stage holds only its layers' KV and its producers' index-K; "
    "it combines with --tp-size T (each stage T ranks, T x N processes; generate, serve, a prefill or a decode) or "
    "with --enable-dp-attention (each DP rank a pipeline of its own, each stage's DP ranks its EP group) (default 1)"
)
PP_PARTITION_HELP = "layers per stage, e.g. 5,3,2,2 (default: even split, earlier stages larger)"
STAGE_TIMEOUT_HELP = "bound on every activation send/receive between stages (default 10 s)"


def add_colocated_pipeline_arguments(g: argparse._ActionsContainer) -> None:
    """--pp-size, --pp-partition, --stage-timeout of a colocated pipeline (dsakv generate; pipeline/colocated.py)."""
    g.add_argument("--pp-size", type=int, default=1, metavar="N", help=PP_SIZE_HELP)
    g.add_argument("--pp-partition", default=None, metavar="N,N,..", help=PP_PARTITION_HELP)
    g.add_argument("--stage-timeout", type=float, default=10.0, help=STAGE_TIMEOUT_HELP)


def add_pipeline_arguments(g: argparse._ActionsContainer) -> None:
    g.add_argument("--pp-size", type=int, default=1, help=PP_SIZE_HELP)
    g.add_argument(
        "--pp-rank",
        type=int,
        default=None,
        help="prefill / decode: run only this stage (default: start all --pp-size stages as child processes)",
    )
    g.add_argument(
        "--pp-partition",
        default=None,
        metavar="N,N,..",
        help=f"{PP_PARTITION_HELP}; any prefill partition pairs with any decode partition (each key goes to the "
        "decode stage holding it)",
    )
    g.add_argument(
        "--dist-port",
        type=int,
        default=None,
        help="prefill / decode: stage 0's gloo rendezvous port (default --port + pp-size)",
    )
    g.add_argument("--stage0-host", default=None, help="prefill / decode: host of stage 0 (default --host)")
    g.add_argument(
        "--stage-timeout",
        type=float,
        default=10.0,
        help="prefill / decode: bound on every activation send/receive between stages; a stage silent this long is "
        "dropped and the pipeline re-forms (default 10 s)",
    )


# ---- reading them back into the tree ----------------------------------------------------------------------------


def _size(args: argparse.Namespace, attr: str) -> int | None:
    text = getattr(args, attr, None)
    return parse_size(text, "--" + attr.replace("_", "-")) if text else None


def layout_config(args: argparse.Namespace, defaults: LayoutConfig = LayoutConfig()) -> LayoutConfig:
    return LayoutConfig(
        elide=getattr(args, "elide", defaults.elide),
        kv_format=getattr(args, "kv_format", defaults.kv_format),
        index_format=getattr(args, "index_format", defaults.index_format),
        page_size=getattr(args, "page_size", defaults.page_size),
    )


def pool_config(args: argparse.Namespace) -> PoolConfig:
    return PoolConfig(
        num_pages=getattr(args, "num_pages", None),
        max_tokens=getattr(args, "max_tokens", None),
        kv_budget=_size(args, "kv_budget"),
    )


def scheduler_config(args: argparse.Namespace) -> SchedulerConfig:
    return SchedulerConfig(
        max_batch_tokens=getattr(args, "max_batch_tokens", SchedulerConfig.max_batch_tokens),
        max_running_requests=getattr(args, "max_running_requests", None),
    )


def storage_config(args: argparse.Namespace) -> StorageConfig | None:
    """The StorageConfig of --hicache-storage mooncake (None otherwise: the file tier uses --hicache-disk-dir)."""
    backend = getattr(args, "hicache_storage", None)
    if backend is None or backend == "file":
        if backend == "file" and not getattr(args, "hicache_disk_dir", None):
            raise ConfigError("--hicache-storage file needs --hicache-disk-dir DIR (where the page files go)")
        if getattr(args, "mooncake_master", None):
            raise ConfigError("--mooncake-master given without --hicache-storage mooncake: add it, or drop the master")
        return None
    if getattr(args, "hicache_disk_dir", None):
        raise ConfigError("--hicache-disk-dir is the file storage tier: give it or --hicache-storage mooncake")
    host = getattr(args, "host", None)
    return StorageConfig(
        backend=backend,
        master=args.mooncake_master,
        metadata=args.mooncake_metadata,
        segment_bytes=parse_size(args.mooncake_segment_size, "--mooncake-segment-size")
        if args.mooncake_segment_size not in (None, "0")
        else 0,
        protocol=args.mooncake_protocol,
        device_names=args.mooncake_device_names,
        local_hostname=host if host and host not in ("0.0.0.0", "::", "localhost") else "127.0.0.1",
        timeout=args.hicache_storage_timeout,
        secret_file=getattr(args, "hicache_storage_secret_file", None) or getattr(args, "cluster_secret_file", None),
    )


def cache_config(args: argparse.Namespace) -> CacheConfig:
    return CacheConfig(
        prefix_cache=bool(getattr(args, "prefix_cache", False)),
        hicache_ratio=getattr(args, "hicache_ratio", None),
        hicache_size=_size(args, "hicache_size"),
        layout=getattr(args, "hicache_layout", "layer_first"),
        write_policy=getattr(args, "hicache_write_policy", "write_through"),
        selective_threshold=getattr(args, "hicache_selective_threshold", 2),
        disk_dir=getattr(args, "hicache_disk_dir", None),
        disk_size=_size(args, "hicache_disk_size"),
        storage=storage_config(args),
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        layout=layout_config(args),
        pool=pool_config(args),
        scheduler=scheduler_config(args),
        cache=cache_config(args),
        hisparse=hisparse_config(args),
        dtype=getattr(args, "dtype", "float32"),
        weight_dtype=getattr(args, "weight_dtype", "model"),
        int8_gemv=getattr(args, "int8_gemv", False),
        compile_decode=getattr(args, "compile", False),
        seed=getattr(args, "seed", None),
        speculative_num_steps=getattr(args, "speculative_num_steps", 0),
    )


def transfer_config(args: argparse.Namespace) -> TransferConfig:
    return TransferConfig(
        backend=getattr(args, "transfer_backend", "mooncake"),
        mooncake_timeout=getattr(args, "mooncake_timeout", None),
        rpc_timeout=getattr(args, "rpc_timeout", 5.0),
        debug_transfer_delay=getattr(args, "debug_transfer_delay", 0.0),
        staging_size=parse_size(str(getattr(args, "transfer_staging_size", "256MiB")), "--transfer-staging-size"),
        staging_slots=getattr(args, "transfer_staging_slots", 4),
        debug_transfer_strategy=getattr(args, "debug_transfer_strategy", "") or "",
    )


def pipeline_config(args: argparse.Namespace) -> PipelineConfig:
    from dsakv.plan.capacity import parse_partition

    text = getattr(args, "pp_partition", None)
    return PipelineConfig(
        pp_size=getattr(args, "pp_size", 1),
        pp_rank=getattr(args, "pp_rank", None),
        partition=parse_partition(str(text)) if text else None,
        dist_port=getattr(args, "dist_port", None),
        stage0_host=getattr(args, "stage0_host", None),
        stage_timeout=getattr(args, "stage_timeout", 10.0),
    )


def config_from_args(args: argparse.Namespace) -> Config:
    """The whole tree from parsed argv (options a command does not declare take the tree's defaults)."""
    return Config(engine=engine_config(args), transfer=transfer_config(args), pipeline=pipeline_config(args))


def model_dir_of(args: argparse.Namespace) -> Path:
    """--model DIR, checked to be a checkpoint directory."""
    if not args.model:
        raise ConfigError(f"--role {args.role} needs --model DIR (a checkpoint directory; `dsakv make-tiny DIR`)")
    d = Path(args.model)
    if not (d / "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} has no config.json: pass a checkpoint directory")
    return d
