"""Engine configuration trees from flat keywords, for tests and benches: `engine_config(page_size=4,
max_tokens=64)` is `EngineConfig(layout=LayoutConfig(page_size=4), pool=PoolConfig(max_tokens=64))`. The Engine takes
only the tree (dsakv.config.EngineConfig); this table is the tests' shorthand for it, the one place those names map
onto branches (the CLI's flags map through cli/options.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, fields
from pathlib import Path
from typing import Any

from dsakv.config import EngineConfig
from dsakv.errors import ConfigError

# flat name -> (branch of EngineConfig, field); branch "" is a field of EngineConfig itself
OPTIONS: dict[str, tuple[str, str]] = {
    "elide": ("layout", "elide"),
    "kv_format": ("layout", "kv_format"),
    "index_format": ("layout", "index_format"),
    "page_size": ("layout", "page_size"),
    "num_pages": ("pool", "num_pages"),
    "max_tokens": ("pool", "max_tokens"),
    "kv_budget": ("pool", "kv_budget"),
    "max_batch_tokens": ("scheduler", "max_batch_tokens"),
    "max_running_requests": ("scheduler", "max_running_requests"),
    "enable_prefix_cache": ("cache", "prefix_cache"),
    "hicache_ratio": ("cache", "hicache_ratio"),
    "hicache_size": ("cache", "hicache_size"),
    "hicache_layout": ("cache", "layout"),
    "hicache_write_policy": ("cache", "write_policy"),
    "hicache_selective_threshold": ("cache", "selective_threshold"),
    "hicache_disk_dir": ("cache", "disk_dir"),
    "hicache_disk_size": ("cache", "disk_size"),
    "hicache_storage": ("cache", "storage"),
    "hisparse": ("hisparse", "enabled"),
    "hisparse_top_k": ("hisparse", "top_k"),
    "hisparse_device_buffer_size": ("hisparse", "device_buffer_size"),
    "hisparse_host_to_device_ratio": ("hisparse", "host_to_device_ratio"),
    "dtype": ("", "dtype"),
    "weight_dtype": ("", "weight_dtype"),
    "int8_gemv": ("", "int8_gemv"),
    "compile_decode": ("", "compile_decode"),
    "seed": ("", "seed"),
    "speculative_num_steps": ("", "speculative_num_steps"),
}
# the tree's branches (field name -> its config class), read off EngineConfig itself
_BRANCHES: dict[str, Any] = {
    f.name: f.default_factory for f in fields(EngineConfig) if f.default_factory is not MISSING
}


def engine_config(**options: Any) -> EngineConfig:
    """The tree from flat names of OPTIONS (dtype may be a torch.dtype or its name; hicache_disk_dir a Path)."""
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ConfigError(f"unknown engine option(s) {', '.join(unknown)}: use {', '.join(OPTIONS)}")
    branches: dict[str, dict[str, Any]] = {name: {} for name in (*_BRANCHES, "")}
    for name, value in options.items():
        branch, attr = OPTIONS[name]
        if attr == "dtype" and not isinstance(value, str):
            value = str(value).removeprefix("torch.")
        if attr == "disk_dir" and isinstance(value, Path):
            value = str(value)
        branches[branch][attr] = value
    return EngineConfig(**{b: cls(**branches[b]) for b, cls in _BRANCHES.items()}, **branches[""])


def flat_options(cfg: EngineConfig) -> dict[str, Any]:
    """The flat spelling of a tree (inverse of engine_config; defaults included)."""
    return {name: getattr(getattr(cfg, branch) if branch else cfg, attr) for name, (branch, attr) in OPTIONS.items()}


def split_options(kw: Mapping[str, Any]) -> tuple[EngineConfig, dict[str, Any]]:
    """(the tree of kw's OPTIONS names, the rest: the Engine's own keywords such as check_every_step)."""
    flat = {k: v for k, v in kw.items() if k in OPTIONS}
    return engine_config(**flat), {k: v for k, v in kw.items() if k not in flat}
