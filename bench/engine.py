"""Engine throughput on the tiny checkpoint: prefill and decode tokens/s at batch 1 and 16, elision on vs off.

    python bench/engine.py [--kv-format fp8-656 --index-format fp8-132] [--threads 1] [--repeat 3]

Makes a tiny checkpoint in a temp dir (or uses --model DIR), then for each batch size and elision setting:
- prefill: B prompts of --prompt-len tokens, max_new_tokens=1, timed until all finish;
- decode: B prompts of --decode-prompt-len tokens; once every request has its first token, the
  remaining --decode-tokens steps are timed (decode tokens / s, all sequences together).
Best of --repeat runs, on and off alternating. Prints a table and the on/off ratio (elision changes memory, not compute:
the ratio should be ~1.0) with bytes per token and pool capacity at --budget. Never asserts on time.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

from dsakv.cli import options
from dsakv.engine.config import EngineConfig, LayoutConfig, PoolConfig, SchedulerConfig
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.plan.units import parse_size

log = logging.getLogger("bench.engine")
BENCH_LAYOUT = LayoutConfig(kv_format="fp8-656", index_format="fp8-132", page_size=64)


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def make_engine(model: tuple, elide: bool, batch: int, tokens_per_seq: int, args: argparse.Namespace) -> Engine:
    cfg = EngineConfig(
        layout=replace(options.layout_config(args), elide=elide),
        pool=PoolConfig(max_tokens=batch * (tokens_per_seq + args.page_size)),
        scheduler=SchedulerConfig(args.max_batch_tokens, max_running_requests=min(64, args.max_batch_tokens)),
    )
    return Engine(model, cfg)


def prefill_tps(model: tuple, elide: bool, batch: int, args: argparse.Namespace) -> float:
    eng = make_engine(model, elide, batch, args.prompt_len + 1, args)
    ps = prompts(batch, args.prompt_len, model[0].vocab_size, seed=batch)
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for p in ps:
        eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    eng.check_integrity()
    return batch * args.prompt_len / dt


def decode_tps(model: tuple, elide: bool, batch: int, args: argparse.Namespace) -> float:
    eng = make_engine(model, elide, batch, args.decode_prompt_len + args.decode_tokens + 1, args)
    ps = prompts(batch, args.decode_prompt_len, model[0].vocab_size, seed=100 + batch)
    sp = SamplingParams(max_new_tokens=args.decode_tokens + 1, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ps]
    started: set[str] = set()
    while len(started) < len(ids):  # prefill until every request has its first token
        started.update(o.request_id for o in eng.step() if o.new_token_ids)
    before = eng.stats().decode_tokens
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    eng.check_integrity()
    return (eng.stats().decode_tokens - before) / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: make a tiny one in a temp dir)")
    ap.add_argument("--arch", default="glm_moe_dsa", choices=("glm_moe_dsa", "deepseek_v32"))
    options.add_layout_arguments(ap, BENCH_LAYOUT, elide=False)  # both elision settings run
    ap.add_argument("--batches", default="1,16", help="batch sizes (default 1,16)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prefill prompt length (default 256)")
    ap.add_argument("--decode-prompt-len", type=int, default=64, help="decode prompts' length (default 64)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steady on a busy box)")
    ap.add_argument("--budget", default="1GiB", help="KV budget for the capacity column (default 1GiB)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]

    with tempfile.TemporaryDirectory(prefix="dsakv-bench-") as tmp:
        path = Path(args.model) if args.model else make_tiny(Path(tmp) / "tiny", arch=args.arch, seed=0)
        model = load_model(path)
        spec = model[0]
        budget = parse_size(args.budget)
        print(
            f"engine throughput: {spec.name} ({spec.num_layers} layers, producers {list(spec.producers)}), "
            f"kv {args.kv_format}, index {args.index_format}, page {args.page_size}, "
            f"torch threads {torch.get_num_threads()}, best of {args.repeat}"
        )
        print(
            f"prefill: prompts of {args.prompt_len} tokens; decode: prompts of {args.decode_prompt_len}, "
            f"{args.decode_tokens} timed tokens per sequence"
        )
        prefill_tps(model, True, 1, args)  # warm-up
        rows = []
        for batch in batches:
            best: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}
            for _ in range(args.repeat):  # on and off alternate, so a busy moment hits both alike
                for elide in (True, False):
                    best[elide][0] = max(best[elide][0], prefill_tps(model, elide, batch, args))
                    best[elide][1] = max(best[elide][1], decode_tps(model, elide, batch, args))
            for elide in (True, False):
                layout = make_engine(model, elide, 1, 1, args).layout
                cap = budget // layout.bytes_per_token // args.page_size * args.page_size
                rows.append((batch, elide, best[elide][0], best[elide][1], layout.bytes_per_token, cap))
            print(f"  batch {batch:>3}: done", file=sys.stderr)

    head = f"{'batch':>5}  {'elide':>5}  {'prefill tok/s':>13}  {'decode tok/s':>12}  {'B/token':>8}  "
    head += f"{'tokens in ' + args.budget:>16}"
    print()
    print(head)
    print("-" * len(head))
    for batch, elide, pre, dec, bpt, cap in rows:
        print(f"{batch:>5}  {'on' if elide else 'off':>5}  {pre:>13,.0f}  {dec:>12,.1f}  {bpt:>8,}  {cap:>16,}")
    print()
    print("ratio elision on / off (same process, same inputs):")
    for batch in batches:
        on = next(r for r in rows if r[0] == batch and r[1])
        off = next(r for r in rows if r[0] == batch and not r[1])
        print(
            f"  batch {batch:>3}: prefill x{on[2] / off[2]:.3f}, decode x{on[3] / off[3]:.3f}, "
            f"bytes/token x{on[4] / off[4]:.3f}, capacity x{on[5] / off[5]:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
