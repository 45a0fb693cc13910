"""EPMoE and the TP hook on a real one-rank gloo group in this process: the expert-parallel MoE (dispatch,
local experts, combine) gives the single-rank MoE's output, an idle call (0 rows) runs every collective, and a
TP-attached model with one rank gives bitwise the plain model's logits. Elastic EP: a rank running its home half
plus the other half as guests loaded from the checkpoint (a re-formed group of one) gives bitwise the output of
the rank that held every expert; ep_owners' placement over survivors, exactly."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsakv.engine.request import SamplingParams
from dsakv.model.layers import MoE
from dsakv.model.loader import load_experts, load_model
from dsakv.model.parallel import EPMoE, TPGroup, attach, attach_ep, ep_owners, idle_forward
from dsakv.testing.config import engine_config
from dsakv.testing.engines import engine, prompts_for, tiny_path
from dsakv.util.procs import free_ports

ARCH = "glm_moe_dsa"


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_ports(1)}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_ep_moe_matches_moe_and_idles(one_rank_group) -> None:
    _, model = load_model(tiny_path(ARCH))
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoE)
    x = torch.randn(37, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        ref = moe.forward(x, residual=x.clone())
        ep = EPMoE(moe, 0, 1)
        got = ep.forward(x, residual=x.clone())
        assert ep.forward(x[:0]).shape == (0, model.spec.hidden_size)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    attach_ep(model, 0, 1)
    assert idle_forward(model) == 11  # the 11 MoE layers of the tiny checkpoint (layer 0 is dense)
    assert [m.calls for m in (layer.mlp for layer in model.model.layers) if isinstance(m, EPMoE)] == [1] * 11


def test_one_rank_tp_hook_is_the_plain_arithmetic() -> None:
    prompts = prompts_for([7, 12], seed=2)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    plain = engine(ARCH, page_size=4, max_tokens=256).generate(prompts, params)
    spec, model = load_model(tiny_path(ARCH))
    attach(model, TPGroup(0, 1))
    from dsakv.engine.engine import Engine

    assert Engine((spec, model), engine_config(page_size=4, max_tokens=256)).generate(prompts, params) == plain


def test_ep_moe_guests_from_the_checkpoint_give_the_same_output() -> None:
    path = tiny_path(ARCH)
    _, model = load_model(path)
    moe = model.model.layers[1].mlp
    assert isinstance(moe, MoE) and len(moe.experts) == 8
    x = torch.randn(37, model.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    guests = load_experts(path, {1: [4, 5, 6, 7]})
    assert sorted(guests) == [(1, 4), (1, 5), (1, 6), (1, 7)]
    for e in range(4, 8):
        for w in ("gate_proj", "up_proj", "down_proj"):
            assert torch.equal(getattr(guests[(1, e)], w).weight, getattr(moe.experts[e], w).weight), (e, w)
    with torch.inference_mode():
        whole = EPMoE(moe, 0, 1)
        ref = whole.forward(x, residual=x.clone())
        half = EPMoE(moe, 0, 2)  # home experts 0..3; dp rank 1 (4..7) is down: its experts run here
        assert half.mine == [0, 1, 2, 3]
        half.place(ep_owners(8, 2, [0]), 0, 1, {e: guests[(1, e)] for e in range(4, 8)})
        assert half.mine == list(range(8))
        got = half.forward(x, residual=x.clone())
    assert torch.equal(got, ref)


def test_ep_owners_places_the_dead_ranks_experts_round_robin() -> None:
    assert ep_owners(8, 2, [0, 1]) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert ep_owners(8, 2, [0]) == [0] * 8
    assert ep_owners(8, 4, [0, 2, 3]) == [0, 0, 0, 2, 2, 2, 3, 3]
    assert ep_owners(8, 4, [3, 0]) == [0, 0, 0, 3, 0, 3, 3, 3]
