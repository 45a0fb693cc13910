"""Host tier benchmark: offload / load bandwidth against a plain copy, and a multi-turn workload with the tier off/on.

    python bench/hicache.py                        # both parts, CPU (or CUDA when present)
    python bench/hicache.py --part transfer --model glm-5.2 --pages 64 --batch 32
    python bench/hicache.py --part workload --sessions 4 --turns 4 --device-tokens 256

Part 1 (transfer): a DevicePool of the model's elided layout; `--batch` scattered pages are offloaded to
scattered pages of a HostPool (each layout) and loaded back, and the same number of bytes is copied as one
plain contiguous tensor copy, in the same process: GB/s of each and the ratio to the plain copy.

Part 2 (workload): the tiny checkpoint (made in a temp dir unless --ckpt is given) serves `--sessions`
conversations of `--turns` turns each, round robin; every turn's prompt is the session's whole history plus
new user tokens, so prefixes are long and shared, and the device pool is too small to keep every session.
Runs with the prefix cache off, on (device only), and on with the host tier; prints the prefix hit rate,
mean time to first token, and the ratio of TTFT against the cache-off run. Never asserts on time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.host_pool import HOST_LAYOUTS, make_host_pool
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec


def _best(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def transfer(args: argparse.Namespace) -> None:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    spec = load_spec(args.model)
    layout = KVLayout(spec, kv_format=args.kv_format, index_format=args.index_format, page_size=args.page_size)
    pool = DevicePool(layout, args.pages, device=dev)
    for key in pool.keys:
        pool.tensor(key).random_(0, 256)
    rng = np.random.default_rng(0)
    dev_ids = np.sort(rng.choice(args.pages, args.batch, replace=False))
    host_ids = rng.permutation(2 * args.batch)[: args.batch]  # scattered host pages: no contiguous fast path
    nbytes = args.batch * layout.bytes_per_page
    print(
        f"transfer: {spec.name}, {len(layout.buffers)} buffers ({len(layout.producers)} producers own index-K), "
        f"{layout.bytes_per_page:,} B/page, {args.batch} of {args.pages} pages = {nbytes / 2**20:.1f} MiB, on {dev}"
    )
    src = torch.empty(nbytes, dtype=torch.uint8, device=dev).random_(0, 256)
    dst = torch.empty(nbytes, dtype=torch.uint8, pin_memory=dev == "cuda")
    t_d2h = _best(lambda: dst.copy_(src), args.repeat)
    t_h2d = _best(lambda: src.copy_(dst), args.repeat)
    print(f"  {'plain copy':<24} offload {nbytes / t_d2h / 1e9:7.2f} GB/s   load {nbytes / t_h2d / 1e9:7.2f} GB/s")
    for name in sorted(HOST_LAYOUTS):
        host = make_host_pool(name, layout, 2 * args.batch, pin_memory=dev == "cuda")
        t_off = _best(lambda h=host: h.offload(pool, dev_ids, host_ids), args.repeat)
        t_load = _best(lambda h=host: h.load(pool, host_ids, dev_ids), args.repeat)
        print(
            f"  {name:<24} offload {nbytes / t_off / 1e9:7.2f} GB/s ({t_d2h / t_off:5.2f}x plain)   "
            f"load {nbytes / t_load / 1e9:7.2f} GB/s ({t_h2d / t_load:5.2f}x plain)"
        )


def _workload(sessions: int, turns: int, system: int, user: int, seed: int) -> list[list[tuple[int, list[int]]]]:
    """Per round: (session, new user tokens); session 0.. share a system prompt."""
    rng = np.random.default_rng(seed)
    return [[(s, rng.integers(2, 500, user).tolist()) for s in range(sessions)] for _ in range(turns)]


def workload(args: argparse.Namespace) -> None:
    from dsakv.engine.engine import Engine
    from dsakv.engine.request import SamplingParams
    from dsakv.model.loader import load_model

    ckpt = args.ckpt
    tmp = None
    if ckpt is None:
        from dsakv.model.tiny import make_tiny

        tmp = tempfile.TemporaryDirectory()
        ckpt = str(make_tiny(Path(tmp.name) / "tiny"))
    spec, model = load_model(ckpt)
    rng = np.random.default_rng(args.seed)
    system = rng.integers(2, 500, args.system_tokens).tolist()
    rounds = _workload(args.sessions, args.turns, args.system_tokens, args.user_tokens, args.seed + 1)
    sp = SamplingParams(max_new_tokens=args.new_tokens)
    configs: list[tuple[str, dict[str, object]]] = [
        ("cache off", {}),
        ("device prefix cache", {"enable_prefix_cache": True}),
        (
            f"host tier x{args.hicache_ratio:g} {args.policy}",
            {"enable_prefix_cache": True, "hicache_ratio": args.hicache_ratio, "hicache_write_policy": args.policy},
        ),
    ]
    print(
        f"workload: {args.sessions} sessions x {args.turns} turns, system {args.system_tokens} + {args.user_tokens} "
        f"user tokens/turn, {args.new_tokens} new tokens, device pool {args.device_tokens} tokens, "
        f"page {args.page_size}"
    )
    base_ttft = None
    ref_outputs = None
    for label, kw in configs:
        eng = Engine(
            (spec, model),
            page_size=args.page_size,
            max_tokens=args.device_tokens,
            kv_format=args.kv_format,
            index_format=args.index_format,
            **kw,  # type: ignore[arg-type]
        )
        eng.generate([system[:8] + [3]], SamplingParams(max_new_tokens=1))  # warm-up (not cached: 9 tokens)
        history = [list(system) for _ in range(args.sessions)]
        ttfts, outputs = [], []
        for rnd in rounds:
            for s, new in rnd:
                prompt = history[s] + new
                t0 = time.perf_counter()
                rid = eng.add_request(prompt, sp)
                first = None
                out: list[int] = []
                while True:
                    for o in eng.step():
                        if o.request_id == rid:
                            if first is None and o.new_token_ids:
                                first = time.perf_counter() - t0
                            if o.finished:
                                out = list(o.output_ids)
                    if out:
                        break
                ttfts.append(first or 0.0)
                outputs.append(out)
                history[s] = prompt + out
        cache = getattr(eng, "prefix_cache", None)
        stats = cache.stats if cache is not None else None
        mean = float(np.mean(ttfts))
        base_ttft = base_ttft or mean
        ref_outputs = ref_outputs or outputs
        hit = (
            f"hit rate {stats.hit_rate:6.1%} (device {stats.device_hit_tokens}, host {stats.host_hit_tokens})"
            if stats
            else "hit rate    -  "
        )
        print(
            f"  {label:<32} {hit:<44} TTFT {mean * 1e3:7.1f} ms ({base_ttft / mean:5.2f}x vs off)  "
            f"outputs {'identical' if outputs == ref_outputs else 'DIFFER'}"
        )
        if stats is not None and stats.offload_pages:
            print(
                f"  {'':<32} offloaded {stats.offload_bytes / 2**20:.1f} MiB ({stats.offload_gbps:.2f} GB/s), loaded "
                f"{stats.load_bytes / 2**20:.1f} MiB ({stats.load_gbps:.2f} GB/s), device evictions "
                f"{stats.device_evicted_pages} pages"
            )
    if tmp is not None:
        tmp.cleanup()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["transfer", "workload", "both"], default="both")
    p.add_argument("--model", default="glm-5.2", help="preset for the transfer part")
    p.add_argument("--kv-format", default="fp8-656")
    p.add_argument("--index-format", default="fp8-132")
    p.add_argument("--page-size", type=int, default=None, help="default: 64 (transfer), 16 (workload)")
    p.add_argument("--pages", type=int, default=48, help="device pool pages (transfer)")
    p.add_argument("--batch", type=int, default=16, help="pages per offload/load (transfer)")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--ckpt", default=None, help="checkpoint dir for the workload (default: a fresh tiny one)")
    p.add_argument("--sessions", type=int, default=3)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--system-tokens", type=int, default=96)
    p.add_argument("--user-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=4)
    p.add_argument("--device-tokens", type=int, default=256)
    p.add_argument("--hicache-ratio", type=float, default=4.0)
    p.add_argument("--policy", default="write_through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (1 is fastest for the tiny model)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.part in ("transfer", "both"):
        a = argparse.Namespace(**vars(args))
        a.page_size = args.page_size or 64
        transfer(a)
    if args.part in ("workload", "both"):
        a = argparse.Namespace(**vars(args))
        a.page_size = args.page_size or 16
        if args.part == "both":
            a.kv_format, a.index_format = "fp32", "fp32"
        workload(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
