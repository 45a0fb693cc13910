"""Planner over a rank grid (TP x DP [attention] x EP x PP): tokens per rank and per instance, weights per rank."""

from __future__ import annotations

import json

import pytest

from dsakv.cli.main import main
from dsakv.errors import ConfigError
from dsakv.plan import Deployment, parse_size, plan
from dsakv.plan.ranks import RankGrid
from dsakv.plan.weights import (
    embedding_bytes,
    layer_weight_bytes,
    lm_head_bytes,
    model_weight_bytes,
    reform_headroom_bytes,
)
from dsakv.spec import load_spec

SEED = ["plan", "glm-5.2", "--role", "decode", "--kv-budget", "96.33GiB", "--draft-layers", "1"]


def test_seed_decode_tp8_dp8_dp_attention_cli(capsys) -> None:
    assert main([*SEED, "--tp", "8", "--dp", "8", "--enable-dp-attention"]) == 0
    out = capsys.readouterr().out
    assert "ranks: tp 8 x dp 8 with DP attention (attention TP 1, 8 pools), ep 1, pp 1: 8 GPUs" in out
    assert "per rank: dense 1,661,504 / elided 1,889,920 tokens" in out
    assert "per instance (8 pool(s)): dense 13,292,032 / elided 15,119,360 tokens" in out
    assert 8 * 1_661_504 == 13_292_032 and 8 * 1_889_920 == 15_119_360


def test_seed_decode_tp8_dp8_json(capsys) -> None:
    assert main([*SEED, "--tp", "8", "--dp", "8", "--enable-dp-attention", "--ep", "8", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)["ranks"]
    assert (r["tokens_per_rank_dense"], r["tokens_per_rank_elided"]) == (1_661_504, 1_889_920)
    assert (r["tokens_per_instance_dense"], r["tokens_per_instance_elided"]) == (13_292_032, 15_119_360)
    assert (r["attention_tp"], r["moe_tp"], r["pools_per_stage"], r["world_size"]) == (1, 1, 8, 8)
    assert r["kv_bytes_per_rank"] == [parse_size("96.33GiB")]
    spec = load_spec("glm-5.2")
    g = RankGrid(tp=8, dp=8, dp_attention=True, ep=8)
    expect = sum(layer_weight_bytes(spec, i, "bf16", g) for i in range(79))
    assert r["weight_bytes_per_rank_estimate"] == [expect + embedding_bytes(spec, g) + lm_head_bytes(spec, g)]
    # elastic EP: a survivor of one rank's death loads ceil(32 / 7) = 5 of its experts in each of the 75 main MoE
    # layers (3..77; the draft layer is whole on every DP rank: nothing to load), 3 x 6144 x 2048 bf16 each
    assert r["reform_headroom_bytes_per_rank"] == [75 * 5 * 3 * 6144 * 2048 * 2] == [28_311_552_000]


def test_reform_headroom_only_with_dp_attention_and_ep(capsys) -> None:
    spec = load_spec("glm-5.2")
    assert reform_headroom_bytes(spec, 0, 79, "bf16", RankGrid(tp=8)) == 0
    assert reform_headroom_bytes(spec, 0, 79, "bf16", RankGrid(tp=8, dp=8, dp_attention=True)) == 0  # ep 1
    two = RankGrid(tp=2, dp=2, dp_attention=True, ep=2)  # the dead rank's 128 experts all on the survivor
    assert reform_headroom_bytes(spec, 0, 79, "bf16", two) == 75 * 128 * 3 * 6144 * 2048 * 2
    gpu = ["plan", "glm-5.2", "--role", "decode", "--gpu-memory", "192GiB", "--weight-format", "fp8", "--tp", "8"]
    gpu += ["--dp", "8"]
    assert main([*gpu, "--enable-dp-attention", "--ep", "8", "--json"]) == 0
    elastic = json.loads(capsys.readouterr().out)["ranks"]["kv_bytes_per_rank"][0]
    assert main([*gpu, "--enable-dp-attention", "--json"]) == 0  # ep 1: no headroom
    plain = json.loads(capsys.readouterr().out)["ranks"]["kv_bytes_per_rank"][0]
    weights = [layer_weight_bytes(spec, 3, "fp8", RankGrid(tp=8, dp=8, dp_attention=True, ep=e)) for e in (8, 1)]
    assert weights[0] == weights[1]  # routed experts split over the 8 ranks of the MoE group either way
    # the budget leaves the headroom free: 5 experts x 75 layers in fp8 (1 byte + a 4-byte scale per 128 x 128 block)
    assert plain - elastic == 75 * 5 * 3 * 6144 * 2048 * (1 + 4 / 128**2) == 14_159_232_000


def test_plain_tp_holds_one_pool() -> None:
    """TP 8 without DP attention: 8 GPUs hold 8 copies of the same requests' keys, one pool per instance."""
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, draft_layers=1, kv_budget=parse_size("96.33GiB"), tp=8))
    assert (rp.tokens_elided, rp.instance_tokens_elided) == (1_889_920, 1_889_920)
    rp2 = plan(Deployment(spec, draft_layers=1, kv_budget=parse_size("96.33GiB"), tp=8, dp=2))  # 2 replicas
    assert (rp2.instance_tokens_dense, rp2.deployment.grid.world_size) == (2 * 1_661_504, 16)


