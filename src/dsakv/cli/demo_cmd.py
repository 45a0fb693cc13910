"""`dsakv demo`: one command, the whole disaggregated system on 127.0.0.1, checked against a colocated engine.

    dsakv demo            # tiny checkpoint, 2 PP prefill stages + decode (host tier) + router on :8000,
                          # a checked batch of requests, capacity and transfer tables, then a clean shutdown
    dsakv demo --serve    # the same, then keep serving until Ctrl-C
    dsakv demo --json     # a JSON summary as the last stdout line (the narrative goes to stderr)
    dsakv demo --speculative-num-steps 2   # MTP in PD: the tiny checkpoint gets a fitted MTP layer (make-tiny --mtp 1
                          # --fit-mtp), the prefill's last stage sends the draft layer's KV, the decode speculates

It makes a tiny GLM-5.2-shaped checkpoint (or uses --model), starts `dsakv serve --role decode`, `--role prefill
--pp-size N` and `--role router` as child processes (each in its own process group, logs under --log-dir), waits
for the router's /health, then sends a batch of concurrent greedy completions and a streamed chat, checks every
request's tokens against a colocated Engine (same checkpoint, layout and host tier), prints the capacity plan and
the KV each PP stage moved to decode, sends request 0 again and prints the prefill's prefix-cache hits (the
prefill runs with --prefix-cache, and the host tier with --host-tier, unless --no-prefill-prefix-cache), reads
/metrics and the decode worker's integrity. Every child is stopped on exit; the exit code is 0 iff every check passed.
Imports torch only inside run() (for make-tiny and the colocated reference).
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsakv.cli import options
from dsakv.cli.demo_script import DEMO_LAYOUT, HOST_TIER_RATIO, _say, _script, demo_engine_config, demo_prompts
from dsakv.errors import ConfigError
from dsakv.util.procs import Proc, dsakv_cmd, free_ports, port_free

if TYPE_CHECKING:
    pass


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Start a tiny disaggregated deployment on 127.0.0.1 (PP prefill stages, a decode worker, an OpenAI-"
        "compatible router), send a few requests through it, and check its tokens against a colocated engine."
    )
    p.epilog = (
        "examples:\n"
        "  dsakv demo\n"
        "  dsakv demo --json --port 0\n"
        "  dsakv demo --serve            # keep the deployment up after the checks\n"
        "  dsakv demo --pp-size 3 --transfer-backend nixl --no-elide\n"
        "  dsakv demo --speculative-num-steps 2   # MTP speculative decoding on the decode, draft KV from prefill\n"
        "\n"
        "with --serve:   curl -s localhost:8000/v1/completions -H 'content-type: application/json' \\\n"
        '                  -d \'{"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}\''
    )
    p.add_argument("--model", metavar="DIR", help="checkpoint (default: `dsakv make-tiny` into --log-dir)")
    p.add_argument("--port", type=int, default=8000, help="router HTTP port (default 8000; 0 = any free port)")
    p.add_argument("--pp-size", type=int, default=2, help="prefill pipeline stages, one process each (default 2)")
    options.add_backend_argument(p)
    options.add_layout_arguments(p, DEMO_LAYOUT)
    p.add_argument("--num-pages", type=int, default=256, help="pages per worker pool (default 256)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per demo request (default 16)")
    p.add_argument("--startup-timeout", type=float, default=180.0, help="seconds to wait for the workers (180)")
    p.add_argument("--log-dir", default=None, help="child logs and the tiny checkpoint (default: a temp dir)")
    p.add_argument("--requests", type=int, default=8, help="concurrent completions in the checked batch (default 8)")
    p.add_argument(
        "--host-tier",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=f"host tier (HiCache, write_back, ratio {HOST_TIER_RATIO:g}) on the decode worker and the reference (on)",
    )
    p.add_argument(
        "--prefill-prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefix cache on the PP prefill worker (serve --role prefill --prefix-cache, plus the host tier with "
        "--host-tier; on)",
    )
    options.add_speculative_argument(
        p,
        " (on the prefill and decode workers: the prefill's last stage sends the draft layer's KV and hidden state, "
        "the decode speculates; the made tiny checkpoint then gets an MTP layer fitted on fit_prompts, two of which "
        "join the checked batch; the colocated reference runs without MTP)",
    )
    p.add_argument("--serve", action="store_true", help="after the checks, keep serving until Ctrl-C")
    p.add_argument("--once", action="store_true", help=argparse.SUPPRESS)  # the default since --serve exists
    p.add_argument("--json", action="store_true", help="print a JSON summary as the last line")


def _wait_ready(url: str, children: list[Proc], timeout: float) -> dict[str, Any]:
    import httpx

    end = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < end:
        for c in children:
            if not c.alive():
                raise ConfigError(f"the {c.name} process exited during startup; its log ({c.log}):\n{c.tail()}")
        try:
            r = httpx.get(f"{url}/health", timeout=5)
            last = r.json()
            if r.status_code == 200 and last.get("ok"):
                return dict(last)
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.25)
    logs = "\n".join(f"--- {c.name} ({c.log})\n{c.tail()}" for c in children)
    raise ConfigError(f"the deployment was not ready within {timeout:g} s (last /health: {last!r})\n{logs}")


def _print_capacity(args: argparse.Namespace, spec: Any) -> None:
    """The planner's tables for this deployment: same bytes for dense and elided, per role and stage."""
    from dsakv.cli.plan_cmd import print_plan
    from dsakv.plan import Deployment, plan

    lay = options.layout_config(args, DEMO_LAYOUT)
    full = replace(lay, elide=True).layout(spec)
    budget = args.num_pages * full.bytes_per_page
    out = sys.stderr if args.json else sys.stdout
    common: dict[str, Any] = {"kv_format": lay.kv_format, "index_format": lay.index_format}
    common |= {"page_size": lay.page_size, "kv_budget": budget}
    _say(args, f"capacity at the decode pool's {budget:,} bytes per worker ({args.num_pages} elided pages):")
    print_plan(plan(Deployment(spec, role="decode", **common)), "decode", file=out)
    print_plan(
        plan(Deployment(spec, role="prefill", pp=args.pp_size, **common)), f"prefill, PP={args.pp_size}", file=out
    )


