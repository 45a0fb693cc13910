"""The V4 section of bench/engine.py: dsakv's V4Engine against transformers' DeepseekV4ForCausalLM, same run.

For each tiny layer pattern (flash, pro) and batch size: B prompts of --v4-prompt-len tokens, decode tokens/s
of dsakv (V4Pool, fp32; timed once every request has its first token) and of transformers' generate (time
of generate(1 + N) minus generate(1)), best of --repeat, alternating; greedy tokens compared at batch 1.
Then the prefix-cache choice at a page boundary: storing the window ring + compressor state (bytes per
snapshot, tiny and full-scale Flash / Pro) against recomputing it (num_layers x window tokens re-run), and the
time of a hit (state copied) against a miss (whole prompt prefilled) on the tiny flash checkpoint.
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
from dsakv.spec.v4 import load_v4_spec
from dsakv.spec.v4_layout import V4Layout


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
    prefix = _prefix_costs(tmp / "v4-flash", args)
    return {"prompt_len": args.v4_prompt_len, "decode_tokens": args.decode_tokens, "rows": rows, "prefix": prefix}


def _prefix_costs(path: Path, args: argparse.Namespace) -> dict:
    model = load_v4(path)
    base = _prompts(1, 64, seed=3)[0]
    tail = _prompts(1, 5, seed=4)[0]
    warm = V4Engine(model, num_pages=32, max_running=1, chunk_size=64, max_batch_tokens=64, prefix_cache=True)
    warm.generate([base], 1)  # stores the state at the 48-token boundary
    best_hit = best_miss = best_re = float("inf")
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        warm.generate([base[:48] + tail], 1)
        best_hit = min(best_hit, time.perf_counter() - t0)
        plain = V4Engine(model, num_pages=32, max_running=1, chunk_size=64, max_batch_tokens=64)
        t0 = time.perf_counter()
        plain.generate([base[:48] + tail], 1)
        best_miss = min(best_miss, time.perf_counter() - t0)
        n_re = warm.recompute_tokens(48)
        t0 = time.perf_counter()
        plain.generate([base[:n_re]], 1)
        best_re = min(best_re, time.perf_counter() - t0)
    full = {n: V4Layout(load_v4_spec(n)) for n in ("deepseek-v4-flash", "deepseek-v4-pro")}
    out = {
        "tiny_snapshot_bytes": warm.layout.state_bytes_per_request,
        "tiny_recompute_tokens": warm.recompute_tokens(48),
        "hit_s": best_hit,
        "miss_s": best_miss,
        "recompute_s": best_re,
        "full_scale": {
            n: {
                "snapshot_bytes": lay.state_bytes_per_request,
                "recompute_tokens": lay.spec.num_layers * 128,
                "page_bytes": lay.bytes_per_page,
            }
            for n, lay in full.items()
        },  # fmt: skip
    }
    print()
    print("prefix cache at a page boundary: store the window + compressor state, or recompute it")
    print(
        f"  tiny flash: snapshot {out['tiny_snapshot_bytes']:,} B (stored) vs re-running "
        f"{out['tiny_recompute_tokens']} tokens; prompt 48 + 5: hit {1e3 * best_hit:.1f} ms vs miss "
        f"{1e3 * best_miss:.1f} ms (x{best_miss / best_hit:.2f}); recomputing the state alone {1e3 * best_re:.1f} ms"
    )
    for n, f in out["full_scale"].items():
        print(
            f"  {n}: snapshot {f['snapshot_bytes']:,} B = {f['snapshot_bytes'] / f['page_bytes']:.1f} pages of "
            f"{f['page_bytes']:,} B, vs re-running {f['recompute_tokens']:,} tokens ({f['recompute_tokens'] // 128} "
            "layers x window 128)"
        )
    return out
