"""Decode ops per step and tokens per CPU-second: this tree against a baseline git revision, interleaved rounds.

Builds bench/engine.py's compute-bound checkpoint (--shape bench, 148M parameters, fp32) once, then runs two
worker processes on it, one importing dsakv from this tree's src/ and one from `--baseline` (default main,
extracted with `git archive` into a temp dir); both use this tree's bench/engine.py (make_engine, decode_tps).
Per batch size the workers alternate, one round each at a time, and each round times its own decode steps by
process CPU time (time.process_time: what a busy shared box distorts least), so both arms see the same load.
Each worker also counts the ATen ops of 4 decode steps (a TorchDispatchMode counter: every op the dispatcher
sees, views included) and lists the most frequent, and reports its greedy tokens (fp32 cache), checked equal
across the arms before any figure is printed. Prints figures; asserts nothing about time.

    python bench/decode_ops.py [--baseline main] [--rounds 5] [--batches 1,16] [--decode-tokens 16]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _load() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


# ---- worker: one arm, commands on stdin, one JSON line per answer on stdout -------------------------------------


def worker(path: str, threads: int, compile_decode: bool = False, cache: str = "fp8") -> None:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    sys.path.insert(0, str(ROOT / "bench"))
    import engine as be  # this tree's bench/engine.py, dsakv from PYTHONPATH

    from dsakv.engine.sampling import SamplingParams
    from dsakv.model.loader import load_model

    torch.set_num_threads(threads)
    if compile_decode:  # --compile: model/gemv.py's kernels, process-wide (as `dsakv generate --compile`)
        from dsakv.model.gemv import use_compiled_gemv

        use_compiled_gemv(True)
    model = load_model(path)
    args = argparse.Namespace(
        model_path=Path(path),
        kv_format="fp32" if cache == "fp32" else "fp8-656",
        index_format="fp32" if cache == "fp32" else "fp8-132",
        page_size=64,
        max_batch_tokens=2048,
        decode_prompt_len=64,
        decode_tokens=16,
    )

    class Count(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: collections.Counter[str] = collections.Counter()

        def __torch_dispatch__(self, func, types, a=(), kw=None):  # type: ignore[no-untyped-def]
            self.ops[func.overloadpacket.__name__] += 1
            return func(*a, **(kw or {}))

    def ops(batch: int) -> dict[str, float]:
        eng = be.make_engine(model, True, batch, 64 + 16, args)
        for p in be.prompts(batch, 64, model[0].vocab_size, seed=7):
            eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True))
        for _ in range(3):  # prefill and the first decode steps
            eng.step()
        c = Count()
        with c:
            for _ in range(4):
                eng.step()
        return {k: v / 4 for k, v in c.ops.most_common()}

    for line in sys.stdin:
        cmd = json.loads(line)
        out: dict[str, Any]
        if cmd["op"] == "ops":
            out = {"ops": ops(cmd["batch"])}
        elif cmd["op"] == "tokens":
            ps = be.prompts(cmd["batch"], 64, model[0].vocab_size, seed=3)
            out = {"tokens": be.dsakv_tokens(model, ps, cmd["n"], args)}
        else:  # "round"
            args.decode_tokens = cmd["decode_tokens"]
            wall = be.decode_tps(model, True, cmd["batch"], args)
            out = {"wall_tps": wall, "cpu_tps": be.LAST_CPU_TPS[0]}
        print(json.dumps(out), flush=True)


# ---- parent -----------------------------------------------------------------------------------------------------


class Arm:
    def __init__(self, name: str, src: Path, ckpt: Path, threads: int, extra: list[str]) -> None:
        self.name = name
        env = dict(os.environ, PYTHONPATH=str(src))
        cmd = [sys.executable, __file__, "--worker", str(ckpt), "--threads", str(threads), *extra]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def ask(self, **cmd: Any) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name} worker exited ({self.proc.wait()})")
        return json.loads(line)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="main", help="git revision of the baseline arm (default main)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--decode-tokens", type=int, default=16, help="timed decode steps per round (default 16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arch", default="glm_moe_dsa", choices=("glm_moe_dsa", "deepseek_v32"))
    ap.add_argument("--compile", action="store_true", help="both arms with --compile (model/gemv.py's kernels)")
    ap.add_argument("--cache", default="fp8", choices=("fp8", "fp32"), help="KV and index-K cache format")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        worker(args.worker, args.threads, args.compile, args.cache)
        return 0
    extra = ["--cache", args.cache] + (["--compile"] if args.compile else [])
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "src"))
    import engine as be

    from dsakv.model.tiny import make_tiny

    batches = [int(b) for b in args.batches.split(",")]
    rev = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", args.baseline], capture_output=True, text=True, check=True
    ).stdout.strip()
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "src"], capture_output=True, text=True)
    print(f"load average at start (1, 5, 15 min): {_load()}")
    with tempfile.TemporaryDirectory(prefix="dsakv-decode-ops-") as tmp:
        base_root = Path(tmp) / "base"
        base_root.mkdir()
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.baseline, "src"], capture_output=True, check=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(base_root)], input=archive, check=True)
        ckpt = make_tiny(Path(tmp) / "bench", arch=args.arch, seed=0, layers=be.BENCH_LAYERS, overrides=be.BENCH_SHAPE)
        mine = f"this tree ({head}{', src modified' if dirty.stdout.strip() else ''})"
        arms = [
            Arm(f"baseline {args.baseline} ({rev})", base_root / "src", ckpt, args.threads, extra),
            Arm(mine, ROOT / "src", ckpt, args.threads, extra),
        ]
        try:
            toks = [a.ask(op="tokens", batch=4, n=16)["tokens"] for a in arms]
            same = toks[0] == toks[1]
            print(f"greedy tokens (4 prompts of 64, 16 tokens, fp32 cache) identical across the arms: {same}")
            if not same:
                print(f"  {arms[0].name}: {toks[0][0]}\n  {arms[1].name}: {toks[1][0]}")
                return 1
            ops = {b: [a.ask(op="ops", batch=b)["ops"] for a in arms] for b in batches}
            cpu: dict[int, list[list[float]]] = {b: [[], []] for b in batches}
            loads: list[str] = []
            for r in range(args.rounds):
                for b in batches:
                    order = (0, 1) if r % 2 == 0 else (1, 0)  # alternate which arm goes first
                    for i in order:
                        cpu[b][i].append(arms[i].ask(op="round", batch=b, decode_tokens=args.decode_tokens)["cpu_tps"])
                loads.append(_load())
                print(f"  round {r + 1}/{args.rounds} done (load {loads[-1]})", flush=True)
        finally:
            for a in arms:
                a.close()
    print(
        f"\n{be.BENCH_LAYERS}-layer bench checkpoint ({args.arch}, 148M parameters, fp32 weights, {args.cache} cache, "
        f"elision on{', --compile' if args.compile else ''}), {args.threads} torch thread(s); decode after prompts of "
        f"64, {args.decode_tokens} timed steps a round;"
        f" median of {args.rounds} interleaved rounds, decode tokens per process CPU-second (min..max)"
    )
    print(f"{'batch':>5}  {'arm':<36} {'ATen ops/step':>13}  {'tok/CPU-s':>9}  {'(min..max)':<15}  ratio")
    for b in batches:
        med = [statistics.median(cpu[b][i]) for i in (0, 1)]
        for i, a in enumerate(arms):
            n_ops = sum(ops[b][i].values())
            lo, hi = min(cpu[b][i]), max(cpu[b][i])
            ratio = f"x{med[1] / med[0]:.2f}" if i == 1 else ""
            print(f"{b:>5}  {a.name:<36} {n_ops:>13.0f}  {med[i]:>9.1f}  ({lo:.1f}..{hi:.1f}){'':<3}  {ratio}")
    for b in batches:
        for i, a in enumerate(arms):
            top = sorted(ops[b][i].items(), key=lambda kv: -kv[1])[:12]
            print(f"  batch {b}, {a.name}: " + ", ".join(f"{k} {v:.0f}" for k, v in top))
    print(f"load average after each round: {' | '.join(loads)}")
    print(f"load average at end (1, 5, 15 min): {_load()}")
    return 0


if __name__ == "__main__":
    t0 = time.perf_counter()
    rc = main()
    if "--worker" not in sys.argv:
        print(f"({time.perf_counter() - t0:.0f} s)")
    sys.exit(rc)
