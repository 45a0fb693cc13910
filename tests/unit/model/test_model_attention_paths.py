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
