"""HostPool: same keys as the device pool (no INDEX_K for shared layers), layouts, copies, planner sizing."""

from __future__ import annotations

import pytest
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache import HiCache, HiCacheConfig
from dsakv.cache.host_pool import HOST_LAYOUTS, host_pages_for, make_host_pool
from dsakv.cache.page_copy import copy_pages, gather_rows, row_offsets, run_start, scatter_rows
from dsakv.errors import CapacityError, ConfigError
from dsakv.plan.capacity import Deployment, plan
from dsakv.spec.layout import BufferKey, Kind, KVLayout
from dsakv.spec.presets import load_spec

TINY = load_spec("tiny")


def _layout(page_size: int = 4, elide: bool = True) -> KVLayout:
    return KVLayout(TINY, page_size=page_size, elide=elide)


def _random_pool(layout: KVLayout, pages: int, seed: int = 0) -> DevicePool:
    pool = DevicePool(layout, pages)
    g = torch.Generator().manual_seed(seed)
    for key in pool.keys:
        t = pool.tensor(key)
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    return pool


@pytest.mark.parametrize("name", sorted(HOST_LAYOUTS))
def test_host_pool_has_only_device_keys(name: str) -> None:
    layout = _layout()
    host = make_host_pool(name, layout, 3)
    assert layout.producers == (0, 1, 2, 6, 10)
    assert [k for k in host.keys if k.kind is Kind.INDEX_K] == [BufferKey(i, Kind.INDEX_K) for i in (0, 1, 2, 6, 10)]
    assert len(host.keys) == 12 + 5
    assert not host.has(BufferKey(3, Kind.INDEX_K))
    with pytest.raises(KeyError, match="layer 3 is a shared layer"):
        host.view(BufferKey(3, Kind.INDEX_K))
    # kv fp8-656 for tiny: 64 + 4*1 + 2*16 = 100 B/token; index fp8-132: 32 + 4 = 36 B/token; page 4
    assert layout.bytes_per_token == 12 * 100 + 5 * 36 == 1380
    assert host.nbytes == 3 * 4 * 1380
    assert host.view(BufferKey(6, Kind.INDEX_K)).shape == (3, 144)
    host.check_compatible(DevicePool(layout, 2))
    with pytest.raises(ConfigError, match="L3/index_k exists only in the device pool"):
        host.check_compatible(DevicePool(_layout(elide=False), 2))


def test_page_first_is_one_row_per_page() -> None:
    layout = _layout()
    host = make_host_pool("page_first", layout, 2)
    offs = row_offsets(layout)
    assert offs[BufferKey(0, Kind.KV)] == (0, 400)
    assert offs[BufferKey(0, Kind.INDEX_K)] == (400, 144)
    assert offs[BufferKey(3, Kind.KV)] == (3 * 544, 400)
    assert offs[BufferKey(4, Kind.KV)] == (3 * 544 + 400, 400)
    assert host.buffer.shape == (2, 5520)
    host.buffer.zero_()
    host.view(BufferKey(4, Kind.KV))[1].fill_(7)
    assert int(host.buffer[1].nonzero().min()) == 3 * 544 + 400
    assert int(host.buffer[1].sum()) == 7 * 400


@pytest.mark.parametrize("name", sorted(HOST_LAYOUTS))
def test_offload_load_roundtrip_is_exact(name: str) -> None:
    layout = _layout()
    dev = _random_pool(layout, 10)
    before = gather_rows(dev, [3, 5, 7]).clone()
    host = make_host_pool(name, layout, 6)
    assert host.offload(dev, [3, 5, 7], [4, 0, 2]) == 3 * layout.bytes_per_page
    assert torch.equal(host.read_rows([4, 0, 2]), before)
    for key in dev.keys:
        assert torch.equal(host.view(key)[[4, 0, 2]], dev.tensor(key)[[3, 5, 7]])
    scatter_rows(dev, [3, 5, 7], torch.zeros_like(before))
    assert host.load(dev, [4, 0, 2], [9, 1, 3]) == 3 * layout.bytes_per_page
    assert torch.equal(gather_rows(dev, [9, 1, 3]), before)
    host.write_rows([5], before[:1])
    assert torch.equal(host.read_rows([5]), before[:1])
    with pytest.raises(ValueError, match="3 source pages but 2 destination pages"):
        host.offload(dev, [1, 2, 3], [0, 1])


