"""`dsakv plan`: capacity per role and PP stage, dense vs elided. No torch."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from typing import Any, TextIO

from dsakv.errors import ConfigError
from dsakv.plan import ROLES, Deployment, RolePlan, balance, fmt_bytes, parse_partition, parse_size, plan
from dsakv.plan.weights import WEIGHT_FORMATS, model_weight_bytes, weight_format_for
from dsakv.spec import INDEX_FORMATS, KV_FORMATS, PRESETS, load_spec
from dsakv.spec.v4 import V4_PRESETS, is_v4
from dsakv.spec.v4_layout import V4_KV_FORMATS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = (
        "examples:\n"
        "  dsakv plan glm-5.2 --role decode --kv-budget 96.33GiB --draft-layers 1\n"
        "  dsakv plan glm-5.2 --role prefill --pp 4 --pp-partition 20,20,20,18 --draft-layers 1 --kv-budget 98GiB\n"
        "  dsakv plan glm-5.2 --role prefill --pp 4 --draft-layers 1 --kv-budget 98GiB --balance\n"
        "  dsakv plan path/to/config.json --gpu-memory 141GB --mem-fraction 0.85 --tp 8 --weight-format fp8\n"
        "  dsakv plan glm-5.2 --role decode --kv-budget 96.33GiB --draft-layers 1 --tp 8 --dp 8 --enable-dp-attention\n"
        "  dsakv plan glm-5.2 --role decode --kv-budget 64GiB --hisparse-ratio 10 --hisparse-buffer 2048\n"
        "\n"
        "HiSparse (decode/colocated): the device holds index-K for every token of the logical pool plus the\n"
        "hot KV rows (per request --hisparse-buffer rows per layer + one page); the host holds the MLA KV of\n"
        "every token. device B/token = KV + ratio x index-K (every layer dense, producers only elided);\n"
        "logical tokens = ratio x device tokens.\n"
    )
    p.add_argument("model", help=f"preset ({', '.join([*PRESETS, *V4_PRESETS])}), a config.json, or a model directory")
    p.add_argument("--role", choices=ROLES, default="decode", help="which worker to plan (default: decode)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1; even split)")
    p.add_argument("--pp-partition", help="layers per stage, e.g. 20,20,20,18 (must sum to the layer count)")
    p.add_argument("--draft-layers", type=int, default=0, help="MTP/EAGLE draft layers held per stage (always full)")
    p.add_argument(
        "--draft-placement",
        choices=("every", "last"),
        default="every",
        help="which PP stages hold the draft layers: every (one set per stage, the seeds' accounting; default) or "
        "last (dsakv's engine: the draft needs the final hidden states); with pp > 1 both are shown",
    )
    p.add_argument(
        "--kv-format",
        choices=sorted({*KV_FORMATS, *V4_KV_FORMATS}),
        help="KV row format (default fp8-656; DeepSeek-V4: fp8-584)",
    )
    p.add_argument("--index-format", choices=INDEX_FORMATS, default="fp8-132", help="index-K format (default fp8-132)")
    p.add_argument(
        "--page-size", type=int, help="tokens per page (default 64; DeepSeek-V4: the HCA ratio, 128, or a multiple)"
    )
    v4 = p.add_argument_group("DeepSeek-V4 (per-request state)")
    v4.add_argument(
        "--max-running-requests",
        type=int,
        default=1,
        help="request slots of window ring + compressor state the pool reserves (default 1)",
    )
    v4.add_argument(
        "--hca-state",
        choices=("online", "ring"),
        default="online",
        help="HCA compressor state: one running slot (online softmax; default) or a ratio-slot ring",
    )
    v4.add_argument("--context-len", type=int, help="also print how many requests of this many tokens fit")
    mem = p.add_argument_group("memory (give --kv-budget, or --gpu-memory to estimate it)")
    mem.add_argument("--kv-budget", help="KV pool bytes per GPU, e.g. 96.33GiB")
    mem.add_argument("--gpu-memory", help="GPU memory, e.g. 141GB; budget = memory x fraction - weights (estimate)")
    mem.add_argument("--mem-fraction", type=float, default=0.85, help="mem_fraction_static (default 0.85)")
    mem.add_argument("--weight-format", choices=list(WEIGHT_FORMATS), help="weight precision for the estimate")
    ranks = p.add_argument_group("rank grid (KV latent and index-K replicated on every attention-TP rank)")
    ranks.add_argument("--tp", type=int, default=1, help="GPUs per stage sharing its weights (default 1)")
    ranks.add_argument(
        "--dp",
        type=int,
        default=1,
        help="DP groups per stage: with --enable-dp-attention, tp/dp attention ranks each with its own pool; "
        "without it, dp replicas of tp GPUs (default 1)",
    )
    ranks.add_argument(
        "--enable-dp-attention", action="store_true", help="attention data-parallel over the --dp groups of the tp GPUs"
    )
    ranks.add_argument("--ep", type=int, default=1, help="expert-parallel size of the MoE (divides --tp; default 1)")
    host = p.add_argument_group("host tier (HiCache)")
    host.add_argument("--hicache-ratio", type=float, help="host pool = ratio x device pool bytes")
    host.add_argument("--hicache-size", help="host pool bytes per GPU, e.g. 128GiB")
    host.add_argument(
        "--hicache-storage-size",
        help="L3 storage bytes for this deployment's pages (Mooncake Store / page files), e.g. 1TiB: tokens it holds",
    )
    hs = p.add_argument_group("HiSparse (decode keeps index-K for every token, KV rows on the host)")
    hs.add_argument(
        "--hisparse-ratio",
        type=float,
        help="logical pool tokens / device hot KV rows (SGLang's host_to_device_ratio), e.g. 10",
    )
    hs.add_argument(
        "--hisparse-buffer",
        type=int,
        help="device_buffer_size: hot rows per layer per request (one page is added); prints max requests",
    )
    p.add_argument("--balance", action="store_true", help="also propose the PP partition that maximises capacity")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _deployment(args: argparse.Namespace) -> Deployment:
    spec = load_spec(args.model)
    partition = parse_partition(args.pp_partition) if args.pp_partition else None
    if partition is not None and args.pp not in (1, len(partition)):
        raise ConfigError(f"--pp {args.pp} but --pp-partition {args.pp_partition} has {len(partition)} stages")
    if args.draft_layers < 0:
        raise ConfigError(f"--draft-layers {args.draft_layers} must be >= 0")
    return Deployment(
        spec=spec,
        role=args.role,
        pp=args.pp if partition is None else len(partition),
        partition=partition,
        draft_layers=args.draft_layers,
        draft_placement=args.draft_placement,
        kv_format=args.kv_format or "fp8-656",
        index_format=args.index_format,
        page_size=args.page_size or 64,
        kv_budget=parse_size(args.kv_budget, "--kv-budget") if args.kv_budget else None,
        gpu_memory=parse_size(args.gpu_memory, "--gpu-memory") if args.gpu_memory else None,
        mem_fraction=args.mem_fraction,
        weight_format=args.weight_format,
        tp=args.tp,
        dp=args.dp,
        enable_dp_attention=args.enable_dp_attention,
        ep=args.ep,
        hicache_ratio=args.hicache_ratio,
        hicache_size=parse_size(args.hicache_size, "--hicache-size") if args.hicache_size else None,
        hicache_storage_size=parse_size(args.hicache_storage_size, "--hicache-storage-size")
        if args.hicache_storage_size
        else None,
        hisparse_ratio=args.hisparse_ratio,
        hisparse_buffer=args.hisparse_buffer,
    )


def _pct(x: float) -> str:
    return f"{x * 100:+.1f}%"


def print_plan(rp: RolePlan, title: str, file: TextIO | None = None) -> None:
    """One row per PP stage (dense vs elided), the binding stage marked, then the worker's totals."""
    from rich.console import Console
    from rich.table import Table

    d = rp.deployment
    console = Console(width=max(Console().width, 200), file=file)
    t = Table(title=title, title_justify="left")
    for col, just in (
        ("stage", "right"),
        ("layers", "left"),
        ("producers", "right"),
        ("B/token dense", "right"),
        ("B/token elided", "right"),
        ("tokens dense", "right"),
        ("tokens elided", "right"),
        ("gain", "right"),
        ("", "left"),
    ):
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    show_host = any(s.host_tokens_elided is not None for s in rp.stages)
    if show_host:
        t.add_column("host tokens dense", justify="right")
        t.add_column("host tokens elided", justify="right")
    show_storage = any(s.storage_tokens_elided is not None for s in rp.stages)
    if show_storage:
        t.add_column("L3 tokens dense", justify="right")
        t.add_column("L3 tokens elided", justify="right")
    for s in rp.stages:
        mark = "◀ binding" if s.stage == rp.binding_elided and d.pp > 1 else ""
        layers = f"{s.layer_start}-{s.layer_end - 1}" + (f" +{s.draft_layers} draft" if s.draft_layers else "")
        row = [
            str(s.stage),
            layers,
            f"{len(s.producers)}/{s.num_layers}" + (f" +{s.draft_layers}" if s.draft_layers else ""),
            f"{s.bytes_per_token_dense:,}",
            f"{s.bytes_per_token_elided:,}",
            f"{s.tokens_dense:,}",
            f"{s.tokens_elided:,}",
            _pct(s.gain),
            mark,
        ]
        if show_host:
            row += [f"{s.host_tokens_dense or 0:,}", f"{s.host_tokens_elided or 0:,}"]
        if show_storage:
            row += [f"{s.storage_tokens_dense or 0:,}", f"{s.storage_tokens_elided or 0:,}"]
        t.add_row(*row)
    console.print(t)
    console.print(
        f"worker max_total_num_tokens: dense {rp.tokens_dense:,} (stage {rp.binding_dense} binds) -> "
        f"elided {rp.tokens_elided:,} (stage {rp.binding_elided} binds): [bold]{_pct(rp.gain)}[/bold]"
    )


