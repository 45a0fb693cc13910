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


def test_mla_path_rule():
    """Decode reads few rows per token: absorbed; a long prefill chunk reuses every expanded row: expanded."""
    from dsakv.model.attention import choose_mla_path

    tiny = dict(heads=4, rank=64, rope=16, nope=16, v=16)
    assert choose_mla_path("auto", num_tokens=16, num_rows=16 * 80, k=16, **tiny) == "absorbed"  # decode, batch 16
    assert choose_mla_path("auto", num_tokens=1, num_rows=3, k=3, **tiny) == "absorbed"
    assert choose_mla_path("auto", num_tokens=512, num_rows=512, k=16, **tiny) == "expanded"  # prefill chunk
    # GLM-5.2 shapes: a 4K prefill chunk expands, a decode step at 4K context absorbs
    glm = dict(heads=64, rank=512, rope=64, nope=192, v=256)
    assert choose_mla_path("auto", num_tokens=4096, num_rows=4096, k=2048, **glm) == "expanded"
    assert choose_mla_path("auto", num_tokens=1, num_rows=4096, k=2048, **glm) == "absorbed"
    assert choose_mla_path("expanded", num_tokens=1, num_rows=4096, k=2048, **glm) == "expanded"
    with pytest.raises(ValueError, match="use one of auto, absorbed, expanded"):
        choose_mla_path("dense", num_tokens=1, num_rows=1, k=1, **glm)


def test_set_mla_path_refuses_unknown(model):
    with pytest.raises(ValueError, match="mla path 'flash'"):
        model.set_mla_path("flash")
    assert model.mla_path == "auto"


def test_moe_path_rule():
    from dsakv.model.layers import choose_moe_path

    tiny = dict(top_k=2, experts=8, row_macs=3 * 64 * 32)
    assert choose_moe_path(1, **tiny) == "dense"  # decode, batch 1 and 16
    assert choose_moe_path(16, **tiny) == "dense"
    assert choose_moe_path(256, **tiny) == "grouped"  # a prefill chunk
    assert choose_moe_path(256, counts=[64] * 8, **tiny) == "padded"  # balanced: no padding
    glm = dict(top_k=8, experts=256, row_macs=3 * 6144 * 2048)
    assert choose_moe_path(16, **glm) == "grouped"
    assert choose_moe_path(16, counts=[1] * 128 + [0] * 128, **glm) == "per_expert"


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_moe_paths_agree(model, tokens, monkeypatch):
    """dense, padded and per-expert MoE give the same outputs (top_k 2: the same sums, bitwise)."""
    import dsakv.model.layers as layers

    moe = model.model.layers[1].mlp
    x = torch.randn(tokens, model.spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
    outs = {}
    for path in ("dense", "padded", "per_expert"):
        grouped = "grouped" if path != "dense" else "dense"
        monkeypatch.setattr(
            layers, "choose_moe_path", lambda *a, counts=None, p=path, g=grouped: g if counts is None else p
        )
        with torch.inference_mode():
            outs[path] = moe(x)
    torch.testing.assert_close(outs["dense"], outs["per_expert"], rtol=1e-6, atol=1e-6)
    assert torch.equal(outs["padded"], outs["per_expert"])


def test_fused_projections_alias_the_weights(model):
    """LinearGroup re-points each member's weight into the fused tensor: no copy, the state dict unchanged."""
    attn = model.model.layers[0].self_attn
    w_before = attn.q_a_proj.weight.detach().clone()
    fused = attn._x_proj._current()[0]
    assert attn.q_a_proj.weight.data_ptr() == fused.data_ptr()
    assert torch.equal(attn.q_a_proj.weight, w_before)
    n = attn.q_a_proj.weight.shape[0]
    with torch.no_grad():
        attn.q_a_proj.weight.add_(1.0)  # an in-place update (load_state_dict) reaches the fused weight
    assert torch.equal(fused[:n], w_before + 1.0)
    with torch.no_grad():
        attn.q_a_proj.weight.copy_(w_before)
