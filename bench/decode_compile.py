"""Decode with `--compile` (model/gemv.py's compiled GEMV for 1-2 row matmuls) against eager, and 2 torch threads
against 1, on bench/engine.py's compute-bound checkpoint (--shape bench: 148M parameters, 74M active a token, fp32
weights, fp32 cache), one process, interleaved rounds.

    python bench/decode_compile.py [--rounds 5] [--batches 1,16] [--threads 1,2] [--decode-tokens 16] [--profile]

Per thread count and batch size each round runs bench/engine.py's decode_tps once eager and once compiled (the
kernel switched process-wide between them; its compile happens in a warm-up first), and records tokens per
second by wall clock and by process CPU time (at 1 thread CPU time is what a busy shared box distorts least; at 2
threads a waiting OpenMP thread spins on CPU time, so read the wall clock there). Prints medians, min..max, the
per-round compiled/eager ratio and the 2-thread/1-thread ratio, and `cat /proc/loadavg`-style load averages
beside them. Greedy tokens of both arms (4 prompts of 64, 16 tokens) are compared first. --profile adds a
torch.profiler table of 8 decode steps at batch 1, 1 thread, each arm (ATen ops per step, top ops by self CPU).
Asserts nothing about time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine as be  # noqa: E402  bench/engine.py: the checkpoint shape, make_engine, decode_tps

from dsakv.engine.sampling import SamplingParams  # noqa: E402
from dsakv.model.gemv import use_compiled_gemv  # noqa: E402
from dsakv.model.loader import load_model  # noqa: E402
from dsakv.model.tiny import make_tiny  # noqa: E402

FP32 = ("fp32", "fp32")


def _load() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def tokens(model: tuple, args: argparse.Namespace) -> list[list[int]]:
    eng = be.make_engine(model, True, 4, 64 + 17, args, FP32)
    return eng.generate(be.prompts(4, 64, model[0].vocab_size, seed=7), SamplingParams(max_new_tokens=16))


def profile(model: tuple, args: argparse.Namespace, steps: int = 8) -> str:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as prof

    eng = be.make_engine(model, True, 1, 64 + steps + 8, args, FP32)
    eng.add_request(be.prompts(1, 64, model[0].vocab_size, seed=101)[0], SamplingParams(max_new_tokens=steps + 6))
    for _ in range(5):  # prefill, then warm decode steps
        eng.step()
    with prof(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(steps):
            eng.step()
    ev = p.key_averages()
    n = sum(e.count for e in ev) / steps
    total = sum(e.self_cpu_time_total for e in ev) / steps / 1e3
    rows = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:10]
    out = [f"  {n:.0f} profiler events a step (ATen ops incl. nested), {total:.1f} ms self CPU a step (profiled)"]
    for e in rows:
        out.append(
            f"    {e.key:<34} {e.self_cpu_time_total / steps / 1e3:7.2f} ms/step  {e.count / steps:6.1f} calls/step"
        )
    return "\n".join(out)


def _rows(fig: dict[tuple[int, int, str, str], list[float]], thr: int, batches: list[int]) -> None:
    med = statistics.median
    for b in batches:
        for clock in ("wall", "cpu"):
            e, c = fig[(thr, b, "eager", clock)], fig[(thr, b, "compiled", clock)]
            r = sorted(x / y for x, y in zip(c, e, strict=True))
            print(
                f"{thr:>3}  {b:>5}  {clock:>5}  {med(e):>7.1f} ({min(e):.1f}..{max(e):.1f})  "
                f"{med(c):>7.1f} ({min(c):.1f}..{max(c):.1f})  x{med(r):.2f} ({r[0]:.2f}..{r[-1]:.2f})  "
                f"load {_load()}",
                flush=True,
            )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args(argv)
    args.kv_format, args.index_format, args.page_size = "fp32", "fp32", 64
    args.max_batch_tokens, args.decode_prompt_len = 2048, 64
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    print(f"load average at start (1, 5, 15 min): {_load()}")
    with tempfile.TemporaryDirectory(prefix="dsakv-compile-") as tmp:
        over = dict(be.BENCH_SHAPE)
        path = make_tiny(Path(tmp) / "bench", arch="glm_moe_dsa", seed=0, layers=be.BENCH_LAYERS, overrides=over)
        model = load_model(path)
        args.model_path = path
        torch.set_num_threads(1)
        eager = tokens(model, args)
        use_compiled_gemv(True)
        t0 = time.perf_counter()
        comp = tokens(model, args)  # also the warm-up: compiles the kernel's graphs
        for b in batches:
            be.decode_tps(model, True, b, args, FP32)
        print(f"compile warm-up {time.perf_counter() - t0:.0f} s; greedy tokens (4 prompts of 64, 16 tokens, fp32 "
              f"cache) compiled == eager: {comp == eager}")  # fmt: skip
        if args.profile:
            for on in (False, True):
                use_compiled_gemv(on)
                print(f"torch.profiler, batch 1, 1 thread, {'compiled' if on else 'eager'} (load {_load()}):")
                print(profile(model, args))
        fig: dict[tuple[int, int, str, str], list[float]] = {}
        loads = []
        print(
            f"\n8-layer bench checkpoint (glm_moe_dsa, 148M parameters, fp32 weights and cache), decode after prompts "
            f"of 64, {args.decode_tokens} timed steps a round; median of {args.rounds} interleaved rounds (min..max), "
            "tokens/s; ratio: median of the per-round ratios (min..max); each thread count's rows as it finishes"
        )
        head = f"{'thr':>3}  {'batch':>5}  {'clock':>5}  {'eager':>18}  {'compiled':>18}  {'compiled/eager':>20}"
        print(head)
        print("-" * len(head))
        for thr in threads:
            torch.set_num_threads(thr)
            for _ in range(args.rounds):
                for b in batches:
                    for arm in ("eager", "compiled"):
                        use_compiled_gemv(arm == "compiled")
                        wall = be.decode_tps(model, True, b, args, FP32)
                        fig.setdefault((thr, b, arm, "wall"), []).append(wall)
                        fig.setdefault((thr, b, arm, "cpu"), []).append(be.LAST_CPU_TPS[0])
                loads.append(_load())
                print(f"  threads {thr}: round done (load {loads[-1]})", file=sys.stderr)
            _rows(fig, thr, batches)
        use_compiled_gemv(False)
    med = statistics.median
    if len(threads) > 1:
        t1, t2 = threads[0], threads[-1]
        for b in batches:
            for arm in ("eager", "compiled"):
                one, two = med(fig[(t1, b, arm, "wall")]), med(fig[(t2, b, arm, "wall")])
                print(f"{t2} threads / {t1} thread, batch {b}, {arm}: x{two / one:.2f} (wall clock medians)")
    print(f"load average after each round: {' | '.join(loads)}")
    print(f"load average at end (1, 5, 15 min): {_load()}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
