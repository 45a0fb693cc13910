"""Engine ranks: generation tokens/s and KV pool bytes per rank for TP 1 vs 2 and DP 1 vs 2 (DP attention, EP 2),
and the sender-assignment rule's largest sender share against SGLang's rank-0 rule.

    python bench/parallel.py [--model DIR] [--batch 8] [--prompt-len 16] [--new-tokens 48] [--threads 1]

Makes a compute-bound checkpoint (hidden 512, 8 heads, 8 experts of 512, 4 layers; or --model DIR) and runs
`dsakv generate --stats` on it, in this order and alternating --repeat times: TP 1, TP 2, DP 2 (EP 2). Each run's
figure is the generation loop's wall time on rank 0 (model loading excluded): tokens/s = generated tokens / that;
scaling efficiency = (tokens/s at N ranks) / (N x tokens/s at 1 rank). Every run's greedy tokens are checked
against TP 1's. Transfer: for GLM-5.2's decode keys (101 keys, 64-token pages, 100 pages a request), prefill TP 8
-> decode DP 8 over 8 requests, the bytes the busiest prefill rank sends with the rule and with rank 0 only
(a transfer time ratio on links of equal speed; measured transfer per rank needs PD ranks, not built yet).
Prints the load average (1, 5, 15 min) at the start and the end. Never asserts on time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="checkpoint (default: a compute-bound tiny one in a temp dir)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    print(load())
    transfer_share()
    with tempfile.TemporaryDirectory(prefix="dsakv-bench-parallel-") as tmp:
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