def print_ranks(rp: RolePlan) -> None:
    """The rank grid: tokens and weights per rank, tokens per instance (one line each)."""
    d, g = rp.deployment, rp.deployment.grid
    weights = ", ".join(f"stage {s}: ~{fmt_bytes(d.rank_weight_bytes(s))}" for s in range(d.pp))
    print(f"ranks: {g.describe()}")
    print(
        f"  per rank: dense {rp.tokens_dense:,} / elided {rp.tokens_elided:,} tokens (full keys of its stage, "
        f"replicated over {g.attention_tp} attention-TP rank(s)); weights per rank (estimate) {weights}"
    )
    print(
        f"  per instance ({g.pools} pool(s)): dense {rp.instance_tokens_dense:,} / elided "
        f"{rp.instance_tokens_elided:,} tokens"
    )
    if any(d.rank_reform_headroom(s) for s in range(d.pp)):
        extra = ", ".join(f"stage {s}: ~{fmt_bytes(d.rank_reform_headroom(s))}" for s in range(d.pp))
        print(f"  re-form headroom (a survivor loads a dead EP rank's experts; leave it free): {extra}")


def print_hisparse(rp: RolePlan, file: TextIO | None = None) -> None:
    """HiSparse device and host figures per stage, dense index-K (SGLang) vs elided, then the worker's totals."""
    from rich.console import Console
    from rich.table import Table

    from dsakv.plan.capacity import HISPARSE_PREFILL_NOTE

    d = rp.deployment
    console = Console(width=max(Console().width, 200), file=file)
    hd, he = rp.hisparse_figures(False), rp.hisparse_figures(True)
    if hd is None or he is None:
        console.print(f"HiSparse ratio {d.hisparse_ratio:g}: not applied to role {d.role}: {HISPARSE_PREFILL_NOTE}")
        return
    t = Table(title=f"HiSparse ratio {d.hisparse_ratio:g} (device / host per stage)", title_justify="left")
    cols = [
        ("stage", "right"),
        ("index-K", "left"),
        ("device B/token", "right"),
        ("device tokens", "right"),
        ("logical tokens", "right"),
        ("device bytes", "right"),
        ("host bytes", "right"),
    ]
    if d.hisparse_buffer is not None:
        cols.append(("requests", "right"))
    for col, just in cols:
        t.add_column(col, justify=just)  # type: ignore[arg-type]
    for s in rp.stages:
        for name, f in (("dense", s.hisparse_dense), ("elided", s.hisparse_elided)):
            assert f is not None
            row = [
                str(s.stage),
                name,
                f"{f.device_bytes_per_token:,}",
                f"{f.device_tokens:,}",
                f"{f.logical_tokens:,}",
                fmt_bytes(f.device_bytes),
                fmt_bytes(f.host_bytes),
            ]
            if f.max_requests is not None:
                row.append(f"{f.max_requests:,}")
            t.add_row(*row)
    console.print(t)
    req = ""
    if he.max_requests is not None and hd.max_requests is not None:
        req = f"; requests with {d.hisparse_buffer}-row buffers: {hd.max_requests:,} -> {he.max_requests:,}"
    console.print(
        f"HiSparse worker logical tokens: dense index-K {hd.logical_tokens:,} -> elided {he.logical_tokens:,}: "
        f"[bold]{_pct(he.logical_tokens / hd.logical_tokens - 1.0)}[/bold]; host bytes "
        f"{fmt_bytes(hd.host_bytes)} -> {fmt_bytes(he.host_bytes)}{req}"
    )


