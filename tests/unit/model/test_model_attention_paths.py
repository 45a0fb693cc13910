"""The dense (expanded) path's step tensors: padded queries of a ragged step and the top-k mask, exact values;
and both attention paths on one ragged step with a prefix give the same top-k and logits within rounding."""

from __future__ import annotations

import torch

from dsakv.model.attention import StepContext
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.models import greedy, prompts_for


def ragged_ctx() -> StepContext:
    # sequence 0: 1 cached token + 3 new (positions 1..3); sequence 1: 1 new token (position 0)
    table = torch.tensor([[10, 11, 12, 13], [20, -1, -1, -1]])
    return StepContext(
        out_slots=torch.tensor([11, 12, 13, 20]),
        cos=torch.zeros(4, 1),
        sin=torch.zeros(4, 1),
        pool=None,  # type: ignore[arg-type]  # not read by the helpers under test
        table=table,
        seq_lens=torch.tensor([4, 1]),
        tok_seq=torch.tensor([0, 0, 0, 1]),
        qpos=torch.tensor([1, 2, 3, 0]),
        s_max=4,
        index_topk=2,
        mla_path="expanded",
        decode_only=False,
        t_max=3,
    )


def test_padded_queries_and_topk_mask_exact():
    ctx = ragged_ctx()
    pq = ctx.padded_queries()
    assert pq is not None
    assert pq[0].tolist() == [0, 1, 2, 3, 3, 3]  # sequence 1's padding repeats its one token
    assert pq[1].tolist() == [0, 1, 2, 3]
    x = torch.arange(4.0)[:, None] * 10
    assert ctx.pad_queries(x).squeeze(-1).tolist() == [[0.0, 10.0, 20.0], [30.0, 30.0, 30.0]]
    assert torch.equal(ctx.unpad_queries(ctx.pad_queries(x)), x)
    topk = torch.tensor([[0, 1], [1, 2], [0, 3], [0, -1]])
    mask = ctx.topk_mask(topk, torch.float32)
    assert mask.shape == (2, 1, 3, 4)
    open_cols = (mask[:, 0] == 0).int().tolist()
    assert open_cols == [[[1, 1, 0, 0], [0, 1, 1, 0], [1, 0, 0, 1]], [[1, 0, 0, 0]] * 3]
    assert bool(torch.isneginf(mask[mask != 0]).all())
    assert ctx.topk_mask(topk, torch.float32) is mask  # built once per top-k (shared layers reuse it)
    one = ragged_ctx()
    one.t_max, one.table = 4, one.table[:1]  # a [B, t_max] block already: no padding index at all
    one.tok_seq = torch.zeros(4, dtype=torch.int64)
    assert one.padded_queries() is None


def test_paths_agree_on_a_ragged_prefix_step(tmp_path):
    """Chunked prefill of prompts of different lengths (ragged steps with prefixes): forced absorbed and forced
    expanded give the same greedy tokens and logits within float rounding."""
    spec, model = load_model(make_tiny(tmp_path / "t", seed=3, layers=4))
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=4)
    prompts = prompts_for([3, 11, 26])
    out = {}
    for path in ("absorbed", "expanded"):
        model.set_mla_path(path)
        out[path], _ = greedy(model, layout, prompts, 6, chunk=5)
    model.set_mla_path("auto")
    for a, e in zip(out["absorbed"], out["expanded"], strict=True):
        assert a.generated == e.generated
        assert (torch.stack(a.logits) - torch.stack(e.logits)).abs().max().item() < 1e-4


def test_all_causal_topk_and_query_key_blocks_exact(monkeypatch):
    """index_topk >= S_max: the top-k is every causal position ascending, -1 padded, without scoring; dense
    attention's query blocks each end at their furthest query's position + 1."""
    ctx = ragged_ctx()
    assert ctx.all_causal_topk() is None  # index_topk 2 < S_max 4: a real choice
    ctx = ragged_ctx()
    ctx.index_topk = 5
    assert ctx.all_causal_topk().tolist() == [  # type: ignore[union-attr]
        [0, 1, -1, -1, -1],
        [0, 1, 2, -1, -1],
        [0, 1, 2, 3, -1],
        [0, -1, -1, -1, -1],
    ]
    assert ctx.query_key_blocks() == [(0, 3, 4)]  # t_max 3 <= ATTN_QUERY_BLOCK: one block over S_max
    monkeypatch.setattr("dsakv.model.step_context.ATTN_QUERY_BLOCK", 2)
    ctx = ragged_ctx()  # padded positions [[1, 2, 3], [0, 0, 0]]: columns reach 1, 2, 3
    assert ctx.query_key_blocks() == [(0, 2, 3), (2, 3, 4)]


def test_unscored_topk_and_blocked_attention_match(tmp_path, monkeypatch):
    """A model whose index_topk (16) covers prompts of 5..14 tokens and 2 new ones: the unscored top-k gives
    bitwise the logits of the scored one; dense attention in query blocks of 3 gives the one-block path's tokens
    and logits within rounding (prompts of 26 and 40 tokens in chunks of 13)."""
    spec, model = load_model(make_tiny(tmp_path / "t", seed=3, layers=4))
    assert spec.index_topk == 16
    layout = model.layout_for(kv_format="fp32", index_format="fp32", page_size=4)
    short = prompts_for([5, 14])
    model.set_mla_path("expanded")
    try:
        fast, _ = greedy(model, layout, short, 2)
        with monkeypatch.context() as m:
            m.setattr("dsakv.model.step_context.StepContext.all_causal_topk", lambda self: None)
            scored, _ = greedy(model, layout, short, 2)
        for a, b in zip(fast, scored, strict=True):
            assert a.generated == b.generated
            assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))
        long = prompts_for([26, 40], seed=5)
        one, _ = greedy(model, layout, long, 4, chunk=13)
        with monkeypatch.context() as m:
            m.setattr("dsakv.model.step_context.ATTN_QUERY_BLOCK", 3)
            blocked, _ = greedy(model, layout, long, 4, chunk=13)
        for a, b in zip(one, blocked, strict=True):
            assert a.generated == b.generated
            assert (torch.stack(a.logits) - torch.stack(b.logits)).abs().max().item() < 1e-5
    finally:
        model.set_mla_path("auto")
