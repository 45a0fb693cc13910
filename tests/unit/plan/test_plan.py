"""Capacity planner: every figure of shared/REFERENCE.md, plus the CLI."""

from __future__ import annotations

import json

import pytest

from dsakv.cli.main import main
from dsakv.errors import CapacityError, ConfigError
from dsakv.plan import Deployment, balance, even_partition, max_total_num_tokens, parse_size, plan
from dsakv.plan.weights import model_weight_bytes
from dsakv.spec import KVLayout, load_spec

GIB = 2**30


def test_parse_size() -> None:
    assert parse_size("96.33GiB") == 103_433_549_905
    assert parse_size("80GB") == 80 * 10**9
    assert parse_size("512 MiB") == 512 * 2**20
    assert parse_size("1024") == 1024
    with pytest.raises(ConfigError, match="'lots' is not a size"):
        parse_size("lots", "--kv-budget")


def test_decode_96_33_gib() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, role="decode", draft_layers=1, kv_budget=parse_size("96.33GiB")))
    (s,) = rp.stages
    assert (s.bytes_per_token_dense, s.bytes_per_token_elided) == (62_252, 54_728)
    assert (rp.tokens_dense, rp.tokens_elided) == (1_661_504, 1_889_920)
    assert f"{rp.gain:+.1%}" == "+13.7%"


def test_decode_second_deployment() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, role="decode", draft_layers=1, kv_budget=157_198_000_000))
    assert (rp.tokens_dense, rp.tokens_elided) == (2_525_184, 2_872_320)


def test_prefill_pp4_20_20_20_18() -> None:
    spec = load_spec("glm-5.2")
    d = Deployment(spec, role="prefill", partition=(20, 20, 20, 18), draft_layers=1, kv_budget=105_256_000_000)
    rp = plan(d)
    s0 = rp.stages[0]
    assert s0.producers == (0, 1, 2, 6, 10, 14, 18)
    assert (s0.bytes_per_token_dense, s0.bytes_per_token_elided) == (21 * 788, 20 * 656 + 7 * 132 + 788)
    assert [s.bytes_per_token_elided for s in rp.stages] == [14_832, 14_568, 14_568, 13_124]
    assert rp.binding_elided == 0
    assert (rp.tokens_dense, rp.tokens_elided) == (6_360_640, 7_096_512)  # the seed's prefill figures
    assert f"{rp.gain:+.1%}" == "+11.6%"


def test_capacity_floors_to_pages() -> None:
    spec = load_spec("glm-5.2")
    layout = KVLayout(spec, draft_layers=1, elide=True)
    assert max_total_num_tokens(54_728 * 64 * 3 + 54_727, layout) == 192
    with pytest.raises(CapacityError, match="holds no page"):
        max_total_num_tokens(54_728 * 63, layout)


def test_even_partition_and_bad_partitions() -> None:
    assert even_partition(78, 4) == (20, 20, 19, 19)
    spec = load_spec("glm-5.2")
    with pytest.raises(ConfigError, match="sums to 77 but the model has 78"):
        Deployment(spec, partition=(20, 20, 20, 17), kv_budget=GIB)
    with pytest.raises(ConfigError, match="stage 1 has 0 layers"):
        Deployment(spec, partition=(78, 0), kv_budget=GIB)


def test_balance_beats_even_split() -> None:
    spec = load_spec("glm-5.2")
    d = Deployment(spec, role="prefill", partition=(20, 20, 20, 18), draft_layers=1, kv_budget=105_256_000_000)
    res = balance(d)
    part = res.balanced.deployment.partition
    assert part == (19, 19, 20, 20)
    assert res.balanced.tokens_elided > res.baseline.tokens_elided
    # brute force over all 4-way partitions confirms the DP's optimum
    budget = d.kv_budget or 0
    tok = {
        (lo, hi): max_total_num_tokens(budget, KVLayout(spec, lo, hi, draft_layers=1))
        for lo in range(78)
        for hi in range(lo + 1, 79)
    }
    best = 0
    for a in range(1, 76):
        for b in range(a + 1, 77):
            for c in range(b + 1, 78):
                best = max(best, min(tok[0, a], tok[a, b], tok[b, c], tok[c, 78]))
    assert res.balanced.tokens_elided == best


