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
    """Decode reads few rows per token: absorbed; a prefill chunk whose top-k covers much of its context attends
    densely (expanded); one whose top-k is a small part of it, or a ragged step the dense path would pad many
    times over, gathers its picks (absorbed). Costs count multiply-adds and the elements each path moves."""
    from dsakv.model.attention import ELEM_MACS, choose_mla_path, mla_path_costs

    tiny = dict(heads=4, rank=64, rope=16, nope=16, v=16)
    assert choose_mla_path("auto", num_tokens=16, num_rows=16 * 80, k=16, seqs=16, s_max=80, t_max=1, **tiny) == (
        "absorbed"
    )  # decode, batch 16
    assert choose_mla_path("auto", num_tokens=1, num_rows=3, k=3, **tiny) == "absorbed"
    assert choose_mla_path("auto", num_tokens=512, num_rows=512, k=512, **tiny) == "expanded"  # top-k covers it all
    assert choose_mla_path("auto", num_tokens=512, num_rows=512, k=16, **tiny) == "absorbed"  # 16 of 512 keys
    # exact costs: absorbed = T*H*(n*r + k*(2r+d) + r*v) + ELEM_MACS * 2*T*k*(r+d+H);
    # expanded = R*H*r*(n+v) + T*S*H*(n+d+v) + ELEM_MACS * (2*R*H*(2(n+v)+d) + 2*T*S)
    a, e = mla_path_costs(512, 512, 512, **tiny)
    assert a == 512 * 4 * (16 * 64 + 512 * 144 + 64 * 16) + ELEM_MACS * 2 * 512 * 512 * 84
    assert e == 512 * 4 * 64 * 32 + 512 * 512 * 4 * 48 + ELEM_MACS * (2 * 512 * 4 * 80 + 2 * 512 * 512)
    # GLM-5.2 shapes: a 4K prefill chunk expands, a decode step at 4K context absorbs
    glm = dict(heads=64, rank=512, rope=64, nope=192, v=256)
    assert choose_mla_path("auto", num_tokens=4096, num_rows=4096, k=2048, **glm) == "expanded"
    assert choose_mla_path("auto", num_tokens=1, num_rows=4096, k=2048, **glm) == "absorbed"
    assert choose_mla_path("expanded", num_tokens=1, num_rows=4096, k=2048, **glm) == "expanded"
    # a 4K chunk batched with 15 decode tokens: dense would pad all 16 sequences to 4K queries
    ragged = dict(seqs=16, s_max=4096, t_max=4096)
    assert choose_mla_path("auto", num_tokens=4096 + 15, num_rows=16 * 4096, k=2048, **ragged, **glm) == "absorbed"
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
    """dense, padded and per-expert MoE give the same outputs within float32 rounding."""
    import dsakv.model.layers as layers

    moe = model.model.layers[1].mlp
    x = torch.randn(tokens, model.spec.hidden_size, generator=torch.Generator().manual_seed(tokens))
    outs = {}
    for path in ("dense", "padded", "per_expert"):
        grouped = "grouped" if path != "dense" else "dense"
        monkeypatch.setattr(
            layers, "choose_moe_path", lambda *a, counts=None, p=path, g=grouped: g if counts is None else p
        )
        bmm, calls = torch.bmm, []
        monkeypatch.setattr(torch, "bmm", lambda *a, c=calls, f=bmm, **k: c.append(1) or f(*a, **k))
        with torch.inference_mode():
            outs[path] = moe(x)
        monkeypatch.setattr(torch, "bmm", bmm)
        assert bool(calls) is (path == "padded")  # the path asked for ran (only padded runs batched matmuls)
    torch.testing.assert_close(outs["dense"], outs["per_expert"], rtol=1e-6, atol=1e-6)
    # padded's batched matmul may sum in another order than per-expert's matmuls at several rows an expert
    torch.testing.assert_close(outs["padded"], outs["per_expert"], rtol=1e-6, atol=1e-6)


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


