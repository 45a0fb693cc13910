"""MoE._routed_one, the batch-1 decode shortcut of the per-expert path (no sort, gather or scatter): bitwise the
grouped per-expert path's output for one float32 token, for top_k 2 and 4 (4: the sum order matters, the test
fails if the experts are not added in expert-id order or a weight is dropped or misplaced)."""

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
