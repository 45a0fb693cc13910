"""DeepSeek-V4 spec, layout and planner: the issue's figures exactly (Flash and Pro, fp8 and fp4 indexer)."""

from __future__ import annotations

import json
from fractions import Fraction

import pytest

from dsakv.cli.main import main
from dsakv.errors import CapacityError, ConfigError
from dsakv.plan.v4 import V4Deployment, plan_v4, sglang_bytes_per_token
from dsakv.spec.layout import BufferKey, Kind
from dsakv.spec.v4 import CSA, HCA, WINDOW, V4Spec, load_v4_spec
from dsakv.spec.v4_layout import V4Layout, dense_bytes_per_token

GIB = 2**30


def test_presets_layer_patterns() -> None:
    flash, pro = load_v4_spec("deepseek-v4-flash"), load_v4_spec("deepseek-v4-pro")
    assert [len(flash.layers_of(t)) for t in (WINDOW, CSA, HCA)] == [2, 21, 20]
    assert [len(pro.layers_of(t)) for t in (WINDOW, CSA, HCA)] == [0, 30, 31]
    assert flash.num_draft_layers == pro.num_draft_layers == 1
    assert flash.layer_type(43) == WINDOW  # the MTP layer
    assert flash.layers_of(WINDOW) == (0, 1) and flash.layers_of(CSA)[:2] == (2, 4)


def test_layer_types_and_compress_ratios_agree() -> None:
    cfg = {"model_type": "deepseek_v4", "num_hidden_layers": 4, "hidden_size": 64, "vocab_size": 100,
           "num_attention_heads": 2, "num_nextn_predict_layers": 0}  # fmt: skip
    a = V4Spec.from_dict({**cfg, "compress_ratios": [0, 4, 128, 4]})
    b = V4Spec.from_dict({**cfg, "layer_types": [WINDOW, CSA, HCA, CSA]})
    assert a.layer_types == b.layer_types == (WINDOW, CSA, HCA, CSA)
    c = V4Spec.from_dict({**cfg, "compress_ratios": [0, 4, 16, 4], "compress_rates": {CSA: 4, HCA: 16}})
    assert c.hca_ratio == 16 and c.page_multiple == 16
    with pytest.raises(ConfigError, match=r"'compress_ratios'\[2\] = 64"):
        V4Spec.from_dict({**cfg, "compress_ratios": [0, 4, 64, 4]})
    with pytest.raises(ConfigError, match="has 3 entries"):
        V4Spec.from_dict({**cfg, "compress_ratios": [0, 4, 128]})


@pytest.mark.parametrize(
    "preset,fp8,fp4,every,dense",
    [
        ("deepseek-v4-flash", Fraction(385025, 100), Fraction(351425, 100), Fraction(78931875, 10000), 30788),
        ("deepseek-v4-pro", Fraction(55114375, 10000), Fraction(50314375, 10000), Fraction(111973125, 10000), 43676),
    ],
)
def test_bytes_per_token_exact(preset: str, fp8: Fraction, fp4: Fraction, every: Fraction, dense: int) -> None:
    s = load_v4_spec(preset)
    assert V4Layout(s).bytes_per_token == fp8
    assert V4Layout(s, index_format="fp4-68").bytes_per_token == fp4
    assert V4Layout(s, every_layer=True).bytes_per_token == every
    assert dense_bytes_per_token(s) == dense


