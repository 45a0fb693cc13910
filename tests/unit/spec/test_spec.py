"""ModelSpec, layer ownership and KVLayout against shared/REFERENCE.md."""

from __future__ import annotations

import json

import pytest

from dsakv.errors import ConfigError
from dsakv.spec import BufferKey, Kind, KVLayout, ModelSpec, load_spec, preset_config

GLM52_PRODUCERS = (0, 1, 2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 66, 70, 74)


def test_glm52_ownership() -> None:
    spec = load_spec("glm-5.2")
    assert spec.num_layers == 78
    assert spec.producers == GLM52_PRODUCERS
    assert len(spec.producers) == 21
    assert len(spec.shared_layers) == 57
    assert spec.num_draft_layers == 1
    assert spec.owns_index_k(78) is True  # MTP layer always full
    assert spec.producer_of(5) == 2
    assert spec.producer_of(6) == 6
    assert spec.producer_of(77) == 74
    assert spec.producer_of(78) == 78


@pytest.mark.parametrize("name,n", [("glm-5.1", 78), ("deepseek-v3.2", 61)])
def test_all_full_presets(name: str, n: int) -> None:
    spec = load_spec(name)
    assert spec.producers == tuple(range(n))
    assert spec.shared_layers == ()


def test_deepseek_v3_style_config_without_indexer() -> None:
    cfg = preset_config("deepseek-v3.2")
    cfg["model_type"] = "deepseek_v3"
    for k in ("index_topk", "index_n_heads", "index_head_dim"):
        cfg.pop(k)
    spec = ModelSpec.from_dict(cfg)
    assert not spec.has_indexer
    layout = KVLayout(spec, kv_format="fp8-656")
    assert all(k.kind is Kind.KV for k in layout.keys)
    assert layout.bytes_per_token == 61 * 656


def test_ownership_precedence_pattern_then_freq() -> None:
    cfg = preset_config("tiny")
    cfg["index_topk_pattern"] = "FFSSFSSSSSSF"
    spec = ModelSpec.from_dict(cfg)
    assert spec.producers == (0, 1, 4, 11)
    assert spec.ownership_source == "index_topk_pattern"
    cfg["indexer_types"] = ["full"] + ["shared"] * 11
    spec = ModelSpec.from_dict(cfg)
    assert spec.producers == (0,)
    assert spec.ownership_source == "indexer_types"


@pytest.mark.parametrize(
    "freq,offset,layers",
    [(4, 3, 78), (4, 2, 40), (2, 1, 12), (3, 5, 30), (1, 3, 10), (4, None, 20)],
)
def test_ownership_matches_transformers(freq: int, offset: int | None, layers: int) -> None:
    transformers = pytest.importorskip("transformers")
    kwargs = {"num_hidden_layers": layers, "index_topk_freq": freq}
    if offset is not None:
        kwargs["index_skip_topk_offset"] = offset
    hf = transformers.GlmMoeDsaConfig(**kwargs)
    cfg = preset_config("glm-5.2")
    cfg.pop("index_skip_topk_offset")
    cfg.update(kwargs)
    spec = ModelSpec.from_dict(cfg)
    assert list(spec.indexer_types) == list(hf.indexer_types)


def test_ownership_matches_transformers_pattern() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.GlmMoeDsaConfig(num_hidden_layers=6, index_topk_pattern="FSFFSS")
    cfg = preset_config("tiny")
    cfg.update(num_hidden_layers=6, index_topk_pattern="FSFFSS")
    assert list(ModelSpec.from_dict(cfg).indexer_types) == list(hf.indexer_types)


def test_glm52_matches_transformers_config() -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.GlmMoeDsaConfig(index_topk_freq=4, index_skip_topk_offset=3)
    assert tuple(i for i, t in enumerate(hf.indexer_types) if t == "full") == GLM52_PRODUCERS


def test_from_path_and_model_dir(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(preset_config("glm-5.2")))
    assert load_spec(str(tmp_path)).producers == GLM52_PRODUCERS
    assert load_spec(str(tmp_path / "config.json")).producers == GLM52_PRODUCERS


# ---- bad configs: clear errors that name the field ---------------------------------------


def _err(cfg: dict) -> str:
    with pytest.raises(ConfigError) as e:
        ModelSpec.from_dict(cfg)
    return str(e.value)


