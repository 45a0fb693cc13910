"""Disaggregated serving benchmark: N requests through the router to a PP prefill worker and a decode worker
(real `dsakv serve --role ...` processes on 127.0.0.1), against colocated serving (one Engine, this process)
on the same workload in the same run.

Prints wall time, requests/s, generated tokens/s, time to first token (p50/p99) and KV bytes moved, and the
ratio disaggregated / colocated. Tokens are compared too (they must be identical). On a 2-core machine the
disaggregated run shares the cores between all its processes: read the ratio as overhead, not speedup.

    python bench/disagg.py [--model DIR] [--requests 300] [--partition 5,3,2,2] [--backend mooncake]

--routing: prefix-aware vs least-loaded routing, 2 prefill (PP 1, prefix cache) x 2 decode workers behind one
router, on a multi-tenant workload: --tenants system prompts of --system-tokens each, every request one tenant's
system prompt + its own --user-tokens, --requests requests at --concurrency (closed loop). Both arms run in this
process on fresh workers (one cluster per arm, so each starts with empty caches); the least-loaded arm is the
same router with prefix affinity off (--affinity-min-gain-pages above any prompt). Prints per arm: prefix hit
rate (the prefills' own hit tokens / prompt tokens), TTFT p50/p99 (submit -> first token), requests/s, tokens/s,
prefill picks by affinity, and the ratios; tokens are checked equal to a colocated engine.

    python bench/disagg.py --routing [--requests 160] [--tenants 8] [--system-tokens 512] [--prefill-pages 192]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402

from dsakv.cli import options  # noqa: E402
from dsakv.config import (  # noqa: E402
    EngineConfig,
    LayoutConfig,
    PoolConfig,
    RouterConfig,  # noqa: E402
)
from dsakv.disagg.protocol.auth import SECRET_ENV, launch_secret  # noqa: E402
from dsakv.disagg.protocol.messages import Health, PrefillHealth, fetch_health  # noqa: E402
from dsakv.disagg.protocol.rpc import RpcError  # noqa: E402
from dsakv.disagg.router.backend import RouterBackend  # noqa: E402
from dsakv.engine.engine import Engine  # noqa: E402
from dsakv.engine.request import SamplingParams  # noqa: E402
from dsakv.model.tiny import make_tiny  # noqa: E402
from dsakv.util.procs import Proc, dsakv_cmd, free_ports  # noqa: E402

PAGE_SIZE = 16


def _health(addr: str) -> Health | None:
    try:
        return fetch_health(addr, timeout=2)
    except RpcError:
        return None


def _wait_up(addrs: list[str], procs: list[Proc], timeout: float = 180.0) -> None:
    end = time.monotonic() + timeout
    while not all((h := _health(a)) is not None and h.ok for a in addrs):
        dead = [p.name for p in procs if not p.alive()]
        if dead or time.monotonic() > end:
            raise SystemExit(f"workers did not come up within {timeout:g} s (exited: {dead})")
        time.sleep(0.2)


def _routing_arm(args: argparse.Namespace, model: Path, prompts: list[list[int]], affinity: bool) -> dict:
    """One arm on fresh 2P2D workers: (outputs, ttfts, wall, hit tokens, prompt tokens, affinity picks)."""
    dec_cfg = EngineConfig(layout=LayoutConfig(page_size=PAGE_SIZE), pool=PoolConfig(num_pages=args.pages))
    pre_cfg = EngineConfig(layout=LayoutConfig(page_size=PAGE_SIZE), pool=PoolConfig(num_pages=args.prefill_pages))
    env = dict(os.environ)
    procs, decodes, prefills = [], [], []
    for i in range(2):
        port = free_ports(1)
        cmd = dsakv_cmd("serve", "--role", "decode", "--port", str(port), "--model", str(model))
        cmd += ["--transfer-backend", args.backend, *options.engine_argv(dec_cfg)]
        procs.append(Proc(f"decode{i}", cmd, env=env, quiet=True))
        decodes.append(f"127.0.0.1:{port}")
    for i in range(2):
        port = free_ports(2)
        cmd = dsakv_cmd("serve", "--role", "prefill", "--port", str(port), "--model", str(model), "--prefix-cache")
        cmd += ["--transfer-backend", args.backend, "--worker-name", f"p{i}", *options.engine_argv(pre_cfg)]
        procs.append(Proc(f"prefill{i}", cmd, env=env, quiet=True))
        prefills.append(f"127.0.0.1:{port}")
    for p in procs:
        p.start()
    try:
        _wait_up(decodes + prefills, procs)
        gain = 1 if affinity else 1 << 30  # least loaded: no prompt saves 2^30 pages
        router = RouterBackend(
            RouterConfig(
                prefill=tuple(prefills),
                decode=tuple(decodes),
                queue_timeout=300.0,
                kv_timeout=120.0,
                rpc_timeout=10.0,  # a loaded prefill answers late; a timed-out submit is a retry elsewhere
                health_interval=0.2,
                affinity_min_gain_pages=gain,
            )
        )
        router.start()
        end = time.monotonic() + 60
        while len(router.peers.usable_pairs()) < 4 and time.monotonic() < end:
            time.sleep(0.1)
        params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
        outs: list[list[int]] = [[] for _ in prompts]
        ttft: list[float] = [0.0] * len(prompts)
        nxt = iter(range(len(prompts)))
        lock = threading.Lock()

        def client() -> None:
            while True:
                with lock:
                    i = next(nxt, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                router.submit(f"r{i}", prompts[i], params)
                for ev in router.events(f"r{i}", 300):
                    if not outs[i] and ev.new_token_ids:
                        ttft[i] = time.perf_counter() - t0
                    outs[i] += ev.new_token_ids

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, daemon=True) for _ in range(args.concurrency)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        stats = [(h.prefix_cache or {}) if isinstance(h := _health(a), PrefillHealth) else {} for a in prefills]
        counters = dict(router.counters)
        router.stop()
    finally:
        for p in procs:
            p.kill()
    return {
        "outs": outs,
        "ttft": ttft,
        "wall": wall,
        "hit": sum(int(st.get("hit_tokens", 0)) for st in stats),
        "prompt": sum(map(len, prompts)),
        "affinity": counters["routed_affinity_total"],
        "load": counters["routed_load_total"],
    }


def routing_main(args: argparse.Namespace, model: Path) -> int:
    rng = random.Random(7)
    systems = [[rng.randrange(2, 512) for _ in range(args.system_tokens)] for _ in range(args.tenants)]
    prompts = [
        systems[rng.randrange(args.tenants)] + [rng.randrange(2, 512) for _ in range(args.user_tokens)]
        for _ in range(args.requests)
    ]
    eng = Engine(
        model,
        EngineConfig(layout=LayoutConfig(page_size=PAGE_SIZE), pool=PoolConfig(num_pages=args.pages)),
    )
    ref = eng.generate(prompts, SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True))
    arms = {}
    for name, aff in (("prefix-aware", True), ("least-loaded", False)):
        arms[name] = _routing_arm(args, model, prompts, aff)
        print(f"{name}: done in {arms[name]['wall']:.1f} s", flush=True)
    ntok = sum(len(o) for o in ref)
    sys_pages = args.system_tokens // PAGE_SIZE
    print(
        f"workload: {args.requests} requests at concurrency {args.concurrency}, {args.tenants} tenants x "
        f"{args.system_tokens}-token system prompt ({sys_pages} pages) + {args.user_tokens} own tokens, "
        f"{args.max_tokens} generated each; 2 prefill (PP 1, prefix cache, {args.prefill_pages} pages) x 2 decode "
        f"({args.pages} pages), {args.backend}"
    )
    print("| routing | prefix hit rate | TTFT p50 s | TTFT p99 s | req/s | tok/s | prefill picks affinity/load |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    row = {}
    for name, a in arms.items():
        q = statistics.quantiles(a["ttft"], n=100)
        row[name] = (a["hit"] / a["prompt"], q[49], q[98], args.requests / a["wall"], ntok / a["wall"])
        hr, p50, p99, rps, tps = row[name]
        print(f"| {name} | {hr:.3f} | {p50:.3f} | {p99:.3f} | {rps:.2f} | {tps:.1f} | {a['affinity']}/{a['load']} |")
    pa, ll = row["prefix-aware"], row["least-loaded"]
    print(
        f"ratio prefix-aware / least-loaded: hit rate x{pa[0] / max(ll[0], 1e-9):.2f}, TTFT p50 x{pa[1] / ll[1]:.2f}, "
        f"p99 x{pa[2] / ll[2]:.2f}, throughput x{pa[3] / ll[3]:.2f}"
    )
    same = all(a["outs"] == ref for a in arms.values())
    print(f"tokens identical to colocated in both arms: {same}")
    return 0 if same else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny checkpoint)")
    ap.add_argument("--requests", type=int, default=None, help="requests (default 300; --routing: 160)")
    ap.add_argument("--partition", default="5,3,2,2", help="prefill layers per stage (default 5,3,2,2)")
    ap.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl"))
    ap.add_argument("--pages", type=int, default=512, help="pool pages of every worker (--routing: the decodes)")
    ap.add_argument("--routing", action="store_true", help="prefix-aware vs least-loaded routing over 2P2D")
    ap.add_argument("--tenants", type=int, default=8, help="--routing: tenants (distinct system prompts)")
    ap.add_argument("--system-tokens", type=int, default=512, help="--routing: tokens of each system prompt")
    ap.add_argument("--user-tokens", type=int, default=24, help="--routing: each request's own tokens")
    ap.add_argument("--max-tokens", type=int, default=4, help="--routing: tokens generated per request")
    ap.add_argument("--concurrency", type=int, default=8, help="--routing: requests in flight (closed loop)")
    ap.add_argument(
        "--prefill-pages",
        type=int,
        default=192,
        help="--routing: each prefill's pool pages (below all tenants' prefixes: affinity then matters)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dsakv-bench-disagg-"))
    model = Path(args.model) if args.model else make_tiny(tmp / "tiny")
    os.environ[SECRET_ENV] = str(launch_secret(tmp / "cluster.secret"))  # every role's and this process's secret
    if args.routing:
        args.requests = args.requests or 160
        return routing_main(args, model)
    args.requests = args.requests or 300
    rng = random.Random(5)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randint(3, 90))] for _ in range(args.requests)]
    params = [SamplingParams(max_new_tokens=rng.randint(1, 8), ignore_eos=True) for _ in range(args.requests)]

    eng = Engine(model, EngineConfig(layout=LayoutConfig(page_size=PAGE_SIZE), pool=PoolConfig(num_pages=args.pages)))
    t0 = time.perf_counter()
    ref = eng.generate(prompts, params)
    colo = time.perf_counter() - t0

    part = [int(x) for x in args.partition.split(",")]
    dport, pport = free_ports(1), free_ports(len(part) + 1)  # stage k on pport + k, gloo on pport + pp_size
    cfg = EngineConfig(layout=LayoutConfig(page_size=PAGE_SIZE), pool=PoolConfig(num_pages=args.pages))
    common = ["--model", str(model), "--transfer-backend", args.backend, *options.engine_argv(cfg)]
    env = dict(os.environ)  # as a user's shell would start them (with the secret file set above)
    procs = [Proc("decode", dsakv_cmd("serve", "--role", "decode", "--port", str(dport), *common), env=env, quiet=True)]
    for k in range(len(part)):
        cmd = dsakv_cmd("serve", "--role", "prefill", "--port", str(pport), *common)
        cmd += ["--pp-size", str(len(part)), "--pp-partition", args.partition, "--pp-rank", str(k)]
        procs.append(Proc(f"prefill stage {k}", cmd, env=env, quiet=True))
    for p in procs:
        p.start()
    decode, prefill = f"127.0.0.1:{dport}", f"127.0.0.1:{pport}"
    try:
        end = time.monotonic() + 180
        while not all((h := _health(a)) is not None and h.ok for a in (decode, prefill)):
            if time.monotonic() > end:
                raise SystemExit("workers did not come up within 180 s")
            time.sleep(0.2)
        router = RouterBackend(RouterConfig(prefill=(prefill,), decode=(decode,), queue_timeout=300.0))
        router.start()
        router.wait_ready(60)
        t0 = time.perf_counter()
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
            router.submit(f"b{i}", p, sp)
        outs, ttft = [], []
        for i in range(args.requests):
            toks: list[int] = []
            for ev in router.events(f"b{i}", 120):
                if not toks and ev.new_token_ids:
                    ttft.append(time.perf_counter() - t0)
                toks += ev.new_token_ids
            outs.append(toks)
        dis = time.perf_counter() - t0
        dh = _health(decode)
        kv_bytes = dh.counters.get("kv_bytes", 0) if dh is not None else 0
        router.stop()
    finally:
        for p in procs:
            p.kill()
    ntok = sum(len(o) for o in ref)
    q = statistics.quantiles(ttft, n=100) if len(ttft) > 1 else [0.0] * 99
    print(f"workload: {args.requests} requests, {sum(map(len, prompts))} prompt tokens, {ntok} generated (greedy)")
    print(f"colocated      : {colo:7.2f} s  {args.requests / colo:7.1f} req/s  {ntok / colo:8.1f} tok/s")
    print(
        f"disaggregated  : {dis:7.2f} s  {args.requests / dis:7.1f} req/s  {ntok / dis:8.1f} tok/s  "
        f"(PP {args.partition}, {args.backend}; TTFT from first submit p50 {q[49]:.2f}s p99 {q[98]:.2f}s; "
        f"KV moved {kv_bytes / 2**20:.1f} MiB)"
    )
    print(f"ratio disaggregated/colocated wall time: {dis / colo:.2f}x; tokens identical: {outs == ref}")
    return 0 if outs == ref else 1


if __name__ == "__main__":
    sys.exit(main())
