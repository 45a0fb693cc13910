"""Index-K elision: same logits bit for bit, producer-only bytes, shared layers never touch an INDEX_K."""

from __future__ import annotations

import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.kv_access import PoolAccess, read_tokens, write_tokens
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.spec.layout import BufferKey, Kind, index_bytes_per_token, kv_bytes_per_token
from dsakv.testing.engines import tiny_model
from dsakv.testing.models import greedy, prompts_for

PRODUCERS = (0, 1, 2, 6, 10)
SHARED = (3, 4, 5, 7, 8, 9, 11)
STEPS = 12
FORMATS = [("fp32", "fp32"), ("fp8-656", "fp8-132"), ("fp8-576", "fp4-68"), ("bf16", "bf16")]


@pytest.fixture(scope="module")
def model():
    return tiny_model("glm_moe_dsa")[1]  # the suite's one cached tiny GLM checkpoint (seed 0)


@pytest.mark.parametrize(
    "kv_format,index_format,path",
    [(kv, ix, "auto") for kv, ix in FORMATS] + [("fp32", "fp32", "absorbed"), ("fp8-656", "fp8-132", "expanded")],
)
def test_elision_on_off_bitwise_identical(model, kv_format, index_format, path):
    prompts = prompts_for([23, 6, 40], seed=3)
    results = {}
    model.set_mla_path(path)
    try:
        for elide in (True, False):
            layout = model.layout_for(elide=elide, kv_format=kv_format, index_format=index_format, page_size=8)
            runs, pool = greedy(model, layout, prompts, STEPS, chunk=9, num_pages=20)
            results[elide] = (runs, pool, layout)
    finally:
        model.set_mla_path("auto")
    on, off = results[True][0], results[False][0]
    for a, b in zip(on, off, strict=True):
        assert a.generated == b.generated
        assert all(torch.equal(x, y) for x, y in zip(a.logits, b.logits, strict=True))
    # every KV buffer and every producer's index-K hold the same bytes either way
    pool_on, pool_off = results[True][1], results[False][1]
    for key in pool_on.keys:
        assert torch.equal(pool_on.tensor(key), pool_off.tensor(key)), key
    # bytes: elided pool = producers only
    layout = results[True][2]
    kv = kv_bytes_per_token(kv_format, 64, 16)
    ik = index_bytes_per_token(index_format, 32)
    assert pool_on.nbytes == layout.bytes_per_page * 20 == 20 * 8 * (12 * kv + len(PRODUCERS) * ik)
    assert pool_off.nbytes == 20 * 8 * 12 * (kv + ik)


@pytest.fixture(scope="module")
def shallow(tmp_path_factory):
    """2 layers: shallow enough that quantisation error is not amplified by 12 random layers."""
    _, m = load_model(make_tiny(tmp_path_factory.mktemp("glm2"), seed=0, layers=2))
    return m


@pytest.mark.parametrize("kv_format,index_format", FORMATS[1:])
def test_quantised_formats_stay_close_to_fp32(shallow, kv_format, index_format):
    prompts = prompts_for([12], seed=4)  # <= index_topk: every token is selected whatever the index format
    exact = shallow.layout_for(kv_format="fp32", index_format="fp32", page_size=8)
    ref, _ = greedy(shallow, exact, prompts, 1)
    quant, _ = greedy(shallow, shallow.layout_for(kv_format=kv_format, index_format="fp32", page_size=8), prompts, 1)
    a, b = ref[0].logits[0], quant[0].logits[0]
    assert 0 < (a - b).abs().max().item()
    assert torch.nn.functional.cosine_similarity(a, b, dim=0).item() > 0.995
    # with no pruning the index-K format cannot change anything
    idx, _ = greedy(shallow, shallow.layout_for(kv_format="fp32", index_format=index_format, page_size=8), prompts, 1)
    assert torch.equal(idx[0].logits[0], a)


def test_elided_index_k_does_not_exist(model):
    layout = model.layout_for(elide=True, kv_format="fp32", index_format="fp8-132", page_size=4)
    pool = DevicePool(layout, 4)
    slots = torch.arange(3)
    for layer in SHARED:
        key = BufferKey(layer, Kind.INDEX_K)
        assert not pool.has(key)
        with pytest.raises(KeyError, match=f"layer {layer} is a shared layer"):
            pool.tensor(key)
        with pytest.raises(KeyError, match=f"no buffer L{layer}/index_k"):
            read_tokens(pool, key, slots)
        with pytest.raises(KeyError, match="index-K is elided"):
            write_tokens(pool, key, slots, torch.ones(3, 32))
        with pytest.raises(KeyError):
            PoolAccess(pool).read(key, slots)
    assert [k.layer for k in pool.keys if k.kind is Kind.INDEX_K] == list(PRODUCERS)


def test_shared_index_k_untouched_without_elision(model):
    layout = model.layout_for(elide=False, kv_format="fp8-656", index_format="fp8-132", page_size=8)
    runs, pool = greedy(model, layout, prompts_for([20, 33], seed=5), 8, chunk=16)
    assert all(len(r.generated) == 8 for r in runs)
    for layer in range(12):
        kv = pool.tensor(BufferKey(layer, Kind.KV))
        idx = pool.tensor(BufferKey(layer, Kind.INDEX_K))
        assert int(kv.count_nonzero()) > 0
        if layer in SHARED:
            assert int(idx.count_nonzero()) == 0, f"shared layer {layer} wrote its index-K"
        else:
            assert int(idx.count_nonzero()) > 0, f"producer layer {layer} did not write its index-K"


def test_model_never_reads_a_shared_index_k(model, monkeypatch):
    """Every pool access the model makes names a key of a producer (for INDEX_K), counted per key."""
    layout = model.layout_for(elide=False, kv_format="fp32", index_format="fp32", page_size=8)
    touched: list[BufferKey] = []
    orig = DevicePool.tensor

    def spy(self, key):
        touched.append(key)
        return orig(self, key)

    monkeypatch.setattr(DevicePool, "tensor", spy)
    greedy(model, layout, prompts_for([18], seed=6), 3)
    index_layers = sorted({k.layer for k in touched if k.kind is Kind.INDEX_K})
    assert index_layers == list(PRODUCERS)
    assert sorted({k.layer for k in touched if k.kind is Kind.KV}) == list(range(12))
