"""The configuration tree (dsakv.config) rendered back to the command line's flags (dsakv.cli.options
declares and reads them): argv for child processes, the demo's workers and the test and bench clusters
(dsakv.testing), so it sits below both. Standard library and dsakv.config only (no torch).
"""

from __future__ import annotations

from typing import Any

from dsakv.config import EngineConfig, LayoutConfig


def layout_argv(layout: LayoutConfig) -> list[str]:
    return [
        "--elide" if layout.elide else "--no-elide",
        *("--kv-format", layout.kv_format, "--index-format", layout.index_format),
        *("--page-size", str(layout.page_size)),
    ]


def _opt(flag: str, value: Any) -> list[str]:
    return [] if value is None else [flag, str(value)]


def engine_argv(cfg: EngineConfig, defaults: EngineConfig = EngineConfig()) -> list[str]:
    """argv that `dsakv serve` reads back into `cfg` (options equal to `defaults` are left out, except the layout,
    which is always spelled out)."""
    out = layout_argv(cfg.layout)
    out += _opt("--num-pages", cfg.pool.num_pages) + _opt("--max-tokens", cfg.pool.max_tokens)
    out += _opt("--kv-budget", f"{cfg.pool.kv_budget}B" if cfg.pool.kv_budget is not None else None)
    if cfg.scheduler.max_batch_tokens != defaults.scheduler.max_batch_tokens:
        out += ["--max-batch-tokens", str(cfg.scheduler.max_batch_tokens)]
    out += _opt("--max-running-requests", cfg.scheduler.max_running_requests)
    c, d = cfg.cache, defaults.cache
    if c.prefix_cache:
        out.append("--prefix-cache")
    out += _opt("--hicache-ratio", c.hicache_ratio) + _opt("--hicache-size", c.hicache_size)
    if c.layout != d.layout:
        out += ["--hicache-layout", c.layout]
    if c.write_policy != d.write_policy:
        out += ["--hicache-write-policy", c.write_policy]
    if c.selective_threshold != d.selective_threshold:
        out += ["--hicache-selective-threshold", str(c.selective_threshold)]
    out += _opt("--hicache-disk-dir", c.disk_dir) + _opt("--hicache-disk-size", c.disk_size)
    if c.storage is not None:  # the mooncake tier (its local hostname follows the child's --host)
        st = c.storage
        out += ["--hicache-storage", st.backend, *_opt("--mooncake-master", st.master)]
        out += _opt("--mooncake-metadata", st.metadata) + ["--mooncake-segment-size", f"{st.segment_bytes}B"]
        out += ["--mooncake-protocol", st.protocol, "--hicache-storage-timeout", str(st.timeout)]
        out += _opt("--mooncake-device-names", st.device_names or None)
        out += _opt("--hicache-storage-secret-file", st.secret_file)
    if cfg.dtype != defaults.dtype:
        out += ["--dtype", cfg.dtype]
    if cfg.weight_dtype != defaults.weight_dtype:
        out += ["--weight-dtype", cfg.weight_dtype]
    if cfg.int8_gemv:
        out += ["--int8-gemv"]
    if cfg.compile_decode:
        out += ["--compile"]
    if cfg.speculative_num_steps != defaults.speculative_num_steps:
        out += ["--speculative-num-steps", str(cfg.speculative_num_steps)]
    h = cfg.hisparse
    if h.enabled:
        out += ["--hisparse", *_opt("--hisparse-top-k", h.top_k)]
        out += _opt("--hisparse-device-buffer-size", h.device_buffer_size)
        out += ["--hisparse-host-to-device-ratio", str(h.host_to_device_ratio)]
    return out + _opt("--seed", cfg.seed)
