"""`dsakv generate` on a DeepSeek-V4 checkpoint: dsakv's V4Engine (greedy, fp32 V4 pool), token ids out.

Imports torch and the engine inside run_v4() only.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dsakv.errors import ConfigError

V4_SUPPORTED = "--prompt-ids/--prompt, --max-new-tokens, --ignore-eos, --stop-token-ids, --page-size, --num-pages, "
V4_SUPPORTED += "--max-running-requests, --prefix-cache, --hicache-ratio, --sequential, --json, --stats"


def run_v4(args: argparse.Namespace, prompts: list[list[int]], stop: list[int]) -> int:
    if args.temperature != 0.0 or args.top_k is not None or args.top_p != 1.0:
        raise ConfigError(
            f"DeepSeek-V4 runs greedy only for now: drop --temperature / --top-p / --top-k ({V4_SUPPORTED})"
        )
    import torch

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
    eng = V4Engine(
        model,
        num_pages=num_pages,
        max_running=args.max_running_requests or len(prompts),
        page_size=page,
        prefix_cache=args.prefix_cache or bool(host),
        host_pages=host,
    )
    outs = []
    for batch in [[p] for p in prompts] if args.sequential else [prompts]:
        ids = [eng.add_request(p, args.max_new_tokens, eos) for p in batch]
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
