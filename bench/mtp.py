"""MTP speculative decoding: decode tokens/s with the draft on (K = 1, 2, 3) vs off, same run, same prompts.

    python bench/mtp.py [--model DIR] [--batch 1,8] [--decode-tokens 32] [--repeat 3] [--threads 1]

Makes a tiny checkpoint with one MTP layer fitted by `make-tiny --mtp 1 --fit-mtp` in a temp dir (or uses
--model DIR, which must have one), decodes the fit prompts (where the fitted draft agrees with the target)
and, with --fresh, prompts it never saw (where it does not), greedy, and times the steps after every
request has its first token. Prints tokens/s off and on, the on/off ratio, the measured acceptance rate and
mean accepted length (tokens per verify), and checks on == off token for token. Best of --repeat runs,
off and on alternating. Never asserts on time.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from dsakv.engine.engine import Engine
from dsakv.engine.mtp_fit import FIT_NEW_TOKENS, fit_mtp, fit_prompts
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import load_draft, load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.config import engine_config


def decode_run(model: tuple, draft: object, k: int, prompts: list[list[int]], new: int) -> tuple[float, list, dict]:
    eng = Engine(
        model,
        engine_config(page_size=16, max_tokens=len(prompts) * (max(map(len, prompts)) + new + 32)),
        speculative_num_steps=k,
        draft=draft if k else None,
    )
    sp = SamplingParams(max_new_tokens=new, ignore_eos=True)
    rids = [eng.add_request(p, sp) for p in prompts]
    while any(not (r := eng.get_request(rid)) or r.num_output_tokens < 1 for rid in rids):  # prefill + token 0
        eng.step()
    done = {rid: len(eng.get_request(rid).output_ids) for rid in rids}  # type: ignore[union-attr]
    outs: dict[str, list[int]] = {}
    t0 = time.perf_counter()
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = list(o.output_ids)
    secs = time.perf_counter() - t0
    decoded = sum(len(outs[r]) - done[r] for r in rids)
    return decoded / secs, [outs[r] for r in rids], eng.spec_stats() or {}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint with an MTP layer (default: make and fit a tiny one)")
    ap.add_argument("--batch", default="1,8", help="batch sizes (default 1,8)")
    ap.add_argument("--steps", default="1,2,3", help="speculative num steps K to compare with off (default 1,2,3)")
    ap.add_argument("--decode-tokens", type=int, default=FIT_NEW_TOKENS, help=f"tokens per request ({FIT_NEW_TOKENS})")
    ap.add_argument("--fresh", action="store_true", help="also decode prompts the draft was not fitted on")
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    if args.model is None:
        tmp = Path(tempfile.mkdtemp(prefix="dsakv-mtp-"))
        ckpt = make_tiny(tmp / "tiny", mtp=1)
        fit = fit_mtp(ckpt)
        print(
            f"fitted the tiny MTP layer in {fit['seconds']} s: agreement on the fit prompts {fit['agreement_after']}, "
            f"fresh {fit['agreement_fresh']}"
        )
    else:
        ckpt = Path(args.model)
    spec, model = load_model(ckpt)
    draft = load_draft(ckpt)
    sets = [("fit prompts", fit_prompts(spec.vocab_size, 32))]
    if args.fresh:
        sets.append(("fresh prompts", fit_prompts(spec.vocab_size, 64, seed=99)[32:]))
    print("| prompts | batch | K | off tok/s | on tok/s | on/off | acceptance | mean accepted length | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, pool in sets:
        for b in (int(x) for x in args.batch.split(",")):
            ps = pool[:b]
            for k in (int(x) for x in args.steps.split(",")):
                best_off = best_on = 0.0
                same = True
                stats: dict = {}
                for _ in range(args.repeat):
                    off, out_off, _ = decode_run((spec, model), None, 0, ps, args.decode_tokens)
                    on, out_on, stats = decode_run((spec, model), draft, k, ps, args.decode_tokens)
                    best_off, best_on = max(best_off, off), max(best_on, on)
                    same &= out_on == out_off
                print(
                    f"| {label} | {b} | {k} | {best_off:.1f} | {best_on:.1f} | {best_on / best_off:.2f}x | "
                    f"{stats.get('spec_acceptance_rate', 0):.3f} | {stats.get('spec_mean_accepted_length', 0):.2f} | "
                    f"{'yes' if same else 'NO'} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
