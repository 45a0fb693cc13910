"""Decode-step latency of the reference DSA model on the paged pool, by context length and storage format.

Baseline in the same process: the expanded MLA path (every cached row expanded through kv_b_proj, as
transformers does), against the weight-absorbed path (only the index_topk selected rows, read as stored).
Prints figures; asserts nothing about time.

    python bench/model_decode.py [--ctx 256 1024 4096] [--steps 16]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.model.batch import ForwardBatch
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.util import ceil_div


def decode_ms(model, layout, ctx: int, steps: int) -> float:
    pool = DevicePool(layout, ceil_div(ctx + steps, layout.page_size) + 1)
    slots = torch.arange(ctx + steps)
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(2, model.spec.vocab_size, (ctx,), generator=g)
    fill = ForwardBatch(
        input_ids=prompt,
        positions=torch.arange(ctx),
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([ctx]),
        slot_table=slots[None, :ctx],
        out_slots=slots[:ctx],
    )
    tok = int(model(fill, pool).argmax())
    t0 = time.perf_counter()
    for i in range(steps):
        n = ctx + i
        b = ForwardBatch(
            input_ids=torch.tensor([tok]),
            positions=torch.tensor([n]),
            prefix_lens=torch.tensor([n]),
            extend_lens=torch.tensor([1]),
            slot_table=slots[None, : n + 1],
            out_slots=slots[n : n + 1],
        )
        tok = int(model(b, pool).argmax())
    return (time.perf_counter() - t0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as d:
        _, model = load_model(make_tiny(d, seed=0))
    print(f"tiny glm_moe_dsa, 12 layers, index_topk {model.spec.index_topk}, {args.threads} thread(s)")
    print(f"{'ctx':>6} {'format':>18} {'expanded ms/step':>17} {'absorbed ms/step':>17} {'speedup':>8}")
    for ctx in args.ctx:
        for kv, ix in (("fp32", "fp32"), ("fp8-656", "fp8-132")):
            layout = model.layout_for(kv_format=kv, index_format=ix, page_size=64)
            model.set_mla_path("expanded")
            dense = decode_ms(model, layout, ctx, args.steps)
            model.set_mla_path("absorbed")
            sparse = decode_ms(model, layout, ctx, args.steps)
            model.set_mla_path("auto")
            print(f"{ctx:>6} {kv + '/' + ix:>18} {dense:>17.2f} {sparse:>17.2f} {dense / sparse:>7.2f}x")


if __name__ == "__main__":
    main()
