"""Pipeline stages: each stage's pool holds only its layers; chained stage_forward equals forward bit for bit."""

from __future__ import annotations

import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.model.batch import ForwardBatch
from dsakv.spec.layout import BufferKey, Kind
from dsakv.testing.engines import tiny_model
from dsakv.testing.models import greedy, greedy_pp, prompts_for


@pytest.fixture(scope="module")
def model():
    return tiny_model("glm_moe_dsa")[1]  # the suite's one cached tiny GLM checkpoint (seed 0)


# (0..3 | 4..7 | 8..11): layers 4 and 8 are shared and reuse producers 2 and 6 of the previous stage
@pytest.mark.parametrize("bounds", [[0, 4, 8, 12], [0, 3, 12], [0, 7, 11, 12]])
@pytest.mark.parametrize("kv_format,index_format", [("fp32", "fp32"), ("fp8-656", "fp8-132")])
def test_stages_equal_whole_model(model, bounds, kv_format, index_format):
    prompts = prompts_for([21, 5, 37], seed=7)
    whole, _ = greedy(model, model.layout_for(kv_format=kv_format, index_format=index_format, page_size=8), prompts, 10)
    layouts = [
        model.layout_for(kv_format=kv_format, index_format=index_format, page_size=8, layer_start=a, layer_end=b)
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    staged, pools = greedy_pp(model, layouts, prompts, 10, chunk=12)
    chunked, _ = greedy(
        model, model.layout_for(kv_format=kv_format, index_format=index_format, page_size=8), prompts, 10, chunk=12
    )
    for a, b, c in zip(whole, staged, chunked, strict=True):
        assert b.generated == a.generated == c.generated
        assert all(torch.equal(x, y) for x, y in zip(b.logits, c.logits, strict=True))
    # each stage pool holds its own layers, and index-K for its producers only
    for pool, lay in zip(pools, layouts, strict=True):
        assert sorted({k.layer for k in pool.keys}) == list(range(lay.layer_start, lay.end))
        assert [k.layer for k in pool.keys if k.kind is Kind.INDEX_K] == [
            i for i in (0, 1, 2, 6, 10) if lay.layer_start <= i < lay.end
        ]


def test_stage_contract_errors(model):
    stage1 = DevicePool(model.layout_for(kv_format="fp32", index_format="fp32", page_size=4, layer_start=4), 2)
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 6]),
        positions=torch.tensor([0, 1]),
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([2]),
        slot_table=torch.tensor([[0, 1]]),
        out_slots=torch.tensor([0, 1]),
    )
    with pytest.raises(ValueError, match="use stage_forward"):
        model(batch, stage1)
    with pytest.raises(ValueError, match="pass the previous stage's StageCarry"):
        model.stage_forward(batch, stage1)
    stage0 = DevicePool(model.layout_for(kv_format="fp32", index_format="fp32", page_size=4, layer_end=4), 2)
    carry = model.stage_forward(batch, stage0)
    assert carry.logits is None and carry.hidden.shape == (2, 64) and carry.topk.shape == (2, 16)
    assert carry.topk[1, :2].tolist() in ([0, 1], [1, 0]) and carry.topk[:, 2:].eq(-1).all()
    with pytest.raises(ValueError, match="pass carry=None"):
        model.stage_forward(batch, stage0, carry)
    with pytest.raises(KeyError, match="outside this layout"):
        stage0.tensor(BufferKey(4, Kind.KV))
    out = model.stage_forward(batch, stage1, carry)
    assert out.logits is not None and out.logits.shape == (1, 512)
