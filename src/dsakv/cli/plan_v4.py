"""`dsakv plan` for DeepSeek-V4 (a V4 preset or config): per-kind bytes, per-request state, stages, SGLang."""

from __future__ import annotations

import argparse
import json
import sys
from fractions import Fraction
from typing import Any, TextIO

from dsakv.errors import ConfigError
from dsakv.plan.capacity import parse_partition
from dsakv.plan.units import fmt_bytes, parse_size
from dsakv.plan.v4 import V4Deployment, V4Plan, plan_v4
from dsakv.spec.v4 import CSA, HCA, WINDOW, load_v4_spec
from dsakv.spec.v4_layout import V4_KV_FORMATS


def _f(x: str | Fraction | float) -> str:
    return f"{float(Fraction(x)):,.2f}"


UNSUPPORTED = {
    "gpu_memory": "--gpu-memory (give --kv-budget)",
    "hicache_ratio": "--hicache-ratio",
    "hicache_size": "--hicache-size",
    "hicache_storage_size": "--hicache-storage-size",
    "hisparse_ratio": "--hisparse-ratio",
    "hisparse_buffer": "--hisparse-buffer",
}


def deployment(args: argparse.Namespace) -> V4Deployment:
    spec = load_v4_spec(args.model)
    given = [flag for name, flag in UNSUPPORTED.items() if getattr(args, name, None) is not None]
    if args.balance:
        given.append("--balance")
    if given:
        raise ConfigError(
            f"{', '.join(given)}: not planned for DeepSeek-V4 yet; plan {spec.name} with --kv-budget, --pp-partition, "
            "--draft-layers, --index-format, --page-size, --max-running-requests, --hca-state, --context-len"
        )
    kv_format = args.kv_format or "fp8-584"
    if kv_format not in V4_KV_FORMATS:
        raise ConfigError(
            f"--kv-format {kv_format} is an MLA format: DeepSeek-V4 uses one of {', '.join(V4_KV_FORMATS)}"
        )
    partition = parse_partition(args.pp_partition) if args.pp_partition else None
    if partition is None and args.pp > 1:
        base, extra = divmod(spec.num_layers, args.pp)
        partition = tuple(base + (1 if i < extra else 0) for i in range(args.pp))
    if partition is not None and args.pp not in (1, len(partition)):
        raise ConfigError(f"--pp {args.pp} but --pp-partition {args.pp_partition} has {len(partition)} stages")
    return V4Deployment(
        spec=spec,
        partition=partition,
        draft_layers=args.draft_layers,
        kv_format=kv_format,
        index_format=args.index_format,
        page_size=args.page_size,
        hca_state=args.hca_state,
        kv_budget=parse_size(args.kv_budget, "--kv-budget") if args.kv_budget else None,
        max_running=args.max_running_requests,
        context_len=args.context_len,
    )


def _table(title: str, cols: list[str], rows: list[list[str]], file: TextIO | None) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for i, c in enumerate(cols):
        t.add_column(c, justify="left" if i == 0 or c in ("layers", "buys") else "right")
    for r in rows:
        t.add_row(*r)
    Console(width=220, file=file).print(t)


