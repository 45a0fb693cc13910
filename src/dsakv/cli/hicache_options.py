"""The prefix-cache / host-tier / storage-tier (HiCache) options shared by `dsakv generate` and `dsakv serve`.
No torch."""

from __future__ import annotations

import argparse
from typing import Any

from dsakv.cache.storage.base import StorageConfig
from dsakv.errors import ConfigError
from dsakv.plan.units import parse_size


def add_hicache_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """Add the --prefix-cache and --hicache-* options; returns their group (callers may add to it)."""
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
        "--hicache-storage-timeout",
        type=float,
        default=2.0,
        metavar="SECONDS",
        help="longest a storage-tier call may delay a request; past it the request computes instead (default 2)",
    )
    return hc


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
    )


def storage_pp_error(backend: str, pp_size: int) -> str:
    """The one-line refusal of a storage tier on a prefill pipeline of more than one stage."""
    return (
        f"--hicache-storage {backend} with --pp-size {pp_size}: only a single-stage prefill can use the storage "
        "tier (later stages would need their own L3 loads); use --pp-size 1 or drop --hicache-storage"
    )


def hicache_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """Engine(...) keyword arguments for the options above."""
    return {
        "enable_prefix_cache": args.prefix_cache,
        "hicache_ratio": args.hicache_ratio,
        "hicache_size": parse_size(args.hicache_size, "--hicache-size") if args.hicache_size else None,
        "hicache_layout": args.hicache_layout,
        "hicache_write_policy": args.hicache_write_policy,
        "hicache_selective_threshold": args.hicache_selective_threshold,
        "hicache_disk_dir": args.hicache_disk_dir,
        "hicache_disk_size": parse_size(args.hicache_disk_size, "--hicache-disk-size")
        if args.hicache_disk_size
        else None,
        "hicache_storage": storage_config(args),
    }
