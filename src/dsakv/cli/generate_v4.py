"""`dsakv generate` on a DeepSeek-V4 checkpoint: dsakv's V4Engine (greedy or seeded sampling, fp32 V4 pool),
token ids out.

Imports torch and the engine inside run_v4() only.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any


def run_v4(args: argparse.Namespace, prompts: list[list[int]], stop: list[int]) -> int:
    import torch

    from dsakv.engine.request import SamplingParams
    from dsakv.engine.v4_engine import V4Engine
    from dsakv.model.deepseek_v4 import load_v4

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    model = load_v4(Path(args.model))
    eos = () if args.ignore_eos else tuple(int(e) for e in _eos(model.spec.raw))
    eos += tuple(stop)
    page = args.page_size
    need = max(-(-(len(p) + args.max_new_tokens) // page) for p in prompts)
    num_pages = args.num_pages or max(4 * need * len(prompts), 16)
    host = int(num_pages * args.hicache_ratio) if args.hicache_ratio else 0
    sampling = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k
    )
    max_running = args.max_running_requests or len(prompts)
    pp = int(getattr(args, "pp_size", 1) or 1)
    children: list[Any] = []
    staged: dict[str, Any] = {}
    built: list[V4Engine] = []  # the engine, once built (its pool is stage 0's)
    if pp > 1:  # a colocated pipeline: stages 1.. are child processes with their layers' pools
        from dsakv.cli import options
        from dsakv.config import split_layers
        from dsakv.disagg.prefill.v4_stages import stage_forward, start_stages

        ranges = split_layers(model.spec.num_layers, pp, options.pipeline_config(args).partition)
        layout_page = model.layout(page).page
        children = start_stages(str(args.model), ranges, num_pages, max_running, layout_page, threads=args.threads or 1)
        staged = {
            "layers": ranges[0],
            "forward": lambda rows: stage_forward(model, ranges, children, built[0].pool, rows),
        }
    try:
        eng = V4Engine(
            model,
            num_pages=num_pages,
            max_running=max_running,
            page_size=page,
            prefix_cache=args.prefix_cache or bool(host),
            host_pages=host,
            **staged,
        )
        built.append(eng)
        return _run(args, eng, prompts, eos, sampling)
    finally:
        for c in children:
            c.stop()


def _run(args: argparse.Namespace, eng: Any, prompts: list[list[int]], eos: tuple[int, ...], sampling: Any) -> int:
    rng = random.Random()

    def seed() -> int:  # every prompt draws with --seed (as the DSA engine's requests do), else a random one
        return int(args.seed) if args.seed is not None else rng.getrandbits(63)

    outs = []
    for batch in [[p] for p in prompts] if args.sequential else [prompts]:
        ids = [eng.add_request(p, args.max_new_tokens, eos, sampling=sampling, seed=seed()) for p in batch]
        while eng.has_unfinished():
            eng.step()
        outs += [eng.finished.pop(i) for i in ids]
    rows = [{"prompt_ids": r.prompt, "output_ids": r.output, "finish_reason": r.finish_reason} for r in outs]
    if args.json:
        print(json.dumps(rows))
    else:
        for i, r in enumerate(outs):
            print(f"#{i} prompt={len(r.prompt)} finish={r.finish_reason} ids={','.join(map(str, r.output))}")
    if args.stats:
        lay = eng.layout
        print(
            json.dumps({"steps": eng.steps, "pool_bytes": eng.pool.nbytes, "bytes_per_page": lay.bytes_per_page,
                        "state_bytes_per_request": lay.state_bytes_per_request, **eng.stats.as_dict()}),
            file=sys.stderr,
        )  # fmt: skip
    return 0


def _eos(cfg: dict[str, object]) -> list[int]:
    e = cfg.get("eos_token_id")
    if isinstance(e, int):
        return [e]
    return [int(x) for x in e] if isinstance(e, list) else []
