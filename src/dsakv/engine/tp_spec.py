"""MTP speculative decoding over tensor-parallel ranks (engine/ranks.py): each rank's draft layer is its shard
of the checkpoint's MTP layer, split as the target layers are (model/parallel.load_tp_draft), so every rank
computes the same all-reduced draft hidden states, draws the same drafts (the request's seed is rank 0's) and
accepts the same tokens. With --hisparse every rank holds its own HiSparse pool (the keys are replicated) and
picks the same top-k, so it copies the same rows into the same hot-buffer slots. `agree_step` checks both after
every step (one all_gather of a small digest, only when there is something to check).
Imports torch, dsakv.model and dsakv.engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsakv.model.parallel import TPGroup


def tp_engine(model_dir: Any, group: TPGroup, cfg: Any) -> Any:
    """This rank's Engine over its shard of the checkpoint in `model_dir` (EngineConfig `cfg`); with
    --speculative-num-steps its MTP draft layer is sharded the same way (model/parallel.load_tp_draft)."""
    import torch

    from dsakv.engine.engine import Engine
    from dsakv.model.parallel import load_tp_draft, load_tp_model

    dtype = getattr(torch, cfg.dtype)
    draft = load_tp_draft(model_dir, group, dtype=dtype) if cfg.speculative_num_steps else None
    return Engine(load_tp_model(model_dir, group, dtype=dtype), cfg, model_dir=model_dir, draft=draft)


def draft_digest(engine: Any) -> Any:
    """What every rank of a speculating TP group must agree on after each step: the draft and accepted counts so
    far and each request's next drafts (None without MTP: then no collective is run for it)."""
    sp = getattr(engine, "speculator", None)
    if sp is None:
        return None
    states = sorted((rid, st.n, tuple(st.tokens)) for rid, st in sp.states.items())
    return sp.stats.draft_tokens, sp.stats.accepted_tokens, sp.stats.verify_steps, states


def hisparse_digest(engine: Any) -> Any:
    """What every rank of a HiSparse TP group must agree on after each step: the step count, the rows copied
    host -> device per layer this step, the hot-buffer residency (HiSparsePool.residency_digest) and the logical
    pages held; None without --hisparse."""
    pool = getattr(engine, "hisparse", None)
    if pool is None:
        return None
    rows = tuple(pool.stats.step_rows().items())
    return pool.stats.steps, rows, pool.residency_digest(), engine.allocator.num_used


def agree_step(engine: Any, ranks: Any) -> None:
    """RanksDiverged unless every rank of `ranks` (engine/ranks.Ranks) drafted and accepted the same tokens
    (MTP) and copied the same HiSparse rows into the same residency (--hisparse) this step; no collective when
    neither is on. Counts the checked steps in the HiSparse stats (rank_checked_steps)."""
    checks = (
        ("MTP drafts / accepted tokens", draft_digest(engine)),
        ("HiSparse (step, rows copied per layer, residency, pages held)", hisparse_digest(engine)),
    )
    digest = {what: d for what, d in checks if d is not None}
    if not digest or ranks.size == 1:
        return
    ranks.agree(digest, "")
    pool = getattr(engine, "hisparse", None)
    if pool is not None:
        pool.stats.rank_checked()
