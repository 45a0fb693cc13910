"""The prefix-cache / host-tier (HiCache) options shared by `dsakv generate` and `dsakv serve`. No torch."""

from __future__ import annotations

import argparse
from typing import Any

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
    return hc


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
    }