@pytest.mark.parametrize(
    "preset,window,csa,hca_online,hca_ring,sglang",
    [
        ("deepseek-v4-flash", 3_214_336, 1_720_320, 122_880, 10_485_760, Fraction(770545, 100)),
        ("deepseek-v4-pro", 4_559_872, 2_457_600, 190_464, 16_252_928, Fraction(109938375, 10000)),
    ],
)
def test_per_request_state_and_sglang(
    preset: str, window: int, csa: int, hca_online: int, hca_ring: int, sglang: Fraction
) -> None:
    s = load_v4_spec(preset)
    lay = V4Layout(s)
    assert lay.state_bytes_of(Kind.WINDOW) == window
    assert lay.state_bytes_of(Kind.CSA_STATE) + lay.state_bytes_of(Kind.CSA_INDEX_STATE) == csa
    assert lay.state_bytes_of(Kind.HCA_STATE) == hca_online
    assert V4Layout(s, hca_state="ring").state_bytes_of(Kind.HCA_STATE) == hca_ring
    assert sglang_bytes_per_token(lay) == sglang
    assert sglang_bytes_per_token(V4Layout(s, index_format="fp4-68")) == sglang  # fp4 sized as fp8


def test_keys_only_where_read() -> None:
    s = load_v4_spec("deepseek-v4-flash")
    lay = V4Layout(s, draft_layers=1)
    assert lay.kinds_of(0) == (Kind.WINDOW,)
    assert lay.kinds_of(2) == (Kind.CSA_KV, Kind.CSA_INDEX_K, Kind.WINDOW, Kind.CSA_STATE, Kind.CSA_INDEX_STATE)
    assert lay.kinds_of(3) == (Kind.HCA_KV, Kind.WINDOW, Kind.HCA_STATE)
    assert lay.kinds_of(43) == (Kind.WINDOW,)
    assert len(lay.paged) == 21 * 2 + 20 and len(lay.states) == 44 + 21 * 2 + 20
    with pytest.raises(KeyError, match="layer 3 is a heavily_compressed_attention layer"):
        lay.buffer(BufferKey(3, Kind.CSA_INDEX_K))
    page = lay.buffer(BufferKey(2, Kind.CSA_KV))
    assert (page.entries_per_page, page.page_bytes) == (32, 32 * 584)  # type: ignore[union-attr]
    with pytest.raises(ConfigError, match="multiple of 128 tokens"):
        V4Layout(s, page_size=64)


def test_pp_stages_and_concurrency() -> None:
    s = load_v4_spec("deepseek-v4-flash")
    d = V4Deployment(s, partition=(22, 21), draft_layers=1, kv_budget=64 * GIB, max_running=64, context_len=131072)
    rp = plan_v4(d)
    s0, s1 = rp.stages
    assert s0.counts() == {WINDOW: 2, CSA: 10, HCA: 10} and s1.counts() == {WINDOW: 0, CSA: 11, HCA: 10}
    assert s0.layout.bytes_per_page == 10 * 32 * (584 + 132) + 10 * 584 == 234_960
    assert s1.layout.bytes_per_page == 11 * 32 * (584 + 132) + 10 * 584 == 257_872
    assert s0.layout.state_bytes_per_request == 22 * 74_752 + 10 * 81_920 + 10 * 6_144 == 2_525_184
    assert s1.layout.state_bytes_per_request == 22 * 74_752 + 11 * 81_920 + 10 * 6_144 == 2_607_104  # + MTP window
    assert s1.pages == (64 * GIB - 64 * 2_607_104) // 257_872 and s1.tokens == s1.pages * 128 == 34_027_392
    assert rp.binding == 1 and rp.tokens == 34_027_392
    per_req = 1024 * 257_872 + 2_607_104
    assert s1.requests_at_context == 64 * GIB // per_req == 257
    with pytest.raises(CapacityError, match="64 request slots"):
        plan_v4(V4Deployment(s, kv_budget=64 * 2_525_184, max_running=64))


@pytest.mark.parametrize(
    "preset,figures",
    [
        ("deepseek-v4-flash", ["3,850.25", "3,514.25", "7,893.19", "30,788", "3,214,336", "1,720,320", "122,880",
                               "10,485,760", "7,705.45", "2 window-only + 21 CSA (ratio 4) + 20 HCA (ratio 128)"]),
        ("deepseek-v4-pro", ["5,511.44", "5,031.44", "11,197.31", "43,676", "4,559,872", "2,457,600", "190,464",
                             "16,252,928", "10,993.84", "0 window-only + 30 CSA (ratio 4) + 31 HCA (ratio 128)"]),
    ],
)  # fmt: skip
def test_cli_prints_the_figures(capsys, preset: str, figures: list[str]) -> None:
    assert main(["plan", preset, "--kv-budget", "64GiB", "--max-running-requests", "64"]) == 0
    out = capsys.readouterr().out
    for f in figures:
        assert f in out, f
    assert "1,344.00" in out or "1,920.00" in out  # SGLang's per-token CSA state