def print_v4(rp: V4Plan, file: TextIO | None = None) -> None:
    out = file or sys.stdout
    d = rp.deployment
    info = rp.to_dict()
    s = d.spec
    whole = d.layout(0) if d.pp == 1 else V4Deployment(**{**d.__dict__, "partition": None}).layout(0)
    n = {t: len(s.layers_of(t)) for t in (WINDOW, CSA, HCA)}
    print(
        f"model {s.name} ({s.model_type}): {s.num_layers} layers = {n[WINDOW]} window-only + {n[CSA]} CSA "
        f"(ratio {s.csa_ratio}) + {n[HCA]} HCA (ratio {s.hca_ratio}), {s.num_draft_layers} MTP (window-only) "
        f"[{s.layer_types_source}]; window {s.sliding_window}",
        file=out,
    )
    print(
        f"KV {d.kv_format} ({whole.entry_bytes} B entry), index-K {d.index_format} ({whole.index_entry_bytes} B), "
        f"page {whole.page} tokens ({whole.page // s.csa_ratio} CSA entries, {whole.page // s.hca_ratio} HCA "
        f"entries per page: none straddles a page), HCA state {d.hca_state}, MTP layers held {d.draft_layers}",
        file=out,
    )
    rows = [
        [
            r["kind"],
            str(r["layers"]),
            str(r["entry_bytes"]),
            f"1 per {r['ratio']}",
            str(r["entries_per_page"]),
            _f(r["bytes_per_token"]),
        ]
        for r in info["kinds"]
    ]
    _table(
        "growing bytes per context token, each kind only on the layers that read it",
        ["kind", "layers", "entry B", "entries", "per page", "B/token"],
        rows,
        out,
    )
    fig = info["figures"]
    print(
        f"B/token: {_f(fig['by_read_fp8'])} (fp8 indexer) / {_f(fig['by_read_fp4'])} (fp4 indexer); "
        f"every kind on every layer {_f(fig['every_layer_fp8'])}; V3.2-style dense (every token's KV + index-K "
        f"on every layer) {int(fig['dense_v32_style']):,}",
        file=out,
    )
    srows = []
    for r in info["states"]:
        extra = ""
        if "mode" in r:
            other = "ring" if r["mode"] == "online" else "online"
            alt = r[f"bytes_per_request_{other}"]
            extra = f"{r['mode']}; as a {s.hca_ratio}-slot ring {alt:,}" if other == "ring" else f"ring; online {alt:,}"
        srows.append(
            [r["kind"], str(r["layers"]), f"{r['rows']} x {r['row_bytes']:,} B", f"{r['bytes_per_request']:,}", extra]
        )
    _table("per-request state (one slot per running request)", ["kind", "layers", "slot", "B/request", ""], srows, out)
    per_req = whole.state_bytes_per_request
    print(
        f"state per request: {per_req:,} B ({fmt_bytes(per_req)}); x {d.max_running} running requests "
        f"(--max-running-requests) = {per_req * d.max_running:,} B, charged once per slot, not per token",
        file=out,
    )
    st_rows = []
    for sp in rp.stages:
        c = sp.counts()
        lay = sp.layout
        mark = "◀ binding" if d.pp > 1 and sp.stage == rp.binding else ""
        st_rows.append(
            [
                str(sp.stage),
                lay.describe_range(),
                f"{c[WINDOW]}/{c[CSA]}/{c[HCA]}",
                _f(lay.bytes_per_token),
                f"{lay.bytes_per_page:,}",
                f"{lay.state_bytes_per_request:,}",
                "-" if sp.tokens is None else f"{sp.tokens:,}",
                "-" if sp.requests_at_context is None else f"{sp.requests_at_context:,}",
                mark,
            ]
        )
    title = "per-stage capacity" + (f" (KV budget {fmt_bytes(d.kv_budget)} per GPU)" if d.kv_budget else "")
    ctx = f"requests at {d.context_len:,}" if d.context_len else "requests at ctx"
    _table(
        title,
        ["stage", "layers", "win/CSA/HCA", "B/token", "B/page", "state B/req", "tokens", ctx, ""],
        st_rows,
        out,
    )
    sg = info["sglang"]
    sg_rows = [
        [r["reservation"], _f(r["sglang_bpt"]), _f(r["dsakv_bpt"]), f"{r['dsakv_per_request']:,}", r["buys"]]
        for r in sg["rows"]
    ]
    sg_rows.append(["total", _f(sg["sglang_bpt"]), _f(sg["dsakv_bpt"]), f"{sg['dsakv_state_per_request']:,}", ""])
    _table(
        "beside SGLang's accounting (whole model, same budget)",
        ["reservation", "SGLang B/token", "dsakv B/token", "dsakv B/request", "buys"],
        sg_rows,
        out,
    )
    if "budget" in sg:
        print(
            f"on {fmt_bytes(sg['budget'])}: SGLang {sg['sglang_tokens']:,} tokens (its window pool serves "
            f"{sg['sglang_window_requests']:,} requests' windows) vs dsakv {sg['dsakv_tokens']:,} tokens with "
            f"{sg['slots']:,} request slots: {sg['gain'] * 100:+.1f}%",
            file=out,
        )


def run_v4(args: argparse.Namespace) -> int:
    d = deployment(args)
    rp = plan_v4(d)
    if args.json:
        json.dump(rp.to_dict(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print_v4(rp)
    return 0


def summary(rp: V4Plan) -> dict[str, Any]:
    return rp.to_dict()
