"""Disaggregated serving benchmark: N requests through the router to a PP prefill worker and a decode worker
(real `dsakv serve --role ...` processes on 127.0.0.1), against colocated serving (one Engine, this process)
on the same workload in the same run.

Prints wall time, requests/s, generated tokens/s, time to first token (p50/p99) and KV bytes moved, and the
ratio disaggregated / colocated. Tokens are compared too (they must be identical). On a 2-core machine the
disaggregated run shares the cores between all its processes: read the ratio as overhead, not speedup.

    python bench/disagg.py [--model DIR] [--requests 300] [--partition 5,3,2,2] [--backend mooncake]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
os.environ.setdefault("UCX_TLS", "tcp")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

import torch  # noqa: E402

from dsakv.cli import options  # noqa: E402
from dsakv.disagg.messages import Health, fetch_health  # noqa: E402
from dsakv.disagg.router import RouterBackend, RouterConfig  # noqa: E402
from dsakv.disagg.rpc import RpcError  # noqa: E402
from dsakv.engine.config import EngineConfig, LayoutConfig, PoolConfig  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a fresh tiny checkpoint)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--partition", default="5,3,2,2", help="prefill layers per stage (default 5,3,2,2)")
    ap.add_argument("--backend", default="mooncake", choices=("mooncake", "nixl"))
    ap.add_argument("--pages", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="dsakv-bench-disagg-"))
    model = Path(args.model) if args.model else make_tiny(tmp / "tiny")
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
    env = dict(os.environ)  # as a user's shell would start them
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
