"""HiSparse residency manager: exact slots, rows, bytes; shared layers reuse only their producer's top-k."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsakv.cache.hisparse import HiSparsePool
from dsakv.errors import CapacityError
from dsakv.plan import Deployment, plan
from dsakv.spec import KVLayout, load_spec

P = 4  # page size
S = 4  # device_buffer_size
KV_BYTES = (64 + 16) * 4  # tiny: kv_lora_rank 64 + rope 16, fp32


def _pool(elide: bool = True, requests: int = 2, logical_pages: int = 16) -> HiSparsePool:
    layout = KVLayout(load_spec("tiny"), elide=elide, kv_format="fp32", index_format="fp32", page_size=P)
    return HiSparsePool(layout, logical_pages, S, requests)


def _fill(pool: HiSparsePool, rid: str, n: int, seed: int) -> dict[int, torch.Tensor]:
    """Store KV for positions 0..n-1 of every layer (distinct values per layer); returns them."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for layer in pool.layout.layers:
        v = torch.randn(n, 80, generator=g)
        pool.store_kv(layer, rid, torch.arange(n), v)
        out[layer] = v
    return out


def test_sizes_and_groups() -> None:
    pool = _pool()
    assert pool.groups == {0: (0,), 1: (1,), 2: (2, 3, 4, 5), 6: (6, 7, 8, 9), 10: (10, 11)}
    assert pool.block_rows == S + P == 8
    assert pool.hot_tensor(3).shape == (2 * 8, KV_BYTES)
    assert pool.host_bytes == 12 * 16 * P * KV_BYTES
    assert pool.device_bytes == 5 * 16 * P * 32 * 4 + 12 * 16 * KV_BYTES
    with pytest.raises(KeyError, match="layer 3 is a shared layer"):
        pool.index_tensor(3)
    assert _pool(elide=False).device_bytes == 12 * 16 * P * 32 * 4 + 12 * 16 * KV_BYTES


def test_swap_in_exact_slots_rows_bytes_and_lru() -> None:
    pool = _pool()
    assert pool.admit("a", [5, 2, 7], length=10) == 0  # positions 8, 9 are the newest page
    vals = _fill(pool, "a", 10, seed=1)
    pool.begin_step()
    assert pool.swap_in(2, {"a": torch.tensor([0, 5, 9, -1])}) == {2: 2, 3: 2, 4: 2, 5: 2}
    assert pool.resident(3, "a") == {0: 0, 5: 1}
    assert pool.rows(3, "a").tolist() == [0, 1, S + 9 % P]
    assert pool.stats.step_rows() == {2: 2, 3: 2, 4: 2, 5: 2}
    assert pool.stats.step_bytes() == {2: 2 * KV_BYTES, 3: 2 * KV_BYTES, 4: 2 * KV_BYTES, 5: 2 * KV_BYTES}
    for layer in (2, 3, 4, 5):
        assert torch.equal(pool.read_kv(layer, "a"), vals[layer][[0, 5, 9]])
    # 5 hits slot 1; misses 1, 2, 3 take empty slots 2, 3 then the least recently used slot 0 (position 0)
    pool.begin_step()
    assert pool.swap_in(2, {"a": torch.tensor([5, 1, 2, 3])})[4] == 3
    assert pool.resident(4, "a") == {3: 0, 5: 1, 1: 2, 2: 3}
    assert pool.positions(4, "a").tolist() == [1, 2, 3, 5]
    assert pool.rows(4, "a").tolist() == [2, 3, 0, 1]
    assert torch.equal(pool.read_kv(4, "a"), vals[4][[1, 2, 3, 5]])
    assert pool.rows_for(4, "a", torch.tensor([[5, 3, -1], [1, 1, 2]])).tolist() == [[1, 0, -1], [2, 2, 3]]
    with pytest.raises(KeyError, match=r"positions \[0\] are not resident; call swap_in with the top-k of layer 2"):
        pool.rows_for(4, "a", torch.tensor([0]))
    # all resident (two query tokens: their union); nothing moves
    pool.begin_step()
    assert pool.swap_in(2, {"a": torch.tensor([[1, 2, 8], [2, 8, 9]])}) == {2: 0, 3: 0, 4: 0, 5: 0}
    assert pool.stats.step_bytes() == {2: 0, 3: 0, 4: 0, 5: 0}
    # per layer 3 + 4 + 4 lookups, 1 + 1 + 4 hits
    assert pool.stats.total[3].lookups == 11 and pool.stats.total[3].hits == 6
    assert pool.stats.hit_rate == pytest.approx(6 / 11)
    assert pool.stats.to_dict()["rows_in_total"] == 4 * 5


