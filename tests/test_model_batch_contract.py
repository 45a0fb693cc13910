"""ForwardBatch contract: inconsistent batches and foreign pools are refused with a message that says why."""

from __future__ import annotations

import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.model.batch import ForwardBatch
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.spec.layout import KVLayout
from dsakv.spec.presets import load_spec


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    _, m = load_model(make_tiny(tmp_path_factory.mktemp("glm"), seed=0, layers=2))
    return m


def batch(**kw):
    base = dict(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([0, 1, 2]),
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([3]),
        slot_table=torch.tensor([[4, 5, 6, -1]]),
        out_slots=torch.tensor([4, 5, 6]),
    )
    base.update(kw)
    return ForwardBatch(**base)


def test_valid_batch_runs(model):
    pool = DevicePool(model.layout_for(page_size=4), 3)
    assert model(batch(), pool).shape == (1, 512)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(out_slots=torch.tensor([4, 5, 7])), "differ from its slot_table entries"),
        (dict(extend_lens=torch.tensor([2])), "sum to the 3 new tokens"),
        (dict(positions=torch.tensor([0, 1])), "one position and one slot per new token"),
        (dict(slot_table=torch.tensor([[4, 5]])), "widen the table"),
        (dict(prefix_lens=torch.tensor([0, 0])), "batch shapes disagree"),
    ],
)
def test_bad_batches(model, kw, match):
    pool = DevicePool(model.layout_for(page_size=4), 3)
    with pytest.raises(ValueError, match=match):
        model(batch(**kw), pool)


def test_slots_outside_pool(model):
    pool = DevicePool(model.layout_for(page_size=4), 1)
    with pytest.raises(IndexError, match="the pool has slots 0..3"):
        model(batch(), pool)


def test_pool_of_another_model(model):
    pool = DevicePool(KVLayout(load_spec("tiny"), page_size=4), 3)  # 12 layers, the model has 2
    with pytest.raises(ValueError, match="build it with model.layout_for"):
        model(batch(), pool)