def plan_data(args: argparse.Namespace) -> dict[str, Any]:
    """What `dsakv plan --json` prints, as data (dsakv.plan returns it): the role's plan, the other draft placement
    when pp > 1 with drafts, the balanced partition with --balance; a DeepSeek-V4 model's plan."""
    if is_v4(args.model):
        from dsakv.cli.plan_v4 import deployment
        from dsakv.plan.v4 import plan_v4

        return plan_v4(deployment(args)).to_dict()
    d = _deployment(args)
    rp, bal, other = _plans(args, d)
    out = rp.to_dict()
    if other is not None:
        out["other_draft_placement"] = {
            "draft_placement": other.deployment.draft_placement,
            "binding_stage_elided": other.binding_elided,
            "max_total_num_tokens_elided": other.tokens_elided,
        }
    if bal is not None:
        out["balance"] = {
            "partition": list(bal.balanced.deployment.partition or ()),
            "plan": bal.balanced.to_dict(),
            "gain_over_baseline": round(bal.gain_over_baseline, 6),
        }
    return out


def _plans(args: argparse.Namespace, d: Deployment) -> tuple[RolePlan, Any, RolePlan | None]:
    rp = plan(d)
    bal = balance(d) if args.balance else None
    other = None
    if d.pp > 1 and d.draft_layers:
        other = plan(replace(d, draft_placement="last" if d.draft_placement == "every" else "every"))
    return rp, bal, other