def test_shared_layer_uses_only_its_producers_topk() -> None:
    """Two producers pick different top-k; each shared layer holds and swaps in its own producer's rows only."""
    pool = _pool()
    pool.admit("a", [0, 1, 2, 3], length=16)
    vals = _fill(pool, "a", 16, seed=2)
    a_topk, b_topk = [0, 1, 2, 3], [4, 5, 6, 7]
    pool.begin_step()
    pool.swap_in(2, {"a": torch.tensor(a_topk)})
    assert pool.stats.step_rows() == {2: 4, 3: 4, 4: 4, 5: 4}  # nothing for layers of producer 6
    pool.swap_in(6, {"a": torch.tensor(b_topk)})
    for layer in (2, 3, 4, 5):
        assert sorted(pool.resident(layer, "a")) == a_topk
        assert pool.positions(layer, "a").tolist() == a_topk
        assert torch.equal(pool.read_kv(layer, "a"), vals[layer][a_topk])
    for layer in (6, 7, 8, 9):
        assert sorted(pool.resident(layer, "a")) == b_topk
        assert torch.equal(pool.read_kv(layer, "a"), vals[layer][b_topk])
    assert pool.stats.step_rows() == {2: 4, 3: 4, 4: 4, 5: 4, 6: 4, 7: 4, 8: 4, 9: 4}
    with pytest.raises(ValueError, match="layer 7 is not a producer.*reuses the top-k of layer 6"):
        pool.swap_in(7, {"a": torch.tensor(a_topk)})


