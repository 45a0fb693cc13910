"""Startup checks of `dsakv serve` / `dsakv generate` options: every bad value is a ConfigError (printed by
cli/main.py as one line `dsakv CMD: error: ...`) naming the flag, the value and the fix, raised before anything
loads or binds. Values that would start a server whose every request fails (a negative timeout, a router
pointed at an address that cannot exist, a pool larger than this machine's memory) are refused here too.

    validate_serve(args)        flags of every role (numbers finite and in range, ports, hosts, peer addresses)
    validate_generate(args)     flags of `dsakv generate`
    validate_checkpoint(dir)    config.json (UTF-8 JSON, runnable numerics) + safetensors headers (no torch)
    validate_pool(args, spec)   the device pool and host tier fit in this machine's memory

No torch; imports dsakv.spec / dsakv.plan / dsakv.model.config (torch-free) and the standard library.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import socket
import struct
from pathlib import Path
from typing import Any

from dsakv.config import DEFAULT_MAX_TOKENS, dp_prefill_tier_refusal  # (dsakv.config: no torch)
from dsakv.errors import ConfigError
from dsakv.util import ceil_div

MAX_PORT = 65535
MAX_SECONDS = 30 * 86400.0  # any time bound past a month is a typo (and past threading.TIMEOUT_MAX breaks waits)
# config.json "dtype" / "torch_dtype": the names torch (and transformers' config loader) know
DTYPES = frozenset(
    "float32 float float16 half bfloat16 float64 double float8_e4m3fn float8_e5m2 float8_e4m3fnuz float8_e5m2fnuz "
    "int8 uint8 auto".split()
)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_int(args: argparse.Namespace, name: str, lo: int, hi: int | None = None, fix: str = "") -> None:
    v = getattr(args, name, None)
    if v is None:
        return
    if isinstance(v, bool) or not isinstance(v, int) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
        raise ConfigError(f"{_flag(name)} {v!r} must be an integer {rng}" + (f" ({fix})" if fix else ""))


def check_seconds(
    args: argparse.Namespace, name: str, allow_zero: bool = False, fix: str = "", hi: float = MAX_SECONDS
) -> None:
    v = getattr(args, name, None)
    if v is None:
        return
    ok = isinstance(v, (int, float)) and math.isfinite(v) and (v >= 0 if allow_zero else v > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ConfigError(
            f"{_flag(name)} {v!r} must be a finite number of seconds {bound}" + (f" ({fix})" if fix else "")
        )
    if v > hi:
        raise ConfigError(
            f"{_flag(name)} {v!r} is over the most it may be, {hi:.0f} seconds" + (f" ({fix})" if fix else "")
        )


def check_ratio(args: argparse.Namespace, name: str, fix: str = "") -> None:
    v = getattr(args, name, None)
    if v is None:
        return
    if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
        raise ConfigError(f"{_flag(name)} {v!r} must be a finite number > 0" + (f" ({fix})" if fix else ""))


def check_host(host: str, flag: str) -> None:
    """An address this machine can bind or reach: an IP literal or a name that resolves."""
    if not host or any(c.isspace() for c in host):
        raise ConfigError(f"{flag} {host!r} is not a host: give an IP address or a host name, e.g. 127.0.0.1")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return
    except ValueError:
        pass
    if all(c.isdigit() or c == "." for c in host):
        raise ConfigError(f"{flag} {host!r} is not a valid IPv4 address: e.g. 127.0.0.1")
    try:
        socket.getaddrinfo(host, None)
    except (socket.gaierror, UnicodeError) as e:
        raise ConfigError(f"{flag} {host!r} does not resolve ({e}): give an IP address or a known host name") from None


def check_port(port: Any, flag: str, allow_zero: bool = False) -> None:
    lo = 0 if allow_zero else 1
    if isinstance(port, bool) or not isinstance(port, int) or not lo <= port <= MAX_PORT:
        raise ConfigError(f"{flag} {port!r} is not a TCP port: give {lo}..{MAX_PORT}")


def check_peer(addr: str, flag: str) -> None:
    """HOST:PORT of a peer worker (what --prefill / --decode take)."""
    host, sep, port = str(addr).rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(f"{flag} {addr!r} must be HOST:PORT, e.g. 127.0.0.1:9100")
    check_port(int(port), f"{flag} {addr!r}: port")
    check_host(host, f"{flag} {addr!r}: host")


def validate_http(args: argparse.Namespace) -> None:
    from dsakv.cli.http_options import http_limits

    http_limits(args)  # HttpLimits validates itself


def validate_serve(args: argparse.Namespace) -> None:
    """Every flag of `dsakv serve` (any role) that can be checked without the model."""
    role = getattr(args, "role", "colocated")
    check_host(args.host, "--host")
    check_port(args.port, "--port", allow_zero=role in ("colocated", "router"))
    check_int(args, "threads", 1, 4096, "torch CPU threads; leave it out for torch's choice")
    check_int(args, "page_size", 1, 1 << 16, "tokens per page, e.g. 16 or 64")
    check_int(args, "num_pages", 1, 1 << 31, "pool pages")
    check_int(args, "max_tokens", 1, 1 << 40, "pool tokens")
    check_int(args, "max_batch_tokens", 1, 1 << 24, "tokens per step")
    check_int(args, "max_running_requests", 1, 1 << 20, "requests per batch")
    check_int(args, "seed", 0, 2**63 - 1)
    check_int(args, "hicache_selective_threshold", 1, None, "hits before a selective backup")
    check_ratio(args, "hicache_ratio", "host tier = ratio x device pool bytes, e.g. 2")
    check_seconds(args, "request_timeout", fix="seconds without a token before a request fails, e.g. 600")
    check_tp(args)
    if role == "colocated":
        check_pp_colocated(args)
    if getattr(args, "enable_dp_attention", False) and role not in ("decode", "colocated", "prefill"):
        raise ConfigError(
            f"dsakv serve --role {role} --enable-dp-attention is not supported: the router runs no model (DP "
            "attention serves colocated, as --role prefill or as --role decode)"
        )
    tp = getattr(args, "tp_size", 1)
    if tp > 1 and role not in ("colocated", "decode", "prefill"):
        raise ConfigError(f"--tp-size {tp} with --role {role} is not supported: the router runs no model")
    if role == "decode" and getattr(args, "pp_size", 1) > 1 and getattr(args, "speculative_num_steps", 0):
        raise ConfigError(
            f"--speculative-num-steps with --role decode --pp-size {args.pp_size} (any --tp-size) is not supported "
            "yet: drop one of them (a one-stage decode speculates, with TP too)"
        )
    check_seconds(args, "hicache_storage_timeout", fix="longest a storage-tier call may delay a request, e.g. 2")
    disk_dir = getattr(args, "hicache_disk_dir", None)
    if disk_dir is not None:
        check_dir(disk_dir, "--hicache-disk-dir")
    for name in ("kv_budget", "hicache_size", "hicache_disk_size"):
        v = getattr(args, name, None)
        if v is not None:
            from dsakv.plan.units import parse_size

            if parse_size(v, _flag(name)) <= 0:
                raise ConfigError(f"{_flag(name)} {v!r} must be more than 0 bytes, e.g. 64MiB")
    validate_http(args)
    from dsakv.config import MAX_KV_TIMEOUT, MAX_WAIT

    check_seconds(args, "rpc_timeout", fix="bound on every control-plane call, e.g. 5", hi=MAX_WAIT)
    check_seconds(args, "kv_timeout", fix="seconds for a request's prefill + KV transfer, e.g. 30", hi=MAX_KV_TIMEOUT)
    check_seconds(args, "queue_timeout", fix="how long a request may wait for a free pair, e.g. 60", hi=86400.0)
    check_seconds(args, "health_interval", fix="seconds between health polls, e.g. 0.5", hi=MAX_WAIT)
    check_seconds(
        args, "stage_timeout", fix="bound on every activation send/receive between stages, e.g. 10", hi=MAX_WAIT
    )
    check_seconds(args, "startup_wait", allow_zero=True, fix="how long the startup handshake waits, e.g. 60")
    staging = getattr(args, "transfer_staging_size", None)
    if staging is not None:
        from dsakv.plan.units import parse_size

        if parse_size(str(staging), "--transfer-staging-size") < 0:
            raise ConfigError(f"--transfer-staging-size {staging!r} must be >= 0 bytes (0: off), e.g. 256MiB")
    check_int(args, "transfer_staging_slots", 0, 1024, "destination staging slots of the decode (0: none)")
    check_int(args, "mooncake_timeout", 5, 86400, "mooncake's per-transfer timeout in seconds; its floor is 5")
    check_int(args, "pp_size", 1, 256, "pipeline stages of the prefill worker")
    pp = int(getattr(args, "pp_size", 1) or 1)  # --pp-rank: dsakv.config.PipelineConfig validates it (once)
    if getattr(args, "dist_port", None) is not None:
        check_port(args.dist_port, "--dist-port")
    if role == "prefill":
        if args.port + pp > MAX_PORT:
            raise ConfigError(
                f"--port {args.port} with --pp-size {pp}: stage ports {args.port}..{args.port + pp - 1} and the "
                f"rendezvous port {args.port + pp} must be <= {MAX_PORT}: pick a lower --port"
            )
        if getattr(args, "stage0_host", None):
            check_host(args.stage0_host, "--stage0-host")
        from dsakv.cli.disagg_roles import prefill_cache_config

        cache = prefill_cache_config(args)  # no disk tier; a storage tier on a single stage only
        if getattr(args, "enable_dp_attention", False) and (cache.host_tier or cache.storage is not None):
            raise ConfigError(dp_prefill_tier_refusal())
    dp = int(getattr(args, "dp_size", 1) or 1)
    dpa = getattr(args, "enable_dp_attention", False)
    dp_pp = role == "decode" and pp > 1 and dpa  # decode/dp_pipe.py
    if dp_pp and args.port + dp * pp + (0 if getattr(args, "dist_port", None) else dp) - 1 > MAX_PORT:
        raise ConfigError(
            f"--port {args.port} with --dp-size {dp} --pp-size {pp}: cell (DP rank d, stage s) listens on --port + "
            f"d x {pp} + s, each DP rank's rendezvous on --port + {dp * pp} + d (without --dist-port), up to "
            f"{args.port + dp * pp + dp - 1}, which must be <= {MAX_PORT}: pick a lower --port"
        )
    if dp_pp and getattr(args, "dist_port", None) is not None and args.dist_port + dp - 1 > MAX_PORT:
        raise ConfigError(
            f"--dist-port {args.dist_port} with --dp-size {dp}: DP rank d's rendezvous is on --dist-port + d, up to "
            f"{args.dist_port + dp - 1}, which must be <= {MAX_PORT}: pick a lower --dist-port"
        )
    if role == "prefill" and dpa and pp > 1:  # prefill/dp_pp.py
        last = args.port + dp * (pp + 1) - 1
        if last > MAX_PORT:
            raise ConfigError(
                f"--port {args.port} with --dp-size {dp} --pp-size {pp}: DP rank d uses --port + d x {pp + 1} .. "
                f"+ {pp} (its stages and rendezvous), up to {last}, which must be <= {MAX_PORT}: pick a lower --port"
            )
    elif role in ("decode", "prefill") and dpa and args.port + dp - 1 > MAX_PORT:
        raise ConfigError(
            f"--port {args.port} with --dp-size {dp}: DP rank r listens on --port + r, up to {args.port + dp - 1}, "
            f"which must be <= {MAX_PORT}: pick a lower --port"
        )
    for p in getattr(args, "prefill", None) or ():
        check_peer(p, "--prefill")
    for d in getattr(args, "decode", None) or ():
        check_peer(d, "--decode")


def validate_generate(args: argparse.Namespace) -> None:
    check_int(args, "threads", 1, 4096, "torch CPU threads; leave it out for torch's choice")
    check_int(args, "page_size", 1, 1 << 16, "tokens per page")
    check_int(args, "num_pages", 1, 1 << 31, "pool pages")
    check_int(args, "max_tokens", 1, 1 << 40, "pool tokens")
    check_int(args, "max_batch_tokens", 1, 1 << 24, "tokens per step")
    check_int(args, "max_new_tokens", 1, None, "tokens to generate per prompt")
    check_int(args, "seed", 0, 2**63 - 1)
    check_ratio(args, "hicache_ratio", "host tier = ratio x device pool bytes, e.g. 2")
    check_tp(args)
    check_pp_colocated(args)
    disk_dir = getattr(args, "hicache_disk_dir", None)
    if disk_dir is not None:
        check_dir(disk_dir, "--hicache-disk-dir")


def check_pp_colocated(args: argparse.Namespace) -> None:
    """--pp-size of a colocated pipeline (generate, serve --role colocated): this command starts every stage (with
    --tp-size, each stage's TP ranks; with DP attention, each DP rank's pipeline: pipeline/dp_stage.py); the engine
    options it refuses are named by pipeline/colocated.refusal."""
    check_int(args, "pp_size", 1, 64, "pipeline stages (one process each)")
    pp = int(getattr(args, "pp_size", 1) or 1)
    if getattr(args, "pp_rank", None) is not None:
        raise ConfigError(
            f"--pp-rank {args.pp_rank} is for --role prefill / decode: a colocated --pp-size {pp} starts every stage "
            "itself; drop --pp-rank"
        )
    if pp > 1:
        check_seconds(args, "stage_timeout", fix="bound on every activation send/receive between stages, e.g. 10")


def check_tp(args: argparse.Namespace) -> None:
    """--tp-size: 1..64, and not (yet) with the features whose extra state the ranks do not share (HiSparse runs
    with attention TP: every rank its own HiSparse pool; not with DP attention)."""
    check_int(args, "tp_size", 1, 64, "tensor-parallel ranks")
    check_int(args, "dp_size", 1, 64, "data-parallel attention ranks")
    check_int(args, "ep_size", 1, 64, "expert-parallel ranks")
    tp, dp, ep = getattr(args, "tp_size", 1), getattr(args, "dp_size", 1), getattr(args, "ep_size", 1)
    dpa = getattr(args, "enable_dp_attention", False)
    if dp > 1 and not dpa:
        raise ConfigError(f"--dp-size {dp} needs --enable-dp-attention (data-parallel replicas: start more servers)")
    if dpa:
        if dp == 1:
            raise ConfigError("--enable-dp-attention needs --dp-size > 1")
        if tp != dp:
            raise ConfigError(
                f"--enable-dp-attention with --tp-size {tp} --dp-size {dp}: the engine runs attention TP 1 "
                f"(--tp-size == --dp-size, the TP=DP deployment); use --tp-size {dp}"
            )
        if ep != tp:
            raise ConfigError(
                f"--enable-dp-attention runs the MoE expert-parallel over every rank: give --ep-size {tp}, not {ep}"
            )
    elif ep > 1:
        raise ConfigError(f"--ep-size {ep} needs --enable-dp-attention (tensor-parallel ranks split the experts by TP)")
    if getattr(args, "role", "colocated") == "prefill" and getattr(args, "hisparse", False):
        raise ConfigError(  # any TP: a prefill has no HiSparse pool (it was ignored at TP 1)
            "--hisparse with --role prefill is not supported: HiSparse is a decode's pool (a prefill keeps its KV "
            "on the device and writes the decode's host pool): give --hisparse to the decode"
        )
    if tp == 1:
        return
    if dpa and getattr(args, "hisparse", False):  # attention TP (no DP) runs HiSparse: one pool per TP rank
        raise ConfigError(
            f"--hisparse with --enable-dp-attention --dp-size {dp} is not supported yet: drop --hisparse, or run "
            f"attention TP (--tp-size {tp} without --dp-size / --enable-dp-attention / --ep-size)"
        )
    role = getattr(args, "role", "colocated")
    if dpa and getattr(args, "speculative_num_steps", 0) and role == "prefill":
        raise ConfigError(
            f"--enable-dp-attention with --role {role} --speculative-num-steps is not supported yet: drop one of them "
            "(a TP 1 prefill with --speculative-num-steps feeds a DP-attention decode that speculates)"
        )


def check_dir(path: str, flag: str) -> None:
    """A directory to write into: absent (it is created) or a directory, never a file."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {path!r} is a file, not a directory: give a directory (it is created if absent)")
    parent = next((q for q in p.absolute().parents if q.exists()), None)
    if not p.exists() and parent is not None and not parent.is_dir():
        raise ConfigError(f"{flag} {path!r} cannot be created: {str(parent)!r} is a file")