def run(args: argparse.Namespace) -> int:
    if args.json:
        json.dump(plan_data(args), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    if is_v4(args.model):
        from dsakv.cli.plan_v4 import run_v4

        return run_v4(args)
    d = _deployment(args)
    rp, bal, other = _plans(args, d)
    spec = d.spec
    print(
        f"model {spec.name} ({spec.model_type}): {spec.num_layers} layers, {len(spec.producers)} producers, "
        f"{len(spec.shared_layers)} shared [{spec.ownership_source}]"
    )
    print(
        f"role {d.role}, pp {d.pp} ({','.join(map(str, d.partition or ()))}), draft layers/stage {d.draft_layers}, "
        f"KV {d.kv_format}, index-K {d.index_format}, page {d.page_size}"
    )
    if d.kv_budget is not None:
        print(f"KV budget per GPU: {fmt_bytes(d.kv_budget)} ({d.kv_budget:,} bytes)")
    else:
        wf = weight_format_for(spec, d.weight_format)
        print(
            f"KV budget per GPU: ESTIMATE = {fmt_bytes(d.gpu_memory or 0)} x {d.mem_fraction} - stage weights "
            f"(weights estimated from the config as {wf}, whole model {fmt_bytes(model_weight_bytes(spec, wf))}, "
            f"divided over tp={d.tp}); measure on the real engine before relying on it"
        )
        for s in rp.stages:
            print(
                f"  stage {s.stage}: weights ~{fmt_bytes(s.weight_bytes or 0)}, KV budget {fmt_bytes(s.budget_bytes)}"
            )
    print_plan(rp, f"{d.role} capacity")
    print_ranks(rp)
    if d.hisparse_ratio is not None:
        print()
        print_hisparse(rp)
    if other is not None:
        names = {
            "every": "a draft set on every stage (the seeds' accounting)",
            "last": "drafts on the last stage only (dsakv's engine)",
        }
        for r in (rp, other):
            print(
                f"draft placement {r.deployment.draft_placement}: {names[r.deployment.draft_placement]}: binding stage "
                f"{r.binding_elided}, {r.tokens_elided:,} tokens"
            )
    if bal is not None:
        print()
        part = ",".join(map(str, bal.balanced.deployment.partition or ()))
        print_plan(bal.balanced, f"balanced partition {part}")
        print(
            f"--balance: partition {part} gives {bal.balanced.tokens_elided:,} tokens vs "
            f"{bal.baseline.tokens_elided:,} with {','.join(map(str, d.partition or ()))}: "
            f"{_pct(bal.gain_over_baseline)}"
        )
    return 0
