"""HiSparse benchmark: what a decode holds at a fixed device budget, and swap-in copy speed.

    python bench/hisparse.py                                   # GLM-5.2, 64 GiB device, ratio 10, 2048-row buffers
    python bench/hisparse.py --part swap --threads 1            # on a shared (loaded) CPU
    python bench/hisparse.py --budget 96GiB --ratio 8 --context 131072 --buffer 2048 --requests 64 --topk 2048
    python bench/hisparse.py --part decode --threads 1           # real Engine decode, tiny checkpoint

Part 1 (capacity, planner figures): for plain (no HiSparse, elided), HiSparse with dense index-K (SGLang) and
HiSparse with elision: logical tokens, longest context one request can hold, concurrent requests of --context
tokens, device and host bytes. Part 2 (swap-in, the real HiSparsePool on CPU or CUDA): --requests requests of
--context tokens, a fresh random top-k of --topk positions per request (a fraction --reuse kept from the last
step) for one producer group of GLM-5.2 (a producer and its 3 shared layers); time of HiSparsePool.swap_in
against, in the same process, a baseline that copies the same missing rows one row at a time.

Part 3 (decode, a real Engine on a tiny checkpoint, fp32 formats): at one device budget (--decode-budget), for
plain (elided), HiSparse dense and HiSparse + elision, same process: logical tokens and the concurrent requests
of --decode-context (+ --decode-tokens) tokens each holds (requests admitted and run, not a formula); decode
tok/s of that many requests, and of the largest batch all three hold (same batch, by wall and by this process's
CPU time; "x plain" is plain's median decode-step CPU time over the mode's at that batch, the three engines
stepped in turn, one step each, so that a loaded shared box's swings hit every mode alike); the greedy tokens of
the common batch must be identical across the three (checked). The load average is printed with the figures.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch

from dsakv.cache.hisparse import HiSparsePool
from dsakv.plan import Deployment, fmt_bytes, parse_size, plan
from dsakv.spec import KVLayout, load_spec
from dsakv.testing.config import engine_config
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


def decode_bench(args: argparse.Namespace) -> dict:
    import tempfile
    from pathlib import Path

    from dsakv.engine.engine import Engine
    from dsakv.engine.request import SamplingParams
    from dsakv.model.loader import load_model
    from dsakv.model.tiny import make_tiny

    budget = parse_size(args.decode_budget, "--decode-budget")
    ctx, new = args.decode_context, args.decode_tokens
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_model(make_tiny(Path(tmp) / "tiny", seed=0))
    modes = {
        "plain (elided)": dict(elide=True),
        "HiSparse dense": dict(elide=False, hisparse=True),
        "HiSparse + elision": dict(elide=True, hisparse=True),
    }
    hs = dict(hisparse_device_buffer_size=args.decode_buffer, hisparse_host_to_device_ratio=args.ratio)

    def engine(opts: dict) -> Engine:
        kw = {**opts, **(hs if opts.get("hisparse") else {})}
        return Engine(
            loaded, engine_config(page_size=16, kv_budget=budget, max_batch_tokens=4096, max_running_requests=256, **kw)
        )

    def holds(eng: Engine) -> int:
        per = ceil_div(ctx + new, 16)
        n = eng.allocator.num_pages // per
        return min(n, eng.hisparse.max_requests) if eng.hisparse is not None else n

    def decode(eng: Engine, n: int) -> tuple[float, float, list[float], list[list[int]]]:
        """(decode tok/s by wall time, by this process's CPU time, CPU seconds of each decode step, the tokens) of
        n requests run together."""
        prompts = [torch.randint(2, 500, (ctx,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        ids = [eng.add_request(p, sp) for p in prompts]
        out: dict[str, list[int]] = {r: [] for r in ids}
        t0 = None
        timed = 0
        step_cpu: list[float] = []
        while eng.has_unfinished():
            c = time.process_time()
            for o in eng.step():
                out[o.request_id].extend(o.new_token_ids)
            if t0 is not None:
                step_cpu.append(time.process_time() - c)
            if t0 is None and all(out[r] for r in ids):  # every request has its first token: decode from here
                if eng.scheduler.num_running != n:
                    raise RuntimeError(f"only {eng.scheduler.num_running} of {n} requests run at once ({eng.stats()})")
                t0, c0, timed = time.perf_counter(), time.process_time(), sum(map(len, out.values()))
        assert t0 is not None
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        toks = sum(map(len, out.values())) - timed
        return toks / dt, toks / dc, step_cpu, [out[r] for r in ids]

    def lockstep(engs: dict[str, Engine], n: int) -> dict[str, tuple[float, float, list[float], list[list[int]]]]:
        """decode() of n requests on every engine at once, one step of each in turn: a swing of a shared box's load
        hits every mode's steps alike (the CPU seconds of each decode step are what "x plain" compares)."""
        prompts = [torch.randint(2, 500, (ctx,), generator=torch.Generator().manual_seed(i)).tolist() for i in range(n)]
        sp = SamplingParams(max_new_tokens=new, temperature=0.0, ignore_eos=True)
        ids = {name: [e.add_request(p, sp) for p in prompts] for name, e in engs.items()}
        out = {name: {r: [] for r in ids[name]} for name in engs}
        t0: dict[str, float] = {}
        wall = dict.fromkeys(engs, 0.0)
        cpu = dict.fromkeys(engs, 0.0)
        timed = dict.fromkeys(engs, 0)
        step_cpu: dict[str, list[float]] = {name: [] for name in engs}
        while any(e.has_unfinished() for e in engs.values()):
            for name, e in engs.items():
                if not e.has_unfinished():
                    continue
                w, c = time.perf_counter(), time.process_time()
                for o in e.step():
                    out[name][o.request_id].extend(o.new_token_ids)
                dw, dc = time.perf_counter() - w, time.process_time() - c
                if name in t0:
                    step_cpu[name].append(dc)
                    wall[name] += dw
                    cpu[name] += dc
                elif all(out[name][r] for r in ids[name]):  # every request has its first token: decode from here
                    if e.scheduler.num_running != n:
                        raise RuntimeError(f"only {e.scheduler.num_running} of {n} requests run at once ({e.stats()})")
                    t0[name] = w
                    timed[name] = sum(map(len, out[name].values()))
        res = {}
        for name in engs:
            toks = sum(map(len, out[name].values())) - timed[name]
            res[name] = (toks / wall[name], toks / cpu[name], step_cpu[name], [out[name][r] for r in ids[name]])
        return res

    engines = {name: engine(opts) for name, opts in modes.items()}
    cap = {name: holds(e) for name, e in engines.items()}
    common = min(cap.values())
    rows, same = [], []
    best: dict[str, list[float]] = {name: [0.0, 0.0, 0.0] for name in engines}
    steps: dict[str, list[float]] = {name: [] for name in engines}
    load0 = os.getloadavg()[0]
    for rep in range(args.repeat):  # modes interleaved step by step, best of --repeat (a shared box's load swings)
        at_common = lockstep(engines, common)
        for name, eng in engines.items():
            tps_common, cpu_common, step_cpu, toks = at_common[name]
            steps[name] += step_cpu
            if rep == 0:
                same.append(toks)
            tps_max, _, _, _ = decode(eng, cap[name])
            b = best[name]
            best[name] = [max(b[0], tps_common), max(b[1], tps_max), max(b[2], cpu_common)]
    load1 = os.getloadavg()[0]
    for name, eng in engines.items():
        tps_common, tps_max, cpu_common = best[name]
        st = eng.hisparse.stats_dict() if eng.hisparse is not None else {}
        rows.append(
            {
                "mode": name,
                "logical_tokens": eng.allocator.num_pages * 16,
                "requests": cap[name],
                "device_bytes": eng.pool.nbytes,
                "host_bytes": eng.hisparse.host_bytes if eng.hisparse is not None else 0,
                "tok_s_common": tps_common,
                "tok_s_max": tps_max,
                "cpu_tok_s_common": cpu_common,
                "step_ms_common": 1e3 * float(np.median(steps[name])),
                "hit_rate": st.get("hit_rate"),
            }
        )
    identical = all(t == same[0] for t in same)
    print(
        f"decode (Engine, tiny GLM checkpoint: 12 layers, index_topk 16, fp32): device budget {fmt_bytes(budget)}, "
        f"ratio {args.ratio:g}, buffer {args.decode_buffer}, requests of {ctx} + {new} tokens, "
        f"{torch.get_num_threads()} torch threads, best of {args.repeat}, load average {load0:.1f} -> {load1:.1f}"
    )
    print(
        f"{'mode':<20}{'logical tok':>12}{'requests':>10}{'device':>11}{'host':>11}"
        f"{f'tok/s @{common}':>12}{f'cpu tok/s @{common}':>17}{'cpu ms/step':>12}{'x plain':>9}{'tok/s @max':>12}"
        f"{'hit rate':>10}"
    )
    base = rows[0]["step_ms_common"]
    for r in rows:
        hit = f"{r['hit_rate']:.1%}" if r["hit_rate"] is not None else "-"
        r["x_plain"] = base / r["step_ms_common"]
        print(
            f"{r['mode']:<20}{r['logical_tokens']:>12,}{r['requests']:>10}{fmt_bytes(r['device_bytes']):>11}"
            f"{fmt_bytes(r['host_bytes']):>11}{r['tok_s_common']:>12.1f}{r['cpu_tok_s_common']:>17.1f}"
            f"{r['step_ms_common']:>12.2f}{r['x_plain']:>8.2f}x{r['tok_s_max']:>12.1f}{hit:>10}"
        )
    p, d, e = rows
    print(
        f"HiSparse + elision holds {e['requests'] / p['requests']:.2f}x the requests of plain and "
        f"{e['requests'] / d['requests']:.2f}x HiSparse dense; at the same batch of {common} (x plain: plain's median "
        f"decode-step CPU time over this mode's, same process, {len(steps[p['mode']])} steps each): HiSparse + elision "
        f"{e['x_plain']:.2f}x plain, HiSparse dense {d['x_plain']:.2f}x plain (best-run CPU tok/s: "
        f"{e['cpu_tok_s_common'] / p['cpu_tok_s_common']:.2f}x, {d['cpu_tok_s_common'] / p['cpu_tok_s_common']:.2f}x; "
        f"wall: {e['tok_s_common'] / p['tok_s_common']:.2f}x, {d['tok_s_common'] / p['tok_s_common']:.2f}x); at each "
        f"mode's max: HiSparse + elision {e['tok_s_max'] / p['tok_s_max']:.2f}x plain; greedy tokens identical across "
        f"the three: {identical}"
    )
    if not identical:
        raise SystemExit("HiSparse tokens differ from the plain decode")
    return {"budget": budget, "context": ctx, "new_tokens": new, "rows": rows, "identical": identical}


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
    p.add_argument("--decode-budget", default="16MiB", help="device budget of the decode part (tiny checkpoint)")
    p.add_argument("--decode-context", type=int, default=512, help="prompt tokens per request (decode part)")
    p.add_argument("--decode-tokens", type=int, default=24, help="tokens generated per request (decode part)")
    p.add_argument("--decode-buffer", type=int, default=32, help="device_buffer_size of the decode part")
    p.add_argument(
        "--repeat", type=int, default=1, help="decode part: best of this many runs (same batch: modes stepped in turn)"
    )
    p.add_argument("--part", choices=("both", "capacity", "swap", "decode", "all"), default="both")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.part in ("both", "capacity", "all"):
        capacity(args)
    if args.part in ("both", "swap", "all"):
        swap_bench(args)
    if args.part in ("decode", "all"):
        decode_bench(args)


if __name__ == "__main__":
    main()