def test_cli_pp_table_and_json(capsys) -> None:
    argv = ["plan", "deepseek-v4-flash", "--pp-partition", "22,21", "--draft-layers", "1", "--kv-budget", "64GiB",
            "--max-running-requests", "64", "--context-len", "131072"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "22-42 +1 MTP" in out and "34,027,392" in out and "◀ binding" in out and "requests at 131,072" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["tokens"] == 34_027_392 and data["binding_stage"] == 1
    assert data["figures"] == {"by_read_fp8": "15401/4", "by_read_fp4": "14057/4", "every_layer_fp8": "126291/16",
                               "dense_v32_style": "30788"}  # fmt: skip
    sg = data["sglang"]
    assert sg["sglang_bpt"] == "154109/20" and sg["sglang_tokens"] == 64 * GIB * 20 // 154109 // 128 * 128


def test_cli_v4_errors(capsys) -> None:
    assert main(["plan", "deepseek-v4-flash", "--page-size", "100"]) == 2
    assert "multiple of 128" in capsys.readouterr().err
    assert main(["plan", "deepseek-v4-pro", "--kv-format", "fp8-656"]) == 2
    assert "MLA format" in capsys.readouterr().err
    assert main(["plan", "deepseek-v4-flash", "--kv-budget", "1GiB", "--hisparse-ratio", "10"]) == 2
    assert "--hisparse-ratio: not planned for DeepSeek-V4 yet" in capsys.readouterr().err
    assert main(["plan", "deepseek-v4-flash", "--kv-budget", "1MiB", "--max-running-requests", "4"]) == 2
    assert "holds 4 request slots" in capsys.readouterr().err


def test_pp_stages_pair_with_a_decode_by_key() -> None:
    """Each key of a PP=2 prefill pairs with the decode's by key; bytes per pair == the layout figure."""
    from dsakv.spec.v4_layout import pair_layouts

    s = load_v4_spec("deepseek-v4-flash")
    decode = V4Layout(s, draft_layers=1)
    stages = [V4Layout(s, 0, 22), V4Layout(s, 22, 43, draft_layers=1)]
    pairs = [pair_layouts(st, decode) for st in stages]
    assert {p.key for ps in pairs for p in ps} == set(decode.keys)
    assert sum(p.nbytes for ps in pairs for p in ps if p.paged) == decode.bytes_per_page == 492_832
    assert sum(p.nbytes for ps in pairs for p in ps if not p.paged) == decode.state_bytes_per_request
    assert [sum(p.nbytes for p in ps if p.paged) for ps in pairs] == [234_960, 257_872]
    with pytest.raises(ConfigError, match=r"L2/csa_kv \(csa_kv\): sender 32 x 584 B per page \(page 128"):
        pair_layouts(stages[0], V4Layout(s, page_size=256))
    with pytest.raises(ConfigError, match=r"L2/csa_index_k \(csa_index_k\): sender 32 x 132 B"):
        pair_layouts(stages[0], V4Layout(s, index_format="fp4-68"))
    with pytest.raises(ConfigError, match=r"L3/hca_state \(hca_state\): sender slot 3 x 2,048 B"):
        pair_layouts(stages[0], V4Layout(s, hca_state="ring"))
    with pytest.raises(ConfigError, match="models 'deepseek-v4-flash' and 'deepseek-v4-pro' differ"):
        pair_layouts(stages[0], V4Layout(load_v4_spec("deepseek-v4-pro")))