def test_indexer_types_wrong_length() -> None:
    cfg = preset_config("tiny")
    cfg["indexer_types"] = ["full"] * 5
    msg = _err(cfg)
    assert "'indexer_types' has 5 entries" in msg and "num_hidden_layers is 12" in msg


def test_indexer_types_unknown_value() -> None:
    cfg = preset_config("tiny")
    cfg["indexer_types"] = ["full"] * 11 + ["sparse"]
    msg = _err(cfg)
    assert "'indexer_types'[11] = 'sparse'" in msg and "'full'" in msg


def test_first_layer_shared() -> None:
    cfg = preset_config("tiny")
    cfg["indexer_types"] = ["shared"] + ["full"] * 11
    assert "layer 0 is 'shared'" in _err(cfg)


def test_freq_zero() -> None:
    cfg = preset_config("tiny")
    cfg["index_topk_freq"] = 0
    assert "'index_topk_freq' = 0" in _err(cfg)


def test_missing_kv_lora_rank() -> None:
    cfg = preset_config("glm-5.2")
    del cfg["kv_lora_rank"]
    assert "missing required field 'kv_lora_rank'" in _err(cfg)


def test_unknown_model_type_and_preset() -> None:
    cfg = preset_config("tiny")
    cfg["model_type"] = "llama"
    assert "'model_type' = 'llama'" in _err(cfg)
    with pytest.raises(ConfigError, match="unknown preset"):
        load_spec("glm-9")


# ---- layouts --------------------------------------------------------------------------


def test_layout_bytes_engine_b() -> None:
    spec = load_spec("glm-5.2")
    dense = KVLayout(spec, kv_format="fp8-576", elide=False)
    elided = KVLayout(spec, kv_format="fp8-576", elide=True)
    assert dense.bytes_per_token == 55_224
    assert elided.bytes_per_token == 47_700


def test_layout_bytes_engine_a_with_draft() -> None:
    spec = load_spec("glm-5.2")
    assert KVLayout(spec, draft_layers=1, elide=False).bytes_per_token == 62_252
    assert KVLayout(spec, draft_layers=1, elide=True).bytes_per_token == 54_728


def test_layout_keys_no_zero_sized_entries() -> None:
    spec = load_spec("glm-5.2")
    layout = KVLayout(spec, 20, 40, draft_layers=1)
    idx = [k.layer for k in layout.keys if k.kind is Kind.INDEX_K]
    assert idx == [22, 26, 30, 34, 38, 78]
    assert all(b.bytes_per_token > 0 and b.page_bytes > 0 for b in layout.buffers)
    assert layout.buffer(BufferKey(22, Kind.INDEX_K)).page_bytes == 8_448  # 64*128 + 64*4
    assert layout.buffer(BufferKey(20, Kind.KV)).page_bytes == 64 * 656
    with pytest.raises(KeyError, match="layer 21 is a shared layer"):
        layout.buffer(BufferKey(21, Kind.INDEX_K))
    with pytest.raises(KeyError, match="outside this layout"):
        layout.buffer(BufferKey(5, Kind.KV))


@pytest.mark.parametrize(
    "kv,idx,bpt",
    [("fp8-656", "fp8-132", 656 + 132), ("fp8-576", "fp4-68", 576 + 68), ("bf16", "bf16", 1152 + 256)],
)
def test_format_sizes(kv: str, idx: str, bpt: int) -> None:
    spec = load_spec("deepseek-v3.2")
    layout = KVLayout(spec, 0, 1, kv_format=kv, index_format=idx, page_size=1)
    assert layout.bytes_per_token == bpt


def test_bad_layout_values() -> None:
    spec = load_spec("glm-5.2")
    with pytest.raises(ConfigError, match="unknown KV format 'fp16'"):
        KVLayout(spec, kv_format="fp16")
    with pytest.raises(ConfigError, match="page size = 0"):
        KVLayout(spec, page_size=0)
    with pytest.raises(ConfigError, match="layer range"):
        KVLayout(spec, 40, 40)


def test_buffer_key_parse_roundtrip() -> None:
    k = BufferKey(6, Kind.INDEX_K)
    assert BufferKey.parse(str(k)) == k
    with pytest.raises(ConfigError):
        BufferKey.parse("six/index")
