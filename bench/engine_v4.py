"""The V4 section of bench/engine.py: dsakv's V4Engine against transformers' DeepseekV4ForCausalLM, same run.

For each tiny layer pattern (flash, pro) and batch size: B prompts of --v4-prompt-len tokens, decode tokens/s
of dsakv (V4Pool, fp32; timed once every request has its first token) and of transformers' generate (time
of generate(1 + N) minus generate(1)), best of --repeat, alternating; greedy tokens compared at batch 1.
Prints figures and ratios, never asserts on time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from dsakv.engine.v4_engine import V4Engine
from dsakv.model.deepseek_v4 import load_v4
from dsakv.model.deepseek_v4_tiny import make_tiny_v4


def _prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 500, (length,), generator=g).tolist() for _ in range(batch)]


def _dsakv_tps(model, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    eng = V4Engine(model, num_pages=4 * len(prompts) * 8, max_running=len(prompts), chunk_size=64,
                   max_batch_tokens=64 * len(prompts))  # fmt: skip
    ids = [eng.add_request(p, 1 + n) for p in prompts]
    while any(len(r.output) < 1 for r in eng.running) or eng.waiting:
        eng.step()
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    return len(prompts) * n / dt, [eng.finished[i].output for i in ids]


def _hf_tps(hf, prompts: list[list[int]], n: int) -> tuple[float, list[list[int]]]:  # type: ignore[no-untyped-def]
    ids = torch.tensor(prompts)

    def timed(new: int) -> tuple[float, torch.Tensor]:
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        return time.perf_counter() - t0, out

    pre = min(timed(1)[0] for _ in range(2))
    full, out = timed(1 + n)
    return len(prompts) * n / max(1e-9, full - pre), out[:, ids.shape[1] :].tolist()


def v4_section(tmp: Path, args: argparse.Namespace) -> dict:
    import transformers

    rows = []
    for pattern in ("flash", "pro"):
        path = make_tiny_v4(tmp / f"v4-{pattern}", pattern)
        model = load_v4(path)
        hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        hf.generation_config.eos_token_id = None
        hf.generation_config.pad_token_id = 0
        for batch in [int(b) for b in args.v4_batches.split(",")]:
            prompts = _prompts(batch, args.v4_prompt_len, seed=7 + batch)
            ours = theirs = 0.0
            same = None
            for _ in range(args.repeat):
                o_tps, o_tok = _dsakv_tps(model, prompts, args.decode_tokens)
                h_tps, h_tok = _hf_tps(hf, prompts, args.decode_tokens)
                ours, theirs = max(ours, o_tps), max(theirs, h_tps)
                if batch == 1:
                    same = o_tok == h_tok
            rows.append({"pattern": pattern, "batch": batch, "dsakv_tps": ours, "hf_tps": theirs, "tokens_equal": same})
            print(f"  v4 {pattern} batch {batch:>3}: done", file=sys.stderr)
    print()
    print(
        f"DeepSeek-V4 tiny (window 8, CSA 4, HCA 16), decode: dsakv V4Engine (fp32 V4Pool) vs transformers "
        f"generate, prompts of {args.v4_prompt_len}, {args.decode_tokens} timed tokens, best of {args.repeat}:"
    )
    head = f"{'pattern':>7}  {'batch':>5}  {'dsakv tok/s':>11}  {'transformers tok/s':>18}  {'dsakv/hf':>8}  tokens =="
    print(head)
    print("-" * len(head))
    for r in rows:
        eq = "-" if r["tokens_equal"] is None else str(r["tokens_equal"])
        print(
            f"{r['pattern']:>7}  {r['batch']:>5}  {r['dsakv_tps']:>11,.1f}  {r['hf_tps']:>18,.1f}  "
            f"x{r['dsakv_tps'] / r['hf_tps']:>7.2f}  {eq}"
        )
    return {"prompt_len": args.v4_prompt_len, "decode_tokens": args.decode_tokens, "rows": rows}