def test_pp_with_dp_attention_binds_on_the_smallest_stage() -> None:
    spec = load_spec("glm-5.2")
    d = Deployment(
        spec,
        role="prefill",
        partition=(20, 20, 20, 18),
        draft_layers=1,
        kv_budget=105_256_000_000,
        tp=4,
        dp=2,
        enable_dp_attention=True,
    )
    rp = plan(d)
    assert (rp.tokens_dense, rp.tokens_elided) == (6_360_640, 7_096_512)  # the seed's PP=4 figures, per rank
    assert (rp.instance_tokens_dense, rp.instance_tokens_elided) == (12_721_280, 14_193_024)
    r = rp.ranks_dict()
    assert (r["attention_tp"], r["ranks_per_stage"], r["world_size"]) == (2, 4, 16)


def test_layer_weights_per_rank_exact() -> None:
    """Layer 0 of GLM-5.2 (dense MLP, producer) in bf16, worked by hand:
    replicated q_a 6144x2048 + kv_a 6144x576 + indexer 2048x32x128 + 6144x128 = 25,296,896;
    head-split q_b 2048x64x256 + kv_b 512x64x448 + o 64x256x6144 = 148,897,792; MLP 3x6144x12288 = 226,492,416;
    norms 211,712 (replicated)."""
    spec = load_spec("glm-5.2")
    rep, split, mlp, high = 25_296_896, 148_897_792, 226_492_416, 211_712
    assert layer_weight_bytes(spec, 0, "bf16") == (rep + split + mlp + high) * 2 == 801_797_632
    assert layer_weight_bytes(spec, 0, "bf16", RankGrid(tp=8)) == (rep + (split + mlp) // 8 + high) * 2 == 144_864_768
    dpa = RankGrid(tp=8, dp=2, dp_attention=True)  # attention TP 4: heads and the dense MLP over 4 ranks
    assert layer_weight_bytes(spec, 0, "bf16", dpa) == (rep + (split + mlp) // 4 + high) * 2 == 238_712_320
    # routed experts split over all 8 ranks of the MoE group whatever the attention split
    routed = 256 * 3 * 6144 * 2048
    moe8 = layer_weight_bytes(spec, 3, "bf16", RankGrid(tp=8, dp=8, dp_attention=True, ep=8))
    one = layer_weight_bytes(spec, 3, "bf16")
    assert one - moe8 == routed * 2 * 7 // 8
    # the MTP draft layer (78) under DP attention: whole on every DP rank (each drafts for its own requests, no
    # collective in a draft); under plain TP its experts are split like the main layers'
    dp8 = RankGrid(tp=8, dp=8, dp_attention=True, ep=8)
    assert layer_weight_bytes(spec, 78, "bf16", dp8) == layer_weight_bytes(spec, 78, "bf16")
    assert layer_weight_bytes(spec, 78, "bf16") - layer_weight_bytes(spec, 78, "bf16", RankGrid(tp=8)) > routed * 7 // 4
    # single rank == the whole model
    whole = sum(layer_weight_bytes(spec, i, "fp8") for i in range(79)) + embedding_bytes(spec) + lm_head_bytes(spec)
    assert model_weight_bytes(spec, "fp8") == whole
    assert embedding_bytes(spec, RankGrid(tp=8)) == 154880 * 6144 * 2 // 8


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tp": 8, "dp": 3, "dp_attention": True}, r"--tp 8 is not a multiple of --dp 3.*pick a --dp dividing 8"),
        ({"tp": 8, "ep": 3}, r"--ep 3 does not divide --tp 8"),
        ({"tp": 2, "dp_attention": True}, r"--enable-dp-attention needs --dp > 1"),
        ({"tp": 0}, r"--tp 0 must be an integer >= 1"),
    ],
)
def test_bad_grids_are_named(kw, match) -> None:
    with pytest.raises(ConfigError, match=match):
        RankGrid(**kw)


def test_heads_must_split_over_attention_tp(capsys) -> None:
    with pytest.raises(ConfigError, match=r"64 attention heads, not divisible over 3 attention-TP ranks"):
        Deployment(load_spec("glm-5.2"), kv_budget=1 << 30, tp=3)
    assert main([*SEED, "--tp", "6", "--dp", "2", "--enable-dp-attention"]) == 2
    assert "not divisible over 3 attention-TP ranks (--tp 6 / --dp 2)" in capsys.readouterr().err