def run(args: argparse.Namespace) -> int:
    if args.pp_size < 1:
        raise ConfigError(f"--pp-size {args.pp_size} must be >= 1")
    if args.port == 0:
        args.port = free_ports(1)
    elif not port_free(args.port):
        raise ConfigError(f"port {args.port} on 127.0.0.1 is taken: pass --port N (or --port 0 for any free port)")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="dsakv-demo-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    if args.model:
        model_dir = Path(args.model)
        if not (model_dir / "config.json").is_file():
            raise ConfigError(f"--model {args.model!r} has no config.json: pass a checkpoint directory")
    else:
        from dsakv.model.tiny import make_tiny

        mtp = 1 if args.speculative_num_steps else 0
        model_dir = make_tiny(log_dir / ("tiny-mtp" if mtp else "tiny"), seed=0, mtp=mtp)
        if mtp:  # make-tiny --mtp 1 --fit-mtp: a draft worth running (deterministic, a few seconds on a CPU)
            from dsakv.engine.mtp_fit import fit_mtp

            fit_mtp(model_dir, num_prompts=16, steps=60)
    from dsakv.spec.model import ModelSpec

    spec = ModelSpec.from_path(model_dir)
    if args.speculative_num_steps and not spec.num_draft_layers:
        raise ConfigError(
            f"--speculative-num-steps {args.speculative_num_steps} needs an MTP layer, but --model {args.model} has "
            "num_nextn_predict_layers = 0: write one with `dsakv make-tiny DIR --mtp 1 --fit-mtp`, or drop --model"
        )
    layout = options.layout_config(args, DEMO_LAYOUT)
    lay = {e: replace(layout, elide=e).layout(spec) for e in (True, False)}
    prefill_port = free_ports(args.pp_size + 1)  # stage k on +k, the gloo rendezvous on +pp_size
    decode_port = free_ports(1)
    url = f"http://127.0.0.1:{args.port}"
    decode_cfg = demo_engine_config(args, args.host_tier)
    prefill_cfg = demo_engine_config(args, args.host_tier and args.prefill_prefix_cache)
    if args.prefill_prefix_cache:
        prefill_cfg = replace(prefill_cfg, cache=replace(prefill_cfg.cache, prefix_cache=True))
    if args.speculative_num_steps:  # both workers (the handshake refuses a mismatch); the reference runs without
        decode_cfg = replace(decode_cfg, speculative_num_steps=args.speculative_num_steps)
        prefill_cfg = replace(prefill_cfg, speculative_num_steps=args.speculative_num_steps)
    from dsakv.disagg.protocol.auth import launch_secret

    secret = launch_secret(log_dir / "cluster.secret")  # every role gets it; the demo's own health calls use it
    common = ["--threads", "1", "--transfer-backend", args.transfer_backend]
    dsakv = dsakv_cmd("serve", "--model", str(model_dir), "--cluster-secret-file", str(secret))
    specs = [
        ("decode", [*dsakv, "--role", "decode", "--port", str(decode_port), *options.engine_argv(decode_cfg), *common]),
        (
            "prefill",
            [
                *dsakv,
                *("--role", "prefill", "--port", str(prefill_port), "--pp-size", str(args.pp_size)),
                *options.engine_argv(prefill_cfg),
                *common,
            ],
        ),
        (
            "router",
            [
                *dsakv,
                "--role",
                "router",
                "--port",
                str(args.port),
                "--prefill",
                f"127.0.0.1:{prefill_port}",
                "--decode",
                f"127.0.0.1:{decode_port}",
            ],
        ),
    ]
    _say(
        args, f"dsakv demo: checkpoint {model_dir} ({spec.num_layers} layers, index-K producers {list(spec.producers)})"
    )
    _say(
        args,
        f"  KV bytes/token: {lay[True].bytes_per_token} elided vs {lay[False].bytes_per_token} dense "
        f"(x{lay[False].bytes_per_token / lay[True].bytes_per_token:.3f} tokens in the same memory); elision "
        f"{'on' if args.elide else 'off'}",
    )
    _say(
        args,
        f"  prefill: {args.pp_size} PP stage(s) on 127.0.0.1:{prefill_port}..{prefill_port + args.pp_size - 1}"
        f"; decode on 127.0.0.1:{decode_port}; KV transfer: {args.transfer_backend}"
        + (
            f"; MTP speculative decoding K={args.speculative_num_steps} (draft layer {spec.num_layers} on the last "
            "prefill stage and the decode)"
            if args.speculative_num_steps
            else ""
        ),
    )
    _say(args, f"  router (OpenAI API): {url}   logs: {log_dir}")
    _print_capacity(args, spec)
    children: list[Proc] = []
    summary: dict[str, Any] = {}
    stopping: list[int] = []

    def _on_term(signum: int, frame: Any) -> None:
        stopping.append(signum)
        raise KeyboardInterrupt

    from rich.console import Console

    console = Console(file=sys.stderr)
    old = signal.signal(signal.SIGTERM, _on_term)
    try:
        with console.status("starting decode, prefill stages and router") as status:
            for name, cmd in specs:
                children.append(Proc(name, cmd, log_dir / f"{name}.log").start())
            t0 = time.monotonic()
            status.update("waiting for the prefill-decode handshake (router /health)")
            health = _wait_ready(url, children, args.startup_timeout)
            _say(
                args,
                f"ready in {time.monotonic() - t0:.1f} s: {len(health.get('pairs', []))} prefill-decode pair(s) "
                f"handshaken, decode pool {health.get('pages_total')} pages",
            )
            summary = _script(args, url, model_dir, {"prefill": prefill_port, "decode": decode_port}, status)
        summary["log_dir"] = str(log_dir)
        if summary.get("ok"):
            _say(
                args,
                f"outputs matched: {summary['requests_matched']}/{summary['requests']} requests through the "
                "disaggregated deployment are identical to the colocated run",
            )
        else:
            _say(
                args,
                f"CHECK FAILED: {summary.get('requests_matched')}/{summary.get('requests')} requests matched "
                f"the colocated run; decode integrity {summary.get('decode_integrity')}; logs in {log_dir}",
            )
        if args.serve:
            _say(args, "\nserving until Ctrl-C; try:")
            _say(
                args,
                f"  curl -s {url}/v1/completions -H 'content-type: application/json' "
                '-d \'{"prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0}\'',
            )
            _say(
                args,
                f"  curl -sN {url}/v1/chat/completions -H 'content-type: application/json' -d "
                '\'{"messages": [{"role": "user", "content": "hi"}], "stream": true}\'',
            )
            _say(args, f"  curl -s {url}/metrics | grep dsakv_")
            while all(c.alive() for c in children):
                time.sleep(0.5)
            dead = [c for c in children if not c.alive()]
            raise ConfigError(f"the {dead[0].name} process exited; its log:\n{dead[0].tail()}")
    except KeyboardInterrupt:
        _say(args, "stopping")
    finally:
        for c in reversed(children):
            c.stop()
        signal.signal(signal.SIGTERM, old)
    if children:
        left = [c.name for c in children if c.alive()]
        _say(
            args,
            f"shut down: {len(children) - len(left)}/{len(children)} processes stopped"
            + (f", still alive: {left}" if left else ""),
        )
    if args.json and summary:
        print(json.dumps(summary), flush=True)
    if stopping or (args.serve and summary):
        return 0 if summary.get("ok", True) else 1
    return 0 if summary.get("ok") else 1


__all__ = ["add_arguments", "demo_prompts", "run"]  # demo_prompts: re-exported from demo_script