# ---- the checkpoint -----------------------------------------------------------------------------------


def check_safetensors(path: Path) -> None:
    """The header of one .safetensors file is well formed and every tensor lies inside the file (a truncated or
    corrupt file is refused here, not half-loaded). Reads only the header."""
    size = path.stat().st_size
    what = f"checkpoint file {str(path)!r}"
    if size < 8:
        raise ConfigError(f"{what} is {size} bytes, too short for a safetensors header: re-download or re-save it")
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        if n == 0 or n > min(size - 8, 100 * 2**20):
            raise ConfigError(
                f"{what} is corrupt: its header claims {n} bytes in a {size}-byte file: re-download or re-save it"
            )
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} is corrupt: its header is not JSON ({e}): re-download or re-save it") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{what} is corrupt: its header is not a JSON object: re-download or re-save it")
    data = size - 8 - n
    for name, t in header.items():
        if name == "__metadata__":
            continue
        offs = t.get("data_offsets") if isinstance(t, dict) else None
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
            or not 0 <= offs[0] <= offs[1] <= data
        ):
            raise ConfigError(
                f"{what} is corrupt or truncated: tensor {name!r} has data_offsets {offs!r} outside its "
                f"{data} data bytes: re-download or re-save it"
            )


def validate_checkpoint(model_dir: Path) -> Any:
    """config.json (UTF-8 JSON the engine can run) and the safetensors headers; the ModelSpec."""
    from dsakv.model.config import DSAConfig
    from dsakv.spec.model import ModelSpec

    cfg_path = model_dir / "config.json"
    cfg = read_json(cfg_path)
    spec = ModelSpec.from_dict(cfg, name=model_dir.name)
    if not isinstance(cfg, dict):  # from_dict refused it already
        raise ConfigError(f"{str(cfg_path)!r} must hold a JSON object")
    DSAConfig.from_dict(cfg, spec)
    check_config_values(cfg, cfg_path)
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        if (model_dir / name).is_file() and not isinstance(read_json(model_dir / name), dict):
            raise ConfigError(f"{str(model_dir / name)!r} must hold a JSON object: fix or remove it")
    check_weight_files(model_dir)
    return spec


