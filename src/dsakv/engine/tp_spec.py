"""MTP speculative decoding over tensor-parallel ranks (engine/ranks.py): each rank's draft layer is its shard
of the checkpoint's MTP layer, split as the target layers are (model/parallel.load_tp_draft), so every rank
computes the same all-reduced draft hidden states, draws the same drafts (the request's seed is rank 0's) and
accepts the same tokens; `agree_drafts` checks that after every step (one all_gather of a small digest).
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


def agree_drafts(engine: Any, ranks: Any) -> None:
    """RanksDiverged unless every rank of `ranks` (engine/ranks.Ranks) drafted and accepted the same tokens this
    step (a speculating group)."""
    digest = draft_digest(engine)
    if digest is not None:
        ranks.agree(digest, "MTP drafts / accepted tokens")
