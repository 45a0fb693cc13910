"""The native small-row matmul (model/native small_gemm) against the BLAS (torch.mm: MKL / oneDNN) and, at 1-4 rows,
`--compile`'s inductor GEMV, on the decode shapes of bench/engine.py's checkpoint: GFLOP/s with the weight cold
(one of enough copies to pass the last-level cache, as a decode step reads each weight once) and hot (the same
weight again). Each figure is the best of --rounds passes over the copies, the arms alternating within a round, so
they see the same load. Checks every arm's result against torch.mm first. Prints figures; asserts nothing.

    python bench/small_gemm.py [--rows 5,8,16] [--threads 1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from dsakv.model import gemv, native  # noqa: E402

# (N, K) of the bench checkpoint's decode matmuls: x projection, o_proj, an expert's gate | up, its down and the
# shared down, the q projection (a producer's), the LM head
SHAPES = ((744, 1024), (1024, 1024), (1024, 512), (2048, 384), (8192, 1024))
COLD_BYTES = 256 << 20  # the copies of one shape together: well past a 32 MiB L3


def arms(m: int, w0: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> dict[str, Callable[[torch.Tensor], object]]:
    out: dict[str, Callable[[torch.Tensor], object]] = {"torch.mm": lambda w: torch.mm(x, w.t(), out=y)}
    if native.lib() is not None:
        out["small_gemm"] = lambda w: native.small_gemm(x, w)
    if m <= gemv.ROWS:
        kern = gemv._kernel(m, w0)
        out["inductor"] = lambda w: kern([x, w])[0]  # [N, M]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="5,8,16", help="rows of x (comma-separated; small_gemm takes 1-16)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    gemv.use_compiled_gemv(True)
    print(f"load average at start (1, 5, 15 min): {', '.join(f'{v:.2f}' for v in os.getloadavg())}")
    print(f"{args.threads} thread(s); GFLOP/s, best of {args.rounds} rounds; cold: each call a weight not read since")
    rows = [int(v) for v in args.rows.split(",")]
    for m in rows:
        for n, k in SHAPES:
            copies = max(2, COLD_BYTES // (n * k * 4))
            ws = [torch.randn(n, k) for _ in range(copies)]
            x, y = torch.randn(m, k), torch.empty(m, n)
            ref = x @ ws[0].t()
            fs = arms(m, ws[0], x, y)
            for name, f in fs.items():
                got = f(ws[0])
                got = y if got is None else got
                assert isinstance(got, torch.Tensor)
                got = got if got.shape == ref.shape else got.t()
                err = float((got - ref).abs().max())
                if err > 1e-3 * float(ref.abs().max()):
                    raise SystemExit(f"{name} at m={m} n={n} k={k}: max error {err:.3g} against torch.mm")
            best = {(name, mode): float("inf") for name in fs for mode in ("cold", "hot")}
            for _ in range(args.rounds):
                for name, f in fs.items():
                    for mode in ("cold", "hot"):
                        t0 = time.perf_counter()
                        for i in range(copies):
                            f(ws[i] if mode == "cold" else ws[0])
                        dt = (time.perf_counter() - t0) / copies
                        best[name, mode] = min(best[name, mode], dt)
            flops = 2 * m * n * k
            gf = {key: flops / t / 1e9 for key, t in best.items()}
            cols = "  ".join(f"{name} {gf[name, 'cold']:5.1f} / {gf[name, 'hot']:5.1f}" for name in fs)
            print(f"m={m:2d} n={n:5d} k={k:5d} (cold / hot GF/s): {cols}", flush=True)
    print(f"load average at end (1, 5, 15 min): {', '.join(f'{v:.2f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()
