"""`dsakv serve`: the OpenAI-compatible HTTP server, colocated here; prefill / decode / router in disagg_roles.

    dsakv serve --model DIR [--host 127.0.0.1] [--port 8000] [--no-elide] [--kv-budget 64MiB | --num-pages N]

Structure:
- `add_arguments` adds the options every role shares (model, address, then the configuration tree's layout,
  pool, prefix cache and engine groups from `dsakv.cli.options`), then `dsakv.cli.disagg_roles.add_arguments`
  adds the role-specific ones (transfer, pipeline, router).
- `run` reads the tree once (`options.config_from_args`), starts `--role colocated` itself (`run_colocated`) and
  hands prefill / decode / router to `dsakv.cli.disagg_roles.run_role(args, cfg)`. disagg_roles never imports
  this module (no import cycle).
Imports torch, the engine and uvicorn inside functions only (`dsakv --help` stays light).
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from dsakv.cli import disagg_roles, options
from dsakv.cli.http_options import add_http_arguments, http_limits
from dsakv.cli.logs import setup_logging
from dsakv.config import Config

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
    options.add_layout_arguments(kv)
    options.add_pool_arguments(kv)
    options.add_cache_arguments(p)
    add_http_arguments(p)
    eng = p.add_argument_group("engine")
    options.add_engine_arguments(eng)
    eng.add_argument("--seed", type=int, default=None, help="seed for requests that give none")
    options.add_speculative_argument(
        eng,
        " (colocated and decode: the pool then holds the draft layer's KV and index-K, /metrics or the decode's "
        "health shows dsakv_spec_* / spec; prefill: its last stage loads the MTP layer and sends the draft "
        "layer's KV and last hidden state with the prompt's KV -- give the same flag to prefill and decode, the "
        "handshake refuses a mismatch; router: ignored)",
    )
    options.add_hisparse_arguments(p, " (colocated and decode roles; /metrics shows dsakv_hisparse_*)")
    options.add_parallel_arguments(eng)
    disagg_roles.add_arguments(p)


def run_colocated(args: argparse.Namespace, cfg: Config) -> int:
    model_dir = options.model_dir_of(args)
    import torch

    from dsakv.serve.app import create_app
    from dsakv.serve.engine_backend import EngineBackend
    from dsakv.serve.server import run_http
    from dsakv.serve.tokenizer import load_tokenizer

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from dsakv.engine.choose import check_tp, checkpoint_vocab_size, open_engine

    tokenizer = load_tokenizer(model_dir, checkpoint_vocab_size(model_dir))  # a bad one fails before loading
    tp = getattr(args, "tp_size", 1)
    check_tp(model_dir, tp)
    if cfg.pipeline.pp_size > 1:  # what a colocated pipeline refuses: before any rank or stage starts
        from dsakv.pipeline.colocated import check_refusal

        check_refusal(cfg.engine, cfg.pipeline.pp_size)
    ranked: Any = None
    piped: Any = None
    if getattr(args, "enable_dp_attention", False):  # DP ranks (engine/dp_serve.py): rank 0 serves HTTP
        ranked = _dp_engine(args, cfg, model_dir)
        if isinstance(ranked, int):
            return ranked
        engine = ranked.engine
    elif tp > 1:  # TP rank processes (engine/ranks.py): rank 0 serves HTTP, ranks 1..T-1 follow its steps
        from dsakv.engine.ranks import RankedEngine, follow, start_ranks
        from dsakv.engine.tp_spec import tp_engine
        from dsakv.model.loader import load_config
        from dsakv.model.parallel import shard_config

        shard_config(load_config(model_dir), tp)
        ranks = start_ranks(tp, args._argv)
        if cfg.pipeline.pp_size > 1:  # TP x PP: this stage's ranks (pipeline/tp_stage.py); stage 0's serve
            from dsakv.pipeline.colocated import start_pipeline

            piped = start_pipeline(model_dir, cfg.engine, cfg.pipeline, args._argv, ranks)
            if isinstance(piped, int):  # a later stage (or one of its TP ranks), stopped by stage 0
                if piped == 0:
                    ranks.close()
                return piped
            engine = piped
        else:
            engine = tp_engine(model_dir, ranks.group, cfg.engine)  # with MTP: the draft layer sharded too
        if not ranks.lead:
            try:
                return follow(engine, ranks)
            finally:
                if piped is not None:
                    piped.close()
        ranked = RankedEngine(engine, ranks)
    elif cfg.pipeline.pp_size > 1:  # stage 0 of a colocated pipeline (pipeline/colocated.py) serves HTTP
        from dsakv.pipeline.colocated import start_pipeline

        piped = start_pipeline(model_dir, cfg.engine, cfg.pipeline, args._argv)
        if isinstance(piped, int):  # a stage process: its stage ran until stage 0 stopped it
            return piped
        engine = piped
    else:
        engine = open_engine(model_dir, cfg.engine)  # by the checkpoint's architecture (Engine or V4)
    name = args.served_model_name or model_dir.resolve().name
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
        cfg.engine.layout.elide,
        cfg.engine.layout.kv_format,
        cfg.engine.layout.index_format,
        "on" if engine.prefix_cache is not None else "off",
    )
    backend = EngineBackend(ranked if ranked is not None else engine)  # type: ignore[arg-type]
    app = create_app(backend, name, tokenizer, request_timeout=args.request_timeout)
    try:
        return run_http(app, args.host, args.port, args.log_level, limits=http_limits(args))
    finally:
        if ranked is not None or piped is not None:
            backend.stop()
        if ranked is not None:
            ranked.close()
        if piped is not None:
            piped.close()


def _dp_engine(args: argparse.Namespace, cfg: Config, model_dir: Any) -> Any:
    """Rank 0's DPServeEngine over --dp-size DP attention ranks (each its own pool, scheduler and requests, the MoE
    expert-parallel over all of them); on a rank r > 0 process: follow rank 0 until it stops, then the exit code."""
    import torch

    from dsakv.engine.dp import LockstepEngine
    from dsakv.engine.dp_serve import DPServeEngine, follow_dp
    from dsakv.engine.engine import Engine
    from dsakv.engine.ranks import start_ranks
    from dsakv.model.loader import load_config, load_model
    from dsakv.model.parallel import attach_ep, divide

    divide("n_routed_experts", int(load_config(model_dir).get("n_routed_experts") or 0), args.ep_size, "--ep-size")
    if cfg.pipeline.pp_size > 1:  # DP attention x PP: each DP rank a pipeline (pipeline/dp_stage.py)
        from dsakv.pipeline.dp_stage import reserve_stage_ports

        reserve_stage_ports(cfg.pipeline.pp_size)
    ranks = start_ranks(args.dp_size, args._argv, label="DP")
    if cfg.pipeline.pp_size > 1:
        from dsakv.pipeline.colocated import start_pipeline
        from dsakv.pipeline.dp_stage import pipeline_lockstep

        try:
            piped = start_pipeline(model_dir, cfg.engine, cfg.pipeline, args._argv, ranks, dp=True)
        except BaseException:
            for p in ranks.children:
                p.kill()
            raise
        if isinstance(piped, int):  # (d, s > 0): stopped by its stage 0; its stage's EP group leaves
            if piped == 0:
                ranks.close()
            return piped
        stepper = pipeline_lockstep(piped, ranks)
        return follow_dp(stepper, ranks) if not ranks.lead else DPServeEngine(stepper, ranks)
    try:
        spec, model = load_model(model_dir, dtype=getattr(torch, cfg.engine.dtype))
        engine = Engine((spec, attach_ep(model, ranks.rank, args.ep_size)), cfg.engine, model_dir=model_dir)
        lockstep = LockstepEngine(engine, ranks)
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise
    if not ranks.lead:
        return follow_dp(lockstep, ranks)
    return DPServeEngine(lockstep, ranks)


def validate(args: argparse.Namespace) -> None:
    """Refuse bad options before anything loads or binds (cli/validate.py); the checkpoint of roles that load one."""
    from dsakv.cli.validate import validate_checkpoint, validate_pool, validate_serve, validate_v4_checkpoint
    from dsakv.spec.v4 import is_v4

    validate_serve(args)
    v4 = bool(args.model) and is_v4(str(options.model_dir_of(args)))
    if args.role != "router" and v4:
        validate_v4_checkpoint(options.model_dir_of(args), args.role, args.page_size)
    elif args.role != "router":
        validate_pool(args, validate_checkpoint(options.model_dir_of(args)))
    elif v4:  # the router reads the vocabulary (and the tokenizer) only
        from dsakv.spec.v4 import V4Spec

        V4Spec.from_path(options.model_dir_of(args))
    elif args.model:
        validate_checkpoint(options.model_dir_of(args))


def bind_data_plane(args: argparse.Namespace) -> None:
    """Mooncake (KV transfer of decode/prefill, or the L3 store client) binds every interface: re-exec this process
    once under dsakv's bind shim so it listens on --host only (disagg/transfer/backends/bind_shim.py)."""
    transfer = args.role in ("decode", "prefill") and getattr(args, "transfer_backend", None) == "mooncake"
    store = args.role != "router" and getattr(args, "hicache_storage", None) == "mooncake"
    if transfer or store:
        from dsakv.disagg.transfer.backends.bind_shim import ensure_bound_to_host

        ensure_bound_to_host(args.host, "mooncake (KV transfer)" if transfer else "mooncake store client (L3)")


def run(args: argparse.Namespace) -> int:
    validate(args)
    setup_logging(args.log_level)
    bind_data_plane(args)
    cfg = options.config_from_args(args)
    if args.role == "colocated":
        return run_colocated(args, cfg)
    return int(disagg_roles.run_role(args, cfg) or 0)
