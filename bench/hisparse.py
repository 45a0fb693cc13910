"""HiSparse benchmark: what a decode holds at a fixed device budget, and swap-in copy speed.

    python bench/hisparse.py                                   # GLM-5.2, 64 GiB device, ratio 10, 2048-row buffers
    python bench/hisparse.py --part swap --threads 1            # on a shared (loaded) CPU
    python bench/hisparse.py --budget 96GiB --ratio 8 --context 131072 --buffer 2048 --requests 64 --topk 2048

Part 1 (capacity, planner figures): for plain (no HiSparse, elided), HiSparse with dense index-K (SGLang) and
HiSparse with elision: logical tokens, longest context one request can hold, concurrent requests of --context
tokens, device and host bytes. Part 2 (swap-in, the real HiSparsePool on CPU or CUDA): --requests requests of
--context tokens, a fresh random top-k of --topk positions per request (a fraction --reuse kept from the last
step) for one producer group of GLM-5.2 (a producer and its 3 shared layers); time of HiSparsePool.swap_in
against, in the same process, a baseline that copies the same missing rows one row at a time. Decode tok/s
through the model is not measured here (the model does not yet read rows through the pool).
"""

from __future__ import annotations

import argparse
import time

import torch

from dsakv.cache.hisparse import HiSparsePool
from dsakv.plan import Deployment, fmt_bytes, parse_size, plan
from dsakv.spec import KVLayout, load_spec
from dsakv.util import ceil_div


def capacity(args: argparse.Namespace) -> None:
    spec = load_spec(args.model)
    budget = parse_size(args.budget, "--budget")
    rp = plan(Deployment(spec, kv_budget=budget, hisparse_ratio=args.ratio, hisparse_buffer=args.buffer))
    hd, he = rp.hisparse_figures(False), rp.hisparse_figures(True)
    assert hd is not None and he is not None
    print(f"capacity: {spec.name}, device budget {fmt_bytes(budget)}, ratio {args.ratio:g}, buffer {args.buffer}")
    print(f"{'mode':<22}{'logical tokens':>16}{'requests@ctx':>14}{'device':>12}{'host':>12}")
    plain = rp.tokens_elided
    rows = [
        ("plain (elided)", plain, plain // args.context, budget, 0),
        (
            "HiSparse dense",
            hd.logical_tokens,
            min(hd.logical_tokens // args.context, hd.max_requests or 0),
            hd.device_bytes,
            hd.host_bytes,
        ),
        (
            "HiSparse + elision",
            he.logical_tokens,
            min(he.logical_tokens // args.context, he.max_requests or 0),
            he.device_bytes,
            he.host_bytes,
        ),
    ]
    for name, tokens, reqs, dev, host in rows:
        print(f"{name:<22}{tokens:>16,}{reqs:>14,}{fmt_bytes(dev):>12}{fmt_bytes(host):>12}")
    print(
        f"longest context of one request: plain {plain:,}, HiSparse dense {hd.logical_tokens:,}, "
        f"HiSparse+elision {he.logical_tokens:,} ({he.logical_tokens / plain:.2f}x plain, "
        f"{he.logical_tokens / hd.logical_tokens:.2f}x dense)"
    )


def swap_bench(args: argparse.Namespace) -> None:
    spec = load_spec(args.model)
    layout = KVLayout(spec, layer_start=2, layer_end=6, page_size=64)  # producer 2 and shared 3, 4, 5
    page = layout.page_size
    pages_per_req = ceil_div(args.context, page)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = HiSparsePool(layout, pages_per_req * args.requests, args.buffer, args.requests, device, pin_memory=True)
    for r in range(args.requests):
        pool.admit(r, range(r * pages_per_req, (r + 1) * pages_per_req), length=args.context)
    for t in pool._host.values():  # noqa: SLF001 - random host bytes, what a decode would have written
        t.random_(0, 256)
    g = torch.Generator().manual_seed(0)
    old = args.context - args.context % page or args.context - page
    last = {r: torch.randperm(old, generator=g)[: args.topk] for r in range(args.requests)}

    def next_topk() -> dict[int, torch.Tensor]:
        out = {}
        for r in range(args.requests):
            keep = last[r][: int(args.topk * args.reuse)]
            fresh = torch.randperm(old, generator=g)[: args.topk]
            out[r] = torch.cat((keep, fresh[~torch.isin(fresh, keep)]))[: args.topk]
            last[r] = out[r]
        return out

    steps = [next_topk() for _ in range(args.steps)]
    pool.swap_in(2, steps[0])  # warm the buffers
    t0 = time.perf_counter()
    rows = 0
    for topk in steps[1:]:
        pool.begin_step()
        rows += sum(pool.swap_in(2, topk).values())
    if device == "cuda":
        torch.cuda.synchronize()
    t_pool = time.perf_counter() - t0
    # baseline: the same number of rows, one row copy per row, per layer
    hot, host = pool.hot_tensor(2), pool._host_rows(2)  # noqa: SLF001
    n = rows // len(pool.groups[2])
    src = torch.randint(0, host.shape[0], (n,)).tolist()
    dst = torch.randint(0, hot.shape[0], (n,)).tolist()
    t0 = time.perf_counter()
    for layer in pool.groups[2]:
        hot, host = pool.hot_tensor(layer), pool._host_rows(layer)  # noqa: SLF001
        for s, d in zip(src, dst, strict=True):
            hot[d].copy_(host[s])
    if device == "cuda":
        torch.cuda.synchronize()
    t_loop = time.perf_counter() - t0
    nbytes = rows * pool.kv_row_bytes
    print(
        f"swap-in ({device}): {args.requests} requests x {args.context:,} tokens, top-k {args.topk}, reuse "
        f"{args.reuse:.0%}, {args.steps - 1} steps x 4 layers: {rows:,} rows ({fmt_bytes(nbytes)}), hit rate "
        f"{pool.stats.hit_rate:.1%}, {torch.get_num_threads()} torch threads"
    )
    print(
        f"  HiSparsePool.swap_in {t_pool * 1e3:.1f} ms ({nbytes / t_pool / 1e9:.2f} GB/s); row-by-row baseline "
        f"{t_loop * 1e3:.1f} ms ({nbytes / t_loop / 1e9:.2f} GB/s): {t_loop / t_pool:.1f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="glm-5.2")
    p.add_argument("--budget", default="64GiB", help="device KV budget")
    p.add_argument("--ratio", type=float, default=10.0, help="HiSparse host_to_device_ratio")
    p.add_argument("--buffer", type=int, default=2048, help="device_buffer_size (rows per layer per request)")
    p.add_argument("--context", type=int, default=16384, help="tokens per request")
    p.add_argument("--requests", type=int, default=4)
    p.add_argument("--topk", type=int, default=2048)
    p.add_argument("--reuse", type=float, default=0.8, help="fraction of the top-k kept from the last step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    p.add_argument("--part", choices=("both", "capacity", "swap"), default="both")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("both", "capacity"):
        capacity(args)
    if args.part in ("both", "swap"):
        swap_bench(args)


if __name__ == "__main__":
    main()