def test_moe_fused_storage_aliases_every_weight(model):
    """MoE._weights: routed experts, router and shared expert are views of w_in [expert 0 gate | up, ... | router
    | shared gate | shared up] and w_down [downs | shared down]; values and state-dict names unchanged; in-place
    updates (load_state_dict) reach the fused tensors."""
    moe = model.model.layers[1].mlp
    before = {k: v.detach().clone() for k, v in moe.state_dict().items()}
    f = moe._weights()
    after = moe.state_dict()
    assert list(after) == list(before) and all(torch.equal(after[k], before[k]) for k in before)
    e, (inter, hidden) = len(moe.experts), moe.experts[0].gate_proj.weight.shape
    shared = moe.shared_experts.gate_proj.weight.shape[0]
    width = e * inter + shared
    assert f.router_rows == e  # float32 model: the router fuses too
    assert tuple(f.w_in.shape) == (e + 2 * width, hidden) and tuple(f.w_down.shape) == (hidden, width)
    row = f.w_in.stride(0) * f.w_in.element_size()
    assert moe.experts[3].gate_proj.weight.data_ptr() == f.w_in.data_ptr() + 6 * inter * row
    assert moe.experts[3].up_proj.weight.data_ptr() == f.w_in.data_ptr() + 7 * inter * row
    assert moe.gate.weight.data_ptr() == f.w_in.data_ptr() + 2 * e * inter * row
    assert moe.shared_experts.gate_proj.weight.data_ptr() == f.w_in.data_ptr() + (2 * e * inter + e) * row
    assert moe.shared_experts.up_proj.weight.data_ptr() == f.w_in.data_ptr() + (2 * e * inter + e + shared) * row
    assert f.tail.data_ptr() == moe.gate.weight.data_ptr()
    col = f.w_down.element_size()
    assert moe.experts[3].down_proj.weight.data_ptr() == f.w_down.data_ptr() + 3 * inter * col
    assert moe.shared_experts.down_proj.weight.data_ptr() == f.w_down.data_ptr() + e * inter * col
    assert torch.equal(f.gate_up[3], torch.cat([moe.experts[3].gate_proj.weight, moe.experts[3].up_proj.weight]))
    assert f.gate_ups[3].data_ptr() == moe.experts[3].gate_proj.weight.data_ptr()
    assert torch.equal(f.down[3], before["experts.3.down_proj.weight"])
    with torch.no_grad():
        moe.experts[3].down_proj.weight.add_(1.0)
    assert torch.equal(f.w_down[:, 3 * inter : 4 * inter], before["experts.3.down_proj.weight"] + 1.0)
    with torch.no_grad():
        moe.experts[3].down_proj.weight.copy_(before["experts.3.down_proj.weight"])
    assert moe._weights() is f  # storage did not move: not rebuilt


def test_linear_add_is_residual_plus_linear(model):
    from dsakv.model.layers import linear_add

    o = model.model.layers[0].self_attn.o_proj
    g = torch.Generator().manual_seed(3)
    x, res = torch.randn(5, o.weight.shape[1], generator=g), torch.randn(5, o.weight.shape[0], generator=g)
    assert torch.equal(linear_add(x, o, None), torch.nn.functional.linear(x, o.weight))
    torch.testing.assert_close(linear_add(x, o, res), res + torch.nn.functional.linear(x, o.weight), rtol=0, atol=1e-6)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotation_matrix_entries(interleaved):
    """rope.rotation_matrix scatters cos, -sin, cos, sin (and 1 on the un-roped rest) at the documented entries."""
    from dsakv.model.rope import apply_half_split, apply_interleaved, rotation_matrix

    cos, sin = torch.tensor([[0.5, 0.25]]), torch.tensor([[2.0, 4.0]])
    rot = rotation_matrix(cos, sin, 5, interleaved)[0]
    c0, c1, s0, s1 = 0.5, 0.25, 2.0, 4.0
    if interleaved:  # pairs (0, 1), (2, 3): out[2i] = x[2i] c - x[2i+1] s, out[2i+1] = x[2i+1] c + x[2i] s
        want = [[c0, 0, s0, 0, 0], [-s0, 0, c0, 0, 0], [0, c1, 0, s1, 0], [0, -s1, 0, c1, 0], [0, 0, 0, 0, 1]]
    else:  # halves (0, 2), (1, 3)
        want = [[c0, 0, s0, 0, 0], [0, c1, 0, s1, 0], [-s0, 0, c0, 0, 0], [0, -s1, 0, c1, 0], [0, 0, 0, 0, 1]]
    assert torch.equal(rot, torch.tensor(want))
    x = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(0))
    apply = apply_interleaved if interleaved else apply_half_split
    torch.testing.assert_close(torch.matmul(x, rotation_matrix(cos, sin, 4, interleaved)), apply(x, cos, sin))


def test_selection_without_masks_when_every_pick_is_causal(model):
    """A step whose tokens all have >= k causal keys (full_topk) builds its selection without masking; the same
    positions, valid flags, additive mask and slots as the masked build."""
    from dataclasses import replace

    pool = DevicePool(model.layout_for(kv_format="fp32", index_format="fp32", page_size=4), 12)
    b = ForwardBatch(
        input_ids=torch.tensor([5, 6]),
        positions=torch.tensor([20, 17]),
        prefix_lens=torch.tensor([20, 17]),
        extend_lens=torch.tensor([1, 1]),
        slot_table=torch.arange(2 * 21).view(2, 21).where(torch.arange(21) <= torch.tensor([[20], [17]]), -1),
        out_slots=torch.tensor([20, 21 + 17]),
    )
    with torch.inference_mode():
        ctx = model.make_context(b, pool)
        assert ctx.full_topk and ctx.decode_only and ctx.k_sel == 16
        topk = torch.stack([torch.arange(16) + 2, torch.arange(16)])
        fast = ctx.selection(topk, torch.float32)
        slow = replace(ctx, full_topk=False, _memo={}, _selections=[]).selection(topk, torch.float32)
    for a, c in zip(fast, slow, strict=True):
        assert torch.equal(a, c)
    assert bool(fast[1].all()) and not bool(fast[2].any())
    assert fast[3].tolist() == [list(range(2, 18)), list(range(21, 37))]