def test_gpu_memory_budget_is_estimated() -> None:
    spec = load_spec("glm-5.2")
    total = model_weight_bytes(spec, "bf16")
    assert 740e9 < total / 2 < 760e9  # ~750B params in bf16 ~ 1.5 TB
    # int8 weight-only: 1 byte a linear weight + a float32 scale per 1024 (per output row), norms etc. as bf16
    lin = (model_weight_bytes(spec, "fp32") - total) / 2  # linear params: 4 - 2 bytes each
    assert abs(total - model_weight_bytes(spec, "int8") - lin * (1 - 4 / 1024)) < 200  # int() per layer
    d = Deployment(spec, role="decode", draft_layers=1, gpu_memory=141 * 10**9, tp=16, weight_format="fp8")
    rp = plan(d)
    (s,) = rp.stages
    # one decode stage holds the whole model (78 layers + its 1 draft layer) over 16 TP ranks: the head-split and
    # expert weights split 16 ways, the latent down-projections, norms and indexer replicated on each rank
    assert s.weight_bytes == d.rank_weight_bytes(0) == 48_985_759_680
    assert model_weight_bytes(spec, "fp8") // 16 < s.weight_bytes < model_weight_bytes(spec, "fp8") // 15
    assert s.budget_bytes == int(141 * 10**9 * 0.85) - s.weight_bytes
    with pytest.raises(CapacityError, match="exceed GPU memory"):
        plan(Deployment(spec, role="decode", gpu_memory=80 * 10**9, weight_format="bf16"))


def test_host_tier_tokens() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, draft_layers=1, kv_budget=parse_size("96.33GiB"), hicache_size=128 * GIB))
    (s,) = rp.stages
    assert s.host_tokens_elided == 128 * GIB // (54_728 * 64) * 64
    assert s.host_tokens_dense == 128 * GIB // (62_252 * 64) * 64
    rp2 = plan(Deployment(spec, draft_layers=1, kv_budget=parse_size("96.33GiB"), hicache_ratio=2.0))
    assert rp2.stages[0].host_tokens_elided == 2 * 1_889_920
    with pytest.raises(CapacityError, match="host tier"):
        plan(Deployment(spec, draft_layers=1, kv_budget=parse_size("96.33GiB"), hicache_size=1000))


# ---- CLI ---------------------------------------------------------------------------------


def test_cli_decode_figures(capsys) -> None:
    rc = main(["plan", "glm-5.2", "--role", "decode", "--kv-budget", "96.33GiB", "--draft-layers", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    for figure in ("62,252", "54,728", "1,661,504", "1,889,920", "+13.7%", "21 producers, 57 shared"):
        assert figure in out


def test_cli_json(capsys) -> None:
    rc = main(
        ["plan", "glm-5.2", "--role", "prefill", "--pp-partition", "20,20,20,18", "--draft-layers", "1",
         "--kv-budget", "105256000000", "--json", "--balance"]
    )  # fmt: skip
    data = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert data["max_total_num_tokens_dense"] == 6_360_640
    assert data["max_total_num_tokens_elided"] == 7_096_512
    assert data["binding_stage_elided"] == 0
    assert data["stages"][0]["producers"] == [0, 1, 2, 6, 10, 14, 18]
    # balanced 19,19,20,20: stages 2 and 3 bind at 21 x 656 + 6 x 132 = 14,568 B/token -> 7,225,088 tokens
    assert data["balance"]["partition"] == [19, 19, 20, 20]
    assert data["balance"]["plan"]["max_total_num_tokens_elided"] == 7_225_088
    assert data["balance"]["gain_over_baseline"] == round(7_225_088 / 7_096_512 - 1, 6)


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["plan", "glm-5.2", "--pp-partition", "20,20,20,17", "--kv-budget", "1GiB"], "sums to 77"),
        (["plan", "glm-5.2", "--pp-partition", "40,0,38", "--kv-budget", "1GiB"], "stage 1 has 0 layers"),
        (["plan", "glm-5.2", "--kv-budget", "1000"], "holds no page"),
        (["plan", "glm-5.2", "--kv-budget", "lots"], "not a size"),
        (["plan", "glm-5.2"], "no memory given"),
        (["plan", "nope-model", "--kv-budget", "1GiB"], "no config.json"),
    ],
)
def test_cli_errors_are_clear(capsys, argv: list[str], needle: str) -> None:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2
    assert needle in err
    assert "Traceback" not in err


def test_cli_bad_config_file(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa", "num_hidden_layers": 4}))
    rc = main(["plan", str(tmp_path), "--kv-budget", "1GiB"])
    assert rc == 2
    assert "missing required field 'kv_lora_rank'" in capsys.readouterr().err