@pytest.mark.parametrize("ratio,size", [(2.5, None), (0.5, None), (None, 3_000_000)])
def test_host_bytes_equal_planner_host_figure(ratio: float | None, size: int | None) -> None:
    d = Deployment(TINY, kv_budget=2_000_000, page_size=16, hicache_ratio=ratio, hicache_size=size)
    (stage,) = plan(d).stages
    layout = d.layout(0, elide=True)
    assert stage.host_tokens_elided is not None and stage.host_bytes is not None
    dev = DevicePool.for_tokens(layout, stage.tokens_elided)
    assert dev.nbytes == stage.tokens_elided * layout.bytes_per_token
    cache = HiCache(dev, PageAllocator(dev.num_pages), HiCacheConfig(hicache_ratio=ratio, hicache_size=size))
    assert cache.host is not None
    assert cache.host_budget_bytes == stage.host_bytes
    assert cache.host_tokens == stage.host_tokens_elided
    assert cache.host.nbytes == stage.host_tokens_elided * layout.bytes_per_token
    assert cache.host.nbytes <= stage.host_bytes < cache.host.nbytes + layout.bytes_per_page


def test_host_sizing_matches_planner_on_glm52() -> None:
    spec = load_spec("glm-5.2")
    d = Deployment(spec, kv_budget=96 * 2**30, draft_layers=1, hicache_ratio=2.0)
    (stage,) = plan(d).stages
    layout = d.layout(0, elide=True)
    budget, pages = host_pages_for(layout, stage.tokens_elided // layout.page_size, ratio=2.0)
    assert (budget, pages * layout.page_size) == (stage.host_bytes, stage.host_tokens_elided)
    assert pages * layout.page_size == 2 * stage.tokens_elided


def test_host_size_below_one_page_is_an_error() -> None:
    layout = _layout()
    with pytest.raises(CapacityError, match=r"host tier of 5000 bytes cannot hold one page.*needs 5520 bytes"):
        host_pages_for(layout, 8, size=5000)
    with pytest.raises(ConfigError, match="exactly one"):
        host_pages_for(layout, 8)
    with pytest.raises(ConfigError, match="host layout 'rows' is unknown"):
        HiCacheConfig(hicache_ratio=1.0, layout="rows")
    with pytest.raises(ConfigError, match="write policy 'lazy' is unknown"):
        HiCacheConfig(hicache_ratio=1.0, write_policy="lazy")


def test_plan_cli_host_tokens_equal_host_pool(capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from dsakv.cli.main import main

    assert (
        main(["plan", "tiny", "--kv-budget", "2000000", "--page-size", "16", "--hicache-ratio", "2.5", "--json"]) == 0
    )
    (stage,) = json.loads(capsys.readouterr().out)["stages"]
    layout = KVLayout(TINY, page_size=16)
    dev = DevicePool.for_tokens(layout, stage["tokens_elided"])
    cache = HiCache(dev, PageAllocator(dev.num_pages), HiCacheConfig(hicache_ratio=2.5))
    assert cache.host is not None
    assert (cache.host_tokens, cache.host_budget_bytes) == (stage["host_tokens_elided"], stage["host_bytes"])
    assert cache.host.nbytes == stage["host_tokens_elided"] * stage["bytes_per_token_elided"]


@pytest.mark.parametrize(
    "src_ids,dst_ids",
    [([2, 3, 4], [7, 1, 5]), ([6, 0, 3], [2, 3, 4]), ([5, 6, 7], [0, 1, 2]), ([7, 2, 5], [4, 0, 6]), ([], [])],
)
@pytest.mark.parametrize("strided", [False, True])
def test_copy_pages_every_path_matches_indexing(src_ids: list[int], dst_ids: list[int], strided: bool) -> None:
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (8, 48), dtype=torch.uint8, generator=g)
    whole = torch.randint(0, 256, (8, 80), dtype=torch.uint8, generator=g)
    before = whole.clone()
    dst = whole[:, 16:64] if strided else whole[:, :48].clone()  # a page_first column slice, or a plain tensor
    want = dst.clone()
    want[dst_ids] = src[src_ids]
    copy_pages(dst, torch.tensor(dst_ids, dtype=torch.int64), src, torch.tensor(src_ids, dtype=torch.int64))
    assert torch.equal(dst, want)
    if strided:  # bytes outside the slice are untouched
        assert torch.equal(whole[:, :16], before[:, :16]) and torch.equal(whole[:, 64:], before[:, 64:])
    assert run_start(torch.tensor([3, 4, 5])) == 3 and run_start(torch.tensor([3, 5])) is None