def test_two_requests_one_copy_per_layer_and_newest_page_backup(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = _pool()
    pool.admit("a", [3, 4], length=7)
    pool.admit("b", [9, 10], length=6)
    va, vb = _fill(pool, "a", 7, seed=3), _fill(pool, "b", 6, seed=4)
    copies: list[int] = []
    real_copy = HiSparsePool._copy_in

    def copy_in(self: HiSparsePool, layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append(dst.numel())
        real_copy(self, layer, dst, src)

    monkeypatch.setattr(HiSparsePool, "_copy_in", copy_in)
    pool.begin_step()
    assert pool.swap_in(1, {"a": torch.tensor([0, 1, 6]), "b": torch.tensor([0, 2])}) == {1: 4}
    assert copies == [4]  # both requests' missing rows of layer 1 in one index_copy_
    assert pool.swap_in(10, {"a": torch.tensor([0, 6]), "b": torch.tensor([4, 5])}) == {10: 1, 11: 1}
    assert copies == [4, 1, 1]
    assert pool.rows(11, "b").tolist() == [8 + S + 0, 8 + S + 1]  # block 1, newest page
    assert pool.rows(11, "a").tolist() == [0, S + 6 % P]
    # decode tokens 7 and 8 of "a": 8 opens a new page, goes to the hot newest page (slot S + 0) and the host
    pool.grow("a", 8)
    pool.store_kv(11, "a", torch.tensor([7]), torch.full((1, 80), 0.25))
    pool.grow("a", 9, [5])
    new = torch.full((1, 80), 0.5)
    pool.store_kv(11, "a", torch.tensor([8]), new)
    assert torch.equal(pool.read_host_kv(11, "a", torch.tensor([8])), new)
    assert torch.equal(pool.hot_tensor(11)[S].view(torch.float32), new[0])
    pool.begin_step()
    assert pool.swap_in(10, {"a": torch.tensor([4, 7, 8])}) == {10: 2, 11: 2}  # 4 and 7 left the newest page
    assert copies == [4, 1, 1, 2, 2]
    assert pool.resident(11, "a") == {0: 0, 4: 1, 7: 2}
    assert torch.equal(pool.read_kv(11, "a"), torch.cat((va[11][[4]], torch.full((1, 80), 0.25), new)))
    assert torch.equal(pool.read_kv(11, "b"), vb[11][[4, 5]])  # "b" untouched by a call without it


def test_errors_lose_nothing() -> None:
    pool = _pool(requests=1)
    pool.admit("a", [0, 1, 3], length=12)
    with pytest.raises(CapacityError, match="no free HiSparse hot buffer for request 'b'"):
        pool.admit("b", [2])
    with pytest.raises(IndexError, match="top-k position 12 >= its length 12"):
        pool.swap_in(0, {"a": torch.tensor([12])})
    with pytest.raises(CapacityError, match="needs 5 rows outside the newest page but device_buffer_size is 4"):
        pool.swap_in(0, {"a": torch.tensor([0, 1, 2, 3, 4])})
    assert pool.resident(0, "a") == {} and pool.stats.total == {}  # a refused top-k changed nothing
    pool.release("a")
    with pytest.raises(IndexError, match="outside the pool's pages"):
        pool.admit("c", [99])
    assert pool.admit("b", [2], length=1) == 0  # the refused admission gave its block back


@pytest.mark.parametrize("elide", [True, False])
def test_bytes_equal_planner(elide: bool) -> None:
    spec = load_spec("tiny")
    d = Deployment(
        spec,
        kv_budget=2_000_000,
        kv_format="fp32",
        index_format="fp32",
        page_size=P,
        hisparse_ratio=6,
        hisparse_buffer=S,
    )
    st = plan(d).stages[0]
    figs = st.hisparse_elided if elide else st.hisparse_dense
    assert figs is not None and figs.max_requests is not None
    layout = KVLayout(spec, elide=elide, kv_format="fp32", index_format="fp32", page_size=P)
    pool = HiSparsePool.for_figures(layout, figs.logical_tokens, figs.max_requests, S)
    assert (pool.device_bytes, pool.host_bytes) == (figs.device_bytes, figs.host_bytes)
    assert pool.hot_rows == figs.hot_rows == figs.max_requests * (S + P)
    assert figs.device_bytes <= 2_000_000
    assert np.int64(pool.logical_pages * P) == figs.logical_tokens


@pytest.mark.parametrize("elide", [True, False])
def test_long_decode_reads_equal_plain_pool(elide: bool) -> None:
    """Contexts 12x device_buffer_size: every hot read equals the plain device pool's read of the same rows."""
    from dsakv.cache.device_pool import DevicePool
    from dsakv.cache.kv_access import read_tokens, write_tokens
    from dsakv.spec.layout import BufferKey, Kind

    pool = _pool(elide=elide, requests=2, logical_pages=48)
    plain = DevicePool(pool.layout, 48)
    g = torch.Generator().manual_seed(7)
    pages = {"a": list(range(0, 24)), "b": list(range(24, 48))}
    for rid in pages:
        pool.admit(rid, pages[rid], length=0)
    length = {"a": 0, "b": 0}
    swapped = 0
    for step in range(S * 10):
        pool.begin_step()
        for rid in ("a", "b"):
            n = length[rid] + (8 if step == 0 else 1)  # an 8-token prompt, then one token a step
            new = torch.arange(length[rid], n)
            pool.grow(rid, n)
            length[rid] = n
            slots = pool.logical_slots(rid, new)
            for layer in pool.layout.layers:
                v = torch.randn(new.numel(), 80, generator=g)
                pool.store_kv(layer, rid, new, v)
                write_tokens(plain, BufferKey(layer, Kind.KV), slots, v)
        for producer, group in pool.groups.items():
            topk = {}
            for rid in ("a", "b"):
                n = length[rid]
                newest = (n - 1) // P * P
                old = (
                    torch.randperm(newest, generator=g)[: min(S, newest)]
                    if newest
                    else torch.zeros(0, dtype=torch.long)
                )
                topk[rid] = torch.cat((old, torch.arange(newest, n)))
            swapped += sum(pool.swap_in(producer, topk).values())
            for layer in group:
                for rid in ("a", "b"):
                    sel = topk[rid].sort().values
                    ref = read_tokens(plain, BufferKey(layer, Kind.KV), pool.logical_slots(rid, sel))
                    assert torch.equal(pool.read_kv(layer, rid), ref)
                    hot = pool.hot_tensor(layer)
                    assert torch.equal(pool.kv_codec.read(hot, pool.rows_for(layer, rid, sel), 1), ref)
    assert length == {"a": 8 + S * 10 - 1, "b": 8 + S * 10 - 1}
    total = pool.stats.total
    assert sum(s.rows_in for s in total.values()) == swapped > 0
    assert sum(s.bytes_in for s in total.values()) == swapped * KV_BYTES
    assert 0.0 < pool.stats.hit_rate < 1.0
