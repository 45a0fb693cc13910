"""`dsakv serve`: the OpenAI-compatible HTTP server, colocated here; prefill / decode / router in disagg_roles.

    dsakv serve --model DIR [--host 127.0.0.1] [--port 8000] [--no-elide] [--kv-budget 64MiB | --num-pages N]

Structure:
- `add_arguments` adds the options every role shares (model, address, pool, engine, prefix cache), then
  `dsakv.cli.disagg_roles.add_arguments(parser)` adds the role-specific ones (it must not re-add shared ones).
- `run` starts `--role colocated` itself (`run_colocated`) and hands prefill / decode / router to
  `dsakv.cli.disagg_roles.run_role(args)`.
- `engine_kwargs(args)` / `num_pages_for(args, spec)` turn the shared options into Engine keyword arguments, for
  any role that builds an Engine; `serve_http(app, args)` runs an ASGI app with uvicorn.
Imports torch, the engine and uvicorn inside functions only (`dsakv --help` stays light).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from dsakv.cli import disagg_roles
from dsakv.cli.hicache_options import add_hicache_arguments, hicache_kwargs
from dsakv.cli.http_options import add_http_arguments, http_limits
from dsakv.errors import ConfigError
from dsakv.plan.units import parse_size
from dsakv.spec.layout import DEFAULT_PAGE_SIZE, INDEX_FORMATS, KV_FORMATS

log = logging.getLogger("dsakv.serve")

ROLES = ("colocated", "prefill", "decode", "router")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Serve a GLM-5.x / DeepSeek-V3.2 checkpoint over an OpenAI-compatible HTTP API (/v1/completions, "
        "/v1/chat/completions, /v1/models, /health, /metrics). --role colocated runs one engine in this process; "
        "prefill / decode / router run the disaggregated workers."
    )
    p.epilog = (
        "examples:\n"
        "  dsakv make-tiny /tmp/tiny && dsakv serve --model /tmp/tiny --port 8000\n"
        "  dsakv serve --model /tmp/tiny --kv-budget 4MiB --no-elide --prefix-cache\n"
        "  curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\\n"
        '      -d \'{"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}\'\n'
        "\n"
        "text prompts without a tokenizer in DIR use the byte fallback: byte b <-> token id b + 2; other output ids\n"
        "print as <|id|>. Chat messages without a chat template render as '<|role|>\\ncontent\\n...<|assistant|>\\n'."
    )
    p.add_argument("--role", choices=ROLES, default="colocated", help="which process to run (default colocated)")
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: DIR's name)")
    p.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds without a token before a request fails"
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="(info)")
    kv = p.add_argument_group("KV pool (size it with --kv-budget, --num-pages or --max-tokens)")
    kv.add_argument(
        "--elide", action=argparse.BooleanOptionalAction, default=True, help="index-K only for producer layers"
    )
    kv.add_argument("--kv-format", choices=KV_FORMATS, default="fp32", help="MLA KV row format (default fp32, exact)")
    kv.add_argument("--index-format", choices=INDEX_FORMATS, default="fp32", help="index-K format (default fp32)")
    kv.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE, help=f"tokens per page ({DEFAULT_PAGE_SIZE})")
    size = kv.add_mutually_exclusive_group()
    size.add_argument("--kv-budget", default=None, metavar="SIZE", help="pool bytes, e.g. 64MiB (pages = planner's)")
    size.add_argument("--num-pages", type=int, default=None, help="pool pages")
    size.add_argument("--max-tokens", type=int, default=None, help="pool tokens (default 16384)")
    add_hicache_arguments(p)
    add_http_arguments(p)
    eng = p.add_argument_group("engine")
    eng.add_argument("--max-batch-tokens", type=int, default=512, help="tokens per step (chunked prefill budget)")
    eng.add_argument("--max-running-requests", type=int, default=None, help="requests per batch (default 64)")
    eng.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weights (float32)")
    eng.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    eng.add_argument("--seed", type=int, default=None, help="seed for requests that give none")
    eng.add_argument(
        "--speculative-num-steps",
        type=int,
        default=0,
        metavar="K",
        help="speculative decoding with the checkpoint's MTP layer reused K times (default 0 = off; colocated "
        "role; the pool then holds the draft layer's KV and index-K, and /metrics shows dsakv_spec_*)",
    )
    disagg_roles.add_arguments(p)


def model_dir_of(args: argparse.Namespace) -> Path:
    if not args.model:
        raise ConfigError(f"--role {args.role} needs --model DIR (a checkpoint directory; `dsakv make-tiny DIR`)")
    d = Path(args.model)
    if not (d / "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} has no config.json: pass a checkpoint directory")
    return d


def num_pages_for(
    args: argparse.Namespace, spec: Any, layer_start: int = 0, layer_end: int | None = None
) -> int | None:
    """Pages from --kv-budget exactly as the planner sizes a pool (floor to whole pages); else --num-pages."""
    if args.kv_budget is None:
        return args.num_pages
    from dsakv.plan.capacity import max_total_num_tokens
    from dsakv.spec.layout import KVLayout

    layout = KVLayout(
        spec,
        layer_start=layer_start,
        layer_end=layer_end,
        elide=args.elide,
        kv_format=args.kv_format,
        index_format=args.index_format,
        page_size=args.page_size,
        draft_layers=1 if getattr(args, "speculative_num_steps", 0) else 0,
    )
    return max_total_num_tokens(parse_size(args.kv_budget, "--kv-budget"), layout) // args.page_size


def engine_kwargs(args: argparse.Namespace, spec: Any) -> dict[str, Any]:
    """Engine(...) keyword arguments from the shared options (not the model)."""
    import torch

    kw: dict[str, Any] = dict(
        elide=args.elide,
        kv_format=args.kv_format,
        index_format=args.index_format,
        page_size=args.page_size,
        num_pages=num_pages_for(args, spec),
        max_tokens=args.max_tokens,
        max_batch_tokens=args.max_batch_tokens,
        max_running_requests=args.max_running_requests,
        dtype=getattr(torch, args.dtype),
        seed=args.seed,
        **hicache_kwargs(args),
    )
    if args.speculative_num_steps:  # only the colocated role speculates (run() refuses it for the others)
        kw["speculative_num_steps"] = args.speculative_num_steps
    return kw


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def serve_http(app: Any, args: argparse.Namespace) -> int:
    """Run an ASGI app with uvicorn on --host/--port until interrupted, under the HTTP limits (http_options)."""
    import uvicorn

    from dsakv.serve.limits import uvicorn_settings

    guard = app.state.http_guard
    guard.limits = http_limits(args)
    config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, **uvicorn_settings(guard)
    )
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    log.info("serve: stopped")
    return 0


def run_colocated(args: argparse.Namespace) -> int:
    model_dir = model_dir_of(args)
    import torch

    from dsakv.engine.engine import Engine
    from dsakv.serve.app import create_app
    from dsakv.serve.engine_backend import EngineBackend
    from dsakv.serve.tokenizer import load_tokenizer
    from dsakv.spec.model import ModelSpec

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    spec = ModelSpec.from_path(model_dir)
    engine = Engine(model_dir, **engine_kwargs(args, spec))
    name = args.served_model_name or model_dir.resolve().name
    tokenizer = load_tokenizer(model_dir, engine.spec.vocab_size)
    st = engine.stats()
    log.info(
        "serve: colocated %s on http://%s:%d: capacity %d tokens (%d pages x %d), %d B/token, pool %.2f MiB, "
        "elide=%s, kv=%s, index=%s, prefix cache %s",
        name,
        args.host,
        args.port,
        st.capacity_tokens,
        st.pages_total,
        st.page_size,
        st.bytes_per_token,
        st.pool_bytes / 2**20,
        args.elide,
        args.kv_format,
        args.index_format,
        "on" if engine.prefix_cache is not None else "off",
    )
    app = create_app(EngineBackend(engine), name, tokenizer, request_timeout=args.request_timeout)
    return serve_http(app, args)


def validate(args: argparse.Namespace) -> None:
    """Refuse bad options before anything loads or binds (cli/validate.py); the checkpoint of roles that load one."""
    from dsakv.cli.validate import validate_checkpoint, validate_pool, validate_serve

    validate_serve(args)
    if args.role != "router":
        validate_pool(args, validate_checkpoint(model_dir_of(args)))
    elif args.model:
        validate_checkpoint(model_dir_of(args))


def bind_data_plane(args: argparse.Namespace) -> None:
    """Mooncake (KV transfer of decode/prefill, or the L3 store client) binds every interface: re-exec this process
    once under dsakv's bind shim so it listens on --host only (disagg/backends/bind_shim.py)."""
    transfer = args.role in ("decode", "prefill") and getattr(args, "transfer_backend", None) == "mooncake"
    store = args.role != "router" and getattr(args, "hicache_storage", None) == "mooncake"
    if transfer or store:
        from dsakv.disagg.backends.bind_shim import ensure_bound_to_host

        ensure_bound_to_host(args.host, "mooncake (KV transfer)" if transfer else "mooncake store client (L3)")


def run(args: argparse.Namespace) -> int:
    validate(args)
    setup_logging(args.log_level)
    bind_data_plane(args)
    if args.role == "colocated":
        return run_colocated(args)
    if args.speculative_num_steps:
        raise ConfigError(
            f"--speculative-num-steps {args.speculative_num_steps} with --role {args.role}: disaggregated roles do not "
            "speculate yet (the prefill would have to send the draft layer's KV); serve --role colocated, or drop it"
        )
    return int(disagg_roles.run_role(args) or 0)