def validate_v4_checkpoint(model_dir: Path, role: str, page_size: int) -> Any:
    """A DeepSeek-V4 checkpoint `dsakv serve` can run: config.json (V4Spec), the safetensors headers, a page size
    of whole compressed entries; the V4Spec. Every role serves it (colocated, prefill, decode)."""
    from dsakv.spec.v4 import V4Spec
    from dsakv.spec.v4_layout import V4Layout

    cfg_path = model_dir / "config.json"
    cfg = read_json(cfg_path)
    spec = V4Spec.from_dict(cfg, name=model_dir.name)
    check_config_values(cfg, cfg_path)
    V4Layout(spec, kv_format="fp32", index_format="fp32", page_size=page_size)  # --page-size of whole entries
    check_weight_files(model_dir)
    return spec


def check_weight_files(model_dir: Path) -> None:
    """At least one *.safetensors file, each with a header dsakv can read (check_safetensors)."""
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {str(model_dir)!r}: it is not a checkpoint directory")
    for f in files:
        check_safetensors(f)


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, or a ConfigError naming it (not UTF-8, not JSON, nested too deeply)."""
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{str(path)!r} is not UTF-8 text ({e}): save it as UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{str(path)!r} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"{str(path)!r} nests arrays/objects too deeply to be a config: fix it") from None
    except ValueError as e:  # an integer of over 4300 digits
        raise ConfigError(f"{str(path)!r} is not a usable config ({str(e)[:120]}): fix it") from None
    except OSError as e:
        raise ConfigError(f"{str(path)!r} cannot be read ({e})") from None


def check_config_values(cfg: dict[str, Any], path: Path) -> None:
    """config.json values the engine would accept and then fail on (or run out of memory with)."""
    for key in ("dtype", "torch_dtype"):
        v = cfg.get(key)
        if v is not None and (not isinstance(v, str) or v.removeprefix("torch.") not in DTYPES):
            raise ConfigError(
                f"{str(path)!r}: '{key}' = {str(v)[:40]!r} is not a torch dtype: use e.g. bfloat16, float16, float32"
            )
    topk, pos = cfg.get("index_topk"), cfg.get("max_position_embeddings")
    if isinstance(topk, int) and isinstance(pos, int) and not isinstance(topk, bool) and topk > pos:
        raise ConfigError(
            f"{str(path)!r}: 'index_topk' = {topk} is more than 'max_position_embeddings' = {pos}: the indexer "
            "selects at most one key per position"
        )


def machine_memory() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 1 << 62


def validate_pool(args: argparse.Namespace, spec: Any, layer_start: int = 0, layer_end: int | None = None) -> None:
    """The device pool (and host tier) that the options ask for fit in this machine's memory."""
    from dsakv.plan.capacity import max_total_num_tokens
    from dsakv.plan.units import fmt_bytes, parse_size
    from dsakv.spec.layout import KVLayout

    elide = getattr(args, "elide", not getattr(args, "no_elide", False))
    layout = KVLayout(
        spec,
        layer_start=layer_start,
        layer_end=layer_end,
        elide=elide,
        kv_format=args.kv_format,
        index_format=args.index_format,
        page_size=args.page_size,
    )
    per_page = layout.bytes_per_token * args.page_size
    if getattr(args, "kv_budget", None) is not None:
        pages = max_total_num_tokens(parse_size(args.kv_budget, "--kv-budget"), layout) // args.page_size
        flag = f"--kv-budget {args.kv_budget}"
    elif args.num_pages is not None:
        pages, flag = args.num_pages, f"--num-pages {args.num_pages}"
    elif args.max_tokens is not None:
        pages, flag = ceil_div(args.max_tokens, args.page_size), f"--max-tokens {args.max_tokens}"
    else:  # the engine's default pool
        pages, flag = ceil_div(DEFAULT_MAX_TOKENS, args.page_size), f"the default pool ({DEFAULT_MAX_TOKENS} tokens)"
    if pages < 1:
        raise ConfigError(f"{flag} gives {pages} pages of {per_page} bytes: the pool needs at least one page")
    mem = machine_memory()
    pool = pages * per_page
    if pool > mem:
        raise ConfigError(
            f"{flag} asks for a {fmt_bytes(pool)} KV pool ({pages} pages x {per_page} B) but this machine has "
            f"{fmt_bytes(mem)} of memory: lower it"
        )
    host = None
    if getattr(args, "hicache_ratio", None) is not None:
        host, hflag = pool * float(args.hicache_ratio), f"--hicache-ratio {args.hicache_ratio}"
    elif getattr(args, "hicache_size", None) is not None:
        host, hflag = parse_size(args.hicache_size, "--hicache-size"), f"--hicache-size {args.hicache_size}"
    if host is not None and pool + host > mem:
        raise ConfigError(
            f"{hflag} asks for a {fmt_bytes(host)} host tier next to the {fmt_bytes(pool)} KV pool, more than this "
            f"machine's {fmt_bytes(mem)} of memory: lower it"
        )


__all__ = [
    "check_host",
    "check_peer",
    "check_port",
    "check_safetensors",
    "machine_memory",
    "validate_checkpoint",
    "validate_generate",
    "validate_pool",
    "validate_serve",
    "validate_v4_checkpoint",
]
