"""MoE._routed_one, the batch-1 decode shortcut of the per-expert path (no sort, gather or scatter): bitwise the
grouped per-expert path's output for one float32 token, for top_k 2 and 4 (4: the sum order matters, the test
fails if the experts are not added in expert-id order or a weight is dropped or misplaced); and the blocked
down-weight storage (MoEWeights.blocked) against the column layout."""

from __future__ import annotations

import pytest
import torch

import dsakv.model.layers as layers
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny


@pytest.fixture(scope="module", params=[2, 4])
def moe(request, tmp_path_factory):
    k = request.param
    path = make_tiny(tmp_path_factory.mktemp(f"k{k}"), seed=0, layers=2, overrides={"num_experts_per_tok": k})
    _, m = load_model(path)
    return m.model.layers[1].mlp


def test_one_token_equals_the_grouped_per_expert_path(moe, monkeypatch):
    # the tiny shape's rule picks "padded" for one token: force per_expert, whose shortcut _routed_one is
    rule = lambda *a, counts=None: "grouped" if counts is None else "per_expert"  # noqa: E731
    monkeypatch.setattr(layers, "choose_moe_path", rule)
    f = moe._weights()
    seen = set()
    with torch.inference_mode():
        for seed in range(12):
            x = torch.randn(1, moe.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed)) * 4
            weights, ids = moe.gate(x)
            seen.update(ids[0].tolist())
            one = moe._routed_one(x, weights, ids, f)
            ref = moe._routed_grouped(x, weights, ids, f)
            assert torch.equal(one, ref), f"seed {seed}: max diff {float((one - ref).abs().max())}"
            assert torch.equal(moe(x), moe(x.expand(1, -1)))  # forward takes the shortcut (n == 1)
            assert float(one.abs().max()) > 0
    assert len(seen) > moe.gate.top_k  # several expert sets, not one


def test_one_token_shortcut_only_where_per_expert_is_chosen(moe, monkeypatch):
    """forward calls _routed_one for one float32 token only when the rule picks per_expert (padded: bmm)."""
    calls = []
    monkeypatch.setattr(type(moe), "_routed_one", lambda self, *a: calls.append(1) or self._routed_grouped(*a))
    x = torch.randn(1, moe.gate.weight.shape[1])
    with torch.inference_mode():
        for path, hits in (("padded", 0), ("per_expert", 1)):
            rule = lambda *a, counts=None, p=path: "grouped" if counts is None else p  # noqa: E731
            monkeypatch.setattr(layers, "choose_moe_path", rule)
            calls.clear()
            moe(x)
            assert len(calls) == hits
            calls.clear()
            moe(torch.cat([x, x]))  # two tokens: the grouped path
            assert not calls


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """Two loads of a tiny checkpoint with experts wide enough that the dense MoE path never runs (so the downs
    are stored as contiguous blocks) and top_k 4; the second load's MoE kept in the column layout."""
    over = {"moe_intermediate_size": 2048, "num_experts_per_tok": 4}
    path = make_tiny(tmp_path_factory.mktemp("wide"), seed=1, layers=2, overrides=over)
    return load_model(path)[1].model.layers[1].mlp, load_model(path)[1].model.layers[1].mlp


def test_blocked_downs_alias_the_weights_and_give_the_column_layouts_outputs(wide, monkeypatch):
    """MoEWeights.blocked: each expert's (and the shared expert's) down weight a contiguous block of the flat
    w_down, values and state-dict names unchanged; the per-expert and padded paths give the column layout's
    outputs (per-expert bitwise, padded within float32 rounding)."""
    moe, col = wide
    before = {k: v.detach().clone() for k, v in moe.state_dict().items()}
    f = moe._weights()
    after = moe.state_dict()
    assert f.blocked and list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    inter, hidden = moe.experts[0].down_proj.weight.shape[1], moe.experts[0].down_proj.weight.shape[0]
    size = f.w_down.element_size()
    for e, m in enumerate(moe.experts):
        assert m.down_proj.weight.is_contiguous()
        assert m.down_proj.weight.data_ptr() == f.w_down.data_ptr() + e * hidden * inter * size
        assert torch.equal(f.down[e], m.down_proj.weight)
    assert moe.shared_experts.down_proj.weight.data_ptr() == f.shared_down.data_ptr()
    with monkeypatch.context() as mp:  # the column layout: built while the rule says dense for one token
        mp.setattr(layers, "choose_moe_path", lambda *a, counts=None: "dense")
        fc = col._weights()
    assert not fc.blocked and not col.experts[1].down_proj.weight.is_contiguous()
    x = torch.randn(6, hidden, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        for rows in (1, 6):  # one token (_routed_one), a decode batch (per-expert)
            assert torch.equal(moe(x[:rows]), col(x[:rows]))
        monkeypatch.setattr(
            layers, "choose_moe_path", lambda *a, counts=None: "grouped" if counts is None else "padded"
        )
        torch.testing.assert_close(moe(x), col(x), rtol=1e-5, atol=1e-5)
