"""EPMoE and the TP hook on a real one-rank gloo group in this process: the expert-parallel MoE (dispatch,
local experts, combine) gives the single-rank MoE's output, an idle call (0 rows) runs every collective, and a
TP-attached model with one rank gives bitwise the plain model's logits."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dsakv.engine.request import SamplingParams
from dsakv.model.layers import MoE
from dsakv.model.loader import load_model
from dsakv.model.parallel import EPMoE, TPGroup, attach, attach_ep, idle_forward
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
