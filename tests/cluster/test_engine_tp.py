"""Tensor-parallel engine ranks: `dsakv generate --tp-size T` runs T processes (torch.distributed, gloo on
127.0.0.1), each with its shard of the heads, dense MLP and experts and a full copy of the keys; the tokens equal
the single-rank engine's (and so transformers'), greedy and seeded."""

from __future__ import annotations

import json

import pytest
import torch

from dsakv.cli.main import main
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import _convert, _read_tensors, _safetensors_files, load_config
from dsakv.model.parallel import shard_config, shard_state_dict
from dsakv.spec import ModelSpec
from dsakv.testing.engines import engine, hf_greedy, prompts_for, tiny_path

ARCH = "glm_moe_dsa"


def _argv(prompts: list[list[int]], *extra: str) -> list[str]:
    argv = ["generate", "--model", str(tiny_path(ARCH)), "--max-new-tokens", "10", "--ignore-eos", "--page-size", "4"]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    return argv + ["--threads", "1", "--max-tokens", "512", "--json", *extra]


def test_shards_partition_every_split_tensor() -> None:
    """Rank r of 2 holds heads [2r, 2r+2) of q_b / kv_b / o_proj and half of every MLP / expert intermediate;
    the shards concatenate back to the checkpoint exactly; everything else is the same tensor on both ranks."""
    root = tiny_path(ARCH)
    cfg = load_config(root)
    sd = _convert(_read_tensors(_safetensors_files(root)), ModelSpec.from_dict(cfg))
    shards = [shard_state_dict(sd, r, 2) for r in range(2)]
    c2 = shard_config(cfg, 2)
    assert (c2["num_attention_heads"], c2["intermediate_size"], c2["moe_intermediate_size"]) == (2, 64, 16)
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    a = "model.layers.0.self_attn."
    assert tuple(shards[1][a + "q_b_proj.weight"].shape) == (2 * qk, cfg["q_lora_rank"])
    assert torch.equal(shards[1][a + "q_b_proj.weight"], sd[a + "q_b_proj.weight"][2 * qk :])
    assert torch.equal(torch.cat([s[a + "o_proj.weight"] for s in shards], 1), sd[a + "o_proj.weight"])
    assert torch.equal(torch.cat([s[a + "kv_b_proj.weight"] for s in shards], 0), sd[a + "kv_b_proj.weight"])
    e = "model.layers.1.mlp."
    for name, dim in (("experts.3.gate_proj", 0), ("experts.3.down_proj", 1), ("shared_experts.up_proj", 0)):
        assert torch.equal(torch.cat([s[e + name + ".weight"] for s in shards], dim), sd[e + name + ".weight"])
    split = 0
    for name, t in sd.items():
        if shards[0][name].shape == t.shape:
            assert torch.equal(shards[0][name], t) and torch.equal(shards[1][name], t), name  # replicated
        else:
            split += 1
    # per layer q_b, kv_b, o_proj + 3 MLP (dense layer 0) or 3 x (8 experts + 1 shared) (layers 1..11)
    assert split == 12 * 3 + 3 + 11 * 27
    with pytest.raises(Exception, match=r"num_attention_heads = 4 is not divisible by --tp-size 3"):
        shard_config(cfg, 3)


def test_generate_tp2_greedy_equals_single_rank_and_transformers(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = prompts_for([11, 5, 17], seed=7)
    assert main(_argv(prompts, "--tp-size", "2")) == 0
    rows = json.loads(capsys.readouterr().out)
    single = engine(ARCH, page_size=4, max_tokens=512).generate(
        prompts, SamplingParams(max_new_tokens=10, ignore_eos=True)
    )
    assert [r["output_ids"] for r in rows] == single
    assert single == [hf_greedy(ARCH, tuple(p), 10) for p in prompts]


def test_generate_tp2_seeded_sampling_equals_single_rank(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = prompts_for([9, 14], seed=8)
    argv = _argv(prompts, "--temperature", "0.9", "--top-p", "0.95", "--seed", "11")
    assert main([*argv, "--tp-size", "2"]) == 0
    tp = [r["output_ids"] for r in json.loads(capsys.readouterr().out)]
    assert main(argv) == 0
    one = [r["output_ids"] for r in json.loads(capsys.readouterr().out)]
    assert tp == one
    assert len({tuple(t) for t in tp}) == 2 and all(len(t) == 10 for t in tp)


def test_tp_size_errors(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = prompts_for([4], seed=1)
    assert main(_argv(prompts, "--tp-size", "3")) == 2
    assert "num_attention_heads = 4 is not divisible by --tp-size 3: pick a size dividing 4" in capsys.readouterr().err
    assert main(_argv(prompts, "--tp-size", "0")) == 2
    assert "--tp-size 0 must be an integer in 1..64" in capsys.readouterr().err


DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]


def test_generate_dp2_ep2_equals_single_rank(capsys: pytest.CaptureFixture[str]) -> None:
    """DP attention 2, EP 2: prompts 0, 2 on DP rank 0 and 1, 3 on DP rank 1, each rank its own pool and
    scheduler; the MoE dispatches rows to the rank holding their expert and combines them back (all-to-all).
    4-token chunks make rank 0 (a 30-token prompt) step longer than rank 1, which then runs idle steps."""
    prompts = prompts_for([30, 5, 6, 7], seed=9)
    greedy = _argv(prompts, "--max-batch-tokens", "4")
    assert main([*greedy, *DP]) == 0
    rows = json.loads(capsys.readouterr().out)
    single = engine(ARCH, page_size=4, max_tokens=512, max_batch_tokens=4).generate(
        prompts, SamplingParams(max_new_tokens=10, ignore_eos=True)
    )
    assert [r["output_ids"] for r in rows] == single == [hf_greedy(ARCH, tuple(p), 10) for p in prompts]
    seeded = _argv(prompts[1:3], "--temperature", "0.9", "--seed", "5")
    assert main([*seeded, *DP]) == 0
    dp = [r["output_ids"] for r in json.loads(capsys.readouterr().out)]
    one = engine(ARCH, page_size=4, max_tokens=512).generate(
        prompts[1:3], SamplingParams(max_new_tokens=10, ignore_eos=True, temperature=0.9, seed=5)
    )
    assert dp == one
    # --sequential: rank 0 runs 2 rounds (prompts 0, 2), rank 1 one round (prompt 1) and then idles through one
    seq = _argv(prompts[1:4], "--sequential")
    assert main([*seq, *DP]) == 0
    assert [r["output_ids"] for r in json.loads(capsys.readouterr().out)] == single[1:4]


def test_dp_attention_flag_errors(capsys: pytest.CaptureFixture[str]) -> None:
    prompts = prompts_for([4], seed=1)
    cases = [
        (["--dp-size", "2"], "--dp-size 2 needs --enable-dp-attention"),
        (["--tp-size", "4", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "4"], "use --tp-size 2"),
        (["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention"], "give --ep-size 2, not 1"),
        (["--ep-size", "2"], "--ep-size 2 needs --enable-dp-attention"),
        (
            ["--tp-size", "3", "--dp-size", "3", "--enable-dp-attention", "--ep-size", "3"],
            "n_routed_experts = 8 is not divisible by --ep-size 3",
        ),
    ]
    for extra, msg in cases:
        assert main(_argv(prompts, *extra)) == 2, extra
        assert msg in capsys.readouterr().err, extra
