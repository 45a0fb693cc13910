"""One V4Engine hands a prefilled request to another in the same process (tests and benches: the reference of
the PD path; the serve roles do it over a transfer engine, disagg/prefill/v4_worker.py).

Imports torch and dsakv.engine.v4_engine; must not import disagg, serve or cli.
"""

from __future__ import annotations

import torch

from dsakv.engine.v4_engine import V4Engine
from dsakv.engine.v4_request import V4Request
from dsakv.errors import CapacityError, ConfigError
from dsakv.util import ceil_div


def prefill_request(eng: V4Engine, prompt: list[int]) -> V4Request:
    """Prefill `prompt` on `eng` and sample its first token; the request keeps its pages and slot (parked)."""
    rid = eng.add_request(prompt, 2)
    while not (req := next((r for r in eng.running if r.rid == rid), None)) or not req.output:
        eng.step()
    eng.running.remove(req)
    eng.parked[rid] = req
    return req


def transfer_request(src: V4Engine, req: V4Request, dst: V4Engine, max_new_tokens: int) -> tuple[int, int]:
    """Ship every key of `req` that both layouts hold (paired by key, pair_layouts) from src's pool into fresh
    pages and a slot of dst, free it on src, and queue it on dst to decode; returns (request id on dst, bytes)."""
    from dsakv.spec.v4_layout import pair_layouts

    pairs = pair_layouts(src.layout, dst.layout)
    missing = set(dst.layout.keys) - {p.key for p in pairs}
    if missing:
        raise ConfigError(f"the sender holds no {', '.join(sorted(map(str, missing))[:4])}: the decode needs every key")
    n_tok = len(req.prompt)
    n_pages = ceil_div(n_tok, src.page_size)
    need = ceil_div(n_tok + max_new_tokens, dst.page_size)
    if not dst.slots.num_free or not dst.pages.can_alloc(need):
        raise CapacityError(f"the decode has no room for {need} pages and a slot: retry later")
    out = V4Request(dst._next, list(req.prompt), max_new_tokens, output=[req.output[0]], eos=req.eos)
    dst._next += 1
    out.page_ids = dst.pages.alloc(need, owner=out.rid)
    out.slot = dst.slots.alloc()
    out.num_computed = n_tok
    moved = 0
    sp = torch.from_numpy(req.page_ids[:n_pages]).to(src.pool.device)
    dp = torch.from_numpy(out.page_ids[:n_pages]).to(dst.pool.device)
    for p in pairs:
        if p.paged:
            dst.pool.paged(p.key)[dp] = src.pool.paged(p.key)[sp].to(dst.pool.device)
            moved += n_pages * p.nbytes
        else:
            dst.pool.state(p.key)[out.slot] = src.pool.state(p.key)[req.slot].to(dst.pool.device)
            moved += p.nbytes
    src.parked.pop(req.rid)
    src.pages.release(req.rid)
    src.slots.free(req.slot)
    dst.running.append(out)
    return out.rid, moved
