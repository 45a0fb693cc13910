"""HiSparse planner: SGLang's pool-configurator figures for GLM-5.2, dsakv's elided figures, the CLI."""

from __future__ import annotations

import json

import pytest

from dsakv.cli.main import main
from dsakv.errors import CapacityError, ConfigError
from dsakv.plan import Deployment, plan
from dsakv.plan.hisparse import hisparse_figures, split_bytes_per_token
from dsakv.spec import KVLayout, load_spec

GIB = 2**30


def test_glm52_ratio10_sglang_figures() -> None:
    """Dense = SGLang's cell 78 x 656 + 10 x 78 x 132; elided indexes the 21 producers only."""
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, role="decode", kv_budget=64 * GIB, hisparse_ratio=10))
    hd, he = rp.hisparse_figures(False), rp.hisparse_figures(True)
    assert hd is not None and he is not None
    assert (hd.kv_bytes_per_token, hd.index_bytes_per_token) == (78 * 656, 78 * 132)
    assert (he.kv_bytes_per_token, he.index_bytes_per_token) == (78 * 656, 21 * 132)
    assert (hd.device_bytes_per_token, he.device_bytes_per_token) == (154_128, 78_888)
    assert (hd.device_tokens, he.device_tokens) == (445_824, 871_040)  # floor(64 GiB / cell / 64) x 64
    assert (hd.logical_tokens, he.logical_tokens) == (4_458_240, 8_710_400)
    assert hd.device_bytes == 445_824 * 51_168 + 4_458_240 * 10_296 == 68_713_961_472
    assert he.device_bytes == 871_040 * 51_168 + 8_710_400 * 2_772 == 68_714_603_520
    assert (hd.host_bytes, he.host_bytes) == (4_458_240 * 51_168, 8_710_400 * 51_168)
    assert hd.device_bytes <= 64 * GIB and he.device_bytes <= 64 * GIB
    assert hd.max_requests is None


def test_ratio4_matches_sglang_fixed_cell() -> None:
    """SGLang's configurator fix quotes 92,352 B/token for GLM-5.2 at ratio 4 (fp8 KV with scales)."""
    layout = KVLayout(load_spec("glm-5.2"), elide=False)
    assert hisparse_figures(64 * GIB, layout, 4).device_bytes_per_token == 92_352


def test_buffer_requests_and_draft_layer() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, kv_budget=64 * GIB, draft_layers=1, hisparse_ratio=10, hisparse_buffer=2048))
    he = rp.hisparse_figures(True)
    assert he is not None
    assert split_bytes_per_token(KVLayout(spec, draft_layers=1)) == (79 * 656, 22 * 132)
    assert he.device_bytes_per_token == 79 * 656 + 10 * 22 * 132 == 80_864
    assert he.device_tokens == 64 * GIB // 80_864 // 64 * 64 == 849_792
    assert he.max_requests == 849_792 // (2048 + 64) == 402


def test_pp_stages_and_binding() -> None:
    spec = load_spec("glm-5.2")
    rp = plan(Deployment(spec, role="decode", partition=(20, 20, 20, 18), kv_budget=16 * GIB, hisparse_ratio=8))
    stages = [s.hisparse_elided for s in rp.stages]
    assert [f.index_bytes_per_token for f in stages if f] == [7 * 132, 5 * 132, 5 * 132, 4 * 132]
    assert rp.hisparse_binding(True) == 0  # most producers -> fewest tokens
    assert [f.device_tokens for f in stages if f] == [
        16 * GIB // (20 * 656 + 8 * 7 * 132) // 64 * 64,
        16 * GIB // (20 * 656 + 8 * 5 * 132) // 64 * 64,
        16 * GIB // (20 * 656 + 8 * 5 * 132) // 64 * 64,
        16 * GIB // (18 * 656 + 8 * 4 * 132) // 64 * 64,
    ]


def test_prefill_role_not_hisparse() -> None:
    rp = plan(Deployment(load_spec("glm-5.2"), role="prefill", kv_budget=64 * GIB, hisparse_ratio=10))
    assert rp.hisparse_figures(True) is None
    assert rp.to_dict()["hisparse"]["applies"] is False
    assert rp.tokens_elided == 64 * GIB // 53_940 // 64 * 64  # the plain figures are unchanged


def test_bad_hisparse_input() -> None:
    spec = load_spec("glm-5.2")
    with pytest.raises(ConfigError, match="--hisparse-ratio 0.5 must be a number >= 1"):
        Deployment(spec, kv_budget=GIB, hisparse_ratio=0.5)
    with pytest.raises(ConfigError, match="--hisparse-buffer 0 must be a positive"):
        Deployment(spec, kv_budget=GIB, hisparse_ratio=2, hisparse_buffer=0)
    with pytest.raises(ConfigError, match="--hisparse-buffer needs --hisparse-ratio"):
        Deployment(spec, kv_budget=GIB, hisparse_buffer=64)
    with pytest.raises(CapacityError, match="holds no HiSparse page"):
        plan(Deployment(spec, kv_budget=5_000_000, hisparse_ratio=10))  # a plain page fits


def test_cli_table_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "glm-5.2", "--kv-budget", "64GiB", "--hisparse-ratio", "10", "--hisparse-buffer", "2048"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "154,128" in out and "78,888" in out and "445,824" in out and "871,040" in out
    assert "dense index-K 4,458,240 -> elided 8,710,400: +95.4%" in out
    assert "requests with 2048-row buffers: 211 -> 412" in out
    assert main([*args, "--json"]) == 0
    hs = json.loads(capsys.readouterr().out)["hisparse"]
    assert (hs["dense"]["device_bytes_per_token"], hs["elided"]["device_bytes_per_token"]) == (154_128, 78_888)
    assert (hs["dense"]["device_tokens"], hs["elided"]["device_tokens"]) == (445_824, 871_040)
    assert (hs["dense"]["max_requests"], hs["elided"]["max_requests"]) == (211, 412)
