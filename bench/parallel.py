"""Engine ranks: generation tokens/s and KV pool bytes per rank for TP 1 vs 2 and DP 1 vs 2 (DP attention, EP 2),
the sender-assignment rule's largest sender share against SGLang's rank-0 rule on paper, and MEASURED: a real
prefill TP 2 -> decode TP 2 over mooncake on 127.0.0.1, the rule against a rank-0-only sender.

    python bench/parallel.py [--model DIR] [--batch 8] [--prompt-len 16] [--new-tokens 48] [--threads 1]
                             [--pd-requests 8] [--pd-prompt-len 1536] [--pd-rounds 3] [--skip-pd]

Makes a compute-bound checkpoint (hidden 512, 8 heads, 8 experts of 512, 4 layers; or --model DIR) and runs
`dsakv generate --stats` on it, in this order and alternating --repeat times: TP 1, TP 2, DP 2 (EP 2). Each run's
figure is the generation loop's wall time on rank 0 (model loading excluded): tokens/s = generated tokens / that;
scaling efficiency = (tokens/s at N ranks) / (N x tokens/s at 1 rank). Every run's greedy tokens are checked
against TP 1's. Transfer: for GLM-5.2's decode keys (101 keys, 64-token pages, 100 pages a request), prefill TP 8
-> decode DP 8 over 8 requests, the bytes the busiest prefill rank sends with the rule and with rank 0 only
(a transfer time ratio on links of equal speed).
Measured (--skip-pd leaves it out): the tiny glm_moe_dsa checkpoint (12 layers, fp32 pages of 16 tokens: 70 KiB a
page), one decode `--tp-size 2` and two prefills `--tp-size 2`, "rule" (the sender rule) and "rank0" (started
with DSAKV_BENCH_RANK0_SENDER=1: prefill TP rank 0 sends every key to both decode ranks, rank 1 nothing; the
bench-only switch in disagg/transfer/rank_routes.py), each behind its own router. Each round sends
--pd-requests fresh random prompts of --pd-prompt-len tokens (max_new_tokens 1) through each arm, the arms'
order alternating by round. Per arm: bytes sent per prefill rank (exact: the decode's kv_bytes_pairs counter,
bytes landed per (prefill rank, decode rank) pair, differenced over the round), prefill rank 0's transfer
seconds per request (its backend's summed submit-to-completion seconds, differenced, / requests: rank 1's
backend is not in health, so in the rule arm this is rank 0's half only) and the client's time to the first
token per request (prefill + transfer + the decode's first step); medians over rounds, and rank0 / rule ratios.
Prints the load average (1, 5, 15 min) at the start and the end. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

SHAPE = {
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1024,
    "moe_intermediate_size": 512,
    "q_lora_rank": 256,
    "kv_lora_rank": 128,
}
ARMS = {
    "tp1": [],
    "tp2": ["--tp-size", "2"],
    "dp2": ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"],
}


def load() -> str:
    a, b, c = os.getloadavg()
    return f"load {a:.2f} {b:.2f} {c:.2f}"


def run_arm(model: Path, extra: list[str], args: argparse.Namespace) -> tuple[dict, list]:
    import torch

    g = torch.Generator().manual_seed(5)
    argv = [sys.executable, "-m", "dsakv", "generate", "--model", str(model), "--max-new-tokens", str(args.new_tokens)]
    for _ in range(args.batch):
        argv += [
            "--prompt-ids",
            ",".join(str(t) for t in torch.randint(2, 500, (args.prompt_len,), generator=g).tolist()),
        ]
    argv += ["--ignore-eos", "--json", "--stats", "--threads", str(args.threads), "--page-size", "16", *extra]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=1800, env=os.environ.copy())
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(extra) or 'tp1'} failed:\n{out.stderr[-3000:]}")
    fig = next(json.loads(x) for x in out.stderr.splitlines() if x.startswith('{"ranks"'))["ranks"]
    return fig, [r["output_ids"] for r in json.loads(out.stdout)]


def transfer_share() -> None:
    from dsakv.disagg.transfer.rank_assign import RoleGrid, assign_rank0, check_grids, grid_keys
    from dsakv.spec import KVLayout, load_spec

    lay = KVLayout(load_spec("glm-5.2"), draft_layers=1, elide=True)
    kb = {b.key: b.page_bytes * 100 for b in lay.buffers}
    pre = RoleGrid("prefill", ((0, 78),), attention_tp=8, draft_layers=1)
    dec = RoleGrid("decode", ((0, 78),), dp=8, attention_tp=1, draft_layers=1)
    keys = lambda _s: lay.keys  # noqa: E731
    rule: Counter = Counter()
    zero: Counter = Counter()
    for d in range(8):
        a = check_grids(
            pre, dec, prefill_dp=0, decode_dp=d, prefill_keys=keys, decode_keys=keys, key_bytes=kb, rotate=d
        )
        rule.update(a.sender_bytes(kb))
        zero.update(assign_rank0(grid_keys(pre, keys, 0), grid_keys(dec, keys, d)).sender_bytes(kb))
    total = sum(rule.values())
    print(
        f"transfer, prefill TP 8 -> decode DP 8, 8 requests x {lay.bytes_per_page * 100 / 2**20:.1f} MiB: busiest "
        f"prefill rank sends {max(rule.values()) / 2**20:.1f} MiB with the rule ({len(rule)} senders) vs "
        f"{max(zero.values()) / 2**20:.1f} MiB rank-0 only: transfer time "
        f"x{max(rule.values()) / max(zero.values()):.3f}"
        f" (total {total / 2**20:.1f} MiB both)"
    )


PD_ARMS = ("rule", "rank0")


def _pd_round(cluster, router, dec: str, pre: str, name: str, prompts: list, tag: str) -> dict:
    from dsakv.disagg.protocol.messages import fetch_health
    from dsakv.engine.request import SamplingParams

    b0, t0 = fetch_health(dec).kv_bytes_pairs or {}, fetch_health(pre).transfer
    start = time.monotonic()
    ttft: list[float] = []
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        router.submit(rid, list(p), params)
    for rid in rids:
        for ev in router.events(rid, 300.0):
            if ev.finished:
                if ev.error is not None:
                    raise SystemExit(f"{name}: {rid} failed: {ev.error}")
                ttft.append(time.monotonic() - start)
    b1, t1 = fetch_health(dec).kv_bytes_pairs or {}, fetch_health(pre).transfer
    sent = {s: sum(v - b0.get(k, 0) for k, v in b1.items() if k.startswith(f"{name}:0.tp{s}->")) for s in (0, 1)}
    return {
        "sent": sent,
        "rank0_s": (t1.seconds - t0.seconds) / len(prompts),
        "ttft": statistics.median(ttft),
        "wall": time.monotonic() - start,
    }


def measured(args: argparse.Namespace, tmp: Path) -> None:
    import torch

    from dsakv.disagg.protocol.auth import SECRET_ENV, launch_secret
    from dsakv.disagg.transfer.rank_routes import RANK0_ENV
    from dsakv.model.tiny import make_tiny
    from dsakv.spec.layout import KVLayout
    from dsakv.spec.model import ModelSpec
    from dsakv.testing.cluster import PAGE_SIZE, Cluster
    from dsakv.util import ceil_div

    model = make_tiny(tmp / "pd", arch="glm_moe_dsa", seed=0)
    spec = ModelSpec.from_path(model)
    lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    pages = ceil_div(args.pd_prompt_len + 8, PAGE_SIZE) * args.pd_requests + 64
    pool = ["--num-pages", str(pages), "--tp-size", "2"]
    (tmp / "pd-logs").mkdir()
    os.environ[SECRET_ENV] = str(launch_secret(tmp / "cluster.secret"))  # every role's and this process's secret
    cluster = Cluster(model, tmp / "pd-logs")
    try:
        dec = cluster.decode("dec", "mooncake", True, extra=[*pool, "--worker-name", "dec"])
        pre = {"rule": cluster.prefill("rule", "mooncake", True, (spec.num_layers,), extra=pool)}
        os.environ[RANK0_ENV] = "1"  # the rank0 arm's processes (and their TP ranks) inherit it
        try:
            pre["rank0"] = cluster.prefill("rank0", "mooncake", True, (spec.num_layers,), extra=pool)
        finally:
            del os.environ[RANK0_ENV]
        cluster.wait_healthy([dec, *pre["rule"], *pre["rank0"]], timeout=300)
        routers = {
            a: cluster.router([pre[a][0].addr], [dec.addr], kv_timeout=120.0, rpc_timeout=60.0, health_interval=1.0)
            for a in PD_ARMS
        }
        for a in PD_ARMS:
            if not routers[a].wait_ready(120):
                raise SystemExit(f"{a}: router not ready: {routers[a].health()}")
        g = torch.Generator().manual_seed(11)
        n = args.pd_prompt_len
        figs: dict[str, list[dict]] = {a: [] for a in PD_ARMS}
        for r in range(args.pd_rounds):
            for a in PD_ARMS if r % 2 == 0 else PD_ARMS[::-1]:
                prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for _ in range(args.pd_requests)]
                figs[a].append(_pd_round(cluster, routers[a], dec.addr, pre[a][0].addr, a, prompts, f"{a}-r{r}"))
        per_req = ceil_div(n, PAGE_SIZE) * lay.bytes_per_page * 2  # every key once into each of 2 decode ranks
        print(
            f"measured, prefill TP 2 -> decode TP 2 over mooncake 127.0.0.1, {args.pd_requests} requests x {n} "
            f"tokens x {args.pd_rounds} rounds (arms interleaved), {per_req / 2**20:.2f} MiB per request "
            f"({lay.bytes_per_page} B a page x {ceil_div(n, PAGE_SIZE)} pages x 2 decode ranks):"
        )
        med: dict[str, dict[str, float]] = {}
        for a in PD_ARMS:
            sent = figs[a][0]["sent"]  # exact: the same every round
            if any(f["sent"] != sent for f in figs[a]) or sum(sent.values()) != per_req * args.pd_requests:
                raise SystemExit(f"{a}: bytes per round {[f['sent'] for f in figs[a]]} != {per_req} x requests")
            med[a] = {k: statistics.median(f[k] for f in figs[a]) for k in ("rank0_s", "ttft", "wall")}
            print(
                f"  {a:5}: bytes sent per round by prefill rank 0 {sent[0] / 2**20:8.2f} MiB, rank 1 "
                f"{sent[1] / 2**20:8.2f} MiB; rank 0 transfer {med[a]['rank0_s'] * 1e3:7.1f} ms per request, "
                f"time to first token {med[a]['ttft'] * 1e3:7.1f} ms per request, round {med[a]['wall']:.2f} s "
                f"(medians; rounds: rank 0 ms {[round(f['rank0_s'] * 1e3, 1) for f in figs[a]]})"
            )
        rb = {a: max(figs[a][0]["sent"].values()) for a in PD_ARMS}
        print(
            f"  rank0 / rule: busiest prefill rank's bytes x{rb['rank0'] / rb['rule']:.2f}, rank 0 transfer "
            f"x{med['rank0']['rank0_s'] / med['rule']['rank0_s']:.2f}, time to first token "
            f"x{med['rank0']['ttft'] / med['rule']['ttft']:.2f}, "
            f"round x{med['rank0']['wall'] / med['rule']['wall']:.2f}"
        )
    finally:
        cluster.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: a compute-bound tiny one in a temp dir)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--pd-requests", type=int, default=8)
    p.add_argument("--pd-prompt-len", type=int, default=1536)
    p.add_argument("--pd-rounds", type=int, default=3)
    p.add_argument("--skip-pd", action="store_true", help="leave out the measured prefill -> decode section")
    args = p.parse_args()
    print(load())
    transfer_share()
    with tempfile.TemporaryDirectory(prefix="dsakv-bench-parallel-") as tmp:
        if not args.skip_pd:
            measured(args, Path(tmp))
            print(load())
        model = args.model
        if model is None:
            from dsakv.model.tiny import make_tiny

            model = make_tiny(Path(tmp) / "wide", layers=4, overrides=SHAPE)
        best: dict[str, dict] = {}
        ref = None
        for _ in range(args.repeat):
            for name, extra in ARMS.items():
                fig, toks = run_arm(model, extra, args)
                ref = toks if ref is None else ref
                if toks != ref:
                    raise SystemExit(f"{name}: tokens differ from tp1")
                if name not in best or fig["seconds"] < best[name]["seconds"]:
                    best[name] = fig
        base = best["tp1"]["generated_tokens"] / best["tp1"]["seconds"]
        for name, fig in best.items():
            tps = fig["generated_tokens"] / fig["seconds"]
            n = 1 if name == "tp1" else 2
            print(
                f"{name}: {tps:8.1f} tok/s (x{tps / base:.2f} of tp1, scaling efficiency {tps / base / n:.2f}), "
                f"KV pool {fig['kv_pool_bytes_per_rank'] / 2**20:.2f} MiB per rank, tokens == tp1"
            )
    print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())
