"""TransferPlan: runs, exact block addresses, byte totals equal to the layout's figure, no empty block.

Failure mode 1: a zero-length block is never produced, and `Blocks.check` (called at every backend
boundary) refuses one if it is built by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from dsakv.disagg.transfer import BackendMeta, Blocks, Manifest, RegionInfo, TransferError, TransferPlan, check_pair
from dsakv.disagg.transfer.plan import PairTable, Strategy, choose_strategy, contiguous_runs
from dsakv.spec import BufferKey, Kind, KVLayout, load_spec

KV, IK = Kind.KV, Kind.INDEX_K


def manifest(layout: KVLayout, worker: str, base: int, num_pages: int) -> Manifest:
    regions, addr = {}, base
    for b in layout.buffers:
        regions[b.key] = RegionInfo(addr, b.page_bytes, num_pages)
        addr += b.page_bytes * num_pages
    return Manifest.from_layout(layout, regions, BackendMeta("local", b""), worker)


@pytest.fixture(scope="module")
def glm():
    return load_spec("glm-5.2")


def test_contiguous_runs_exact() -> None:
    src = np.array([7, 8, 9, 3, 4, 10, 11], dtype=np.int64)
    dst = np.array([0, 1, 2, 3, 4, 6, 5], dtype=np.int64)
    rs, rd, rn = contiguous_runs(src, dst)
    assert rs.tolist() == [7, 3, 10, 11]
    assert rd.tolist() == [0, 3, 6, 5]
    assert rn.tolist() == [3, 2, 1, 1]
    rs, rd, rn = contiguous_runs(np.array([5]), np.array([9]))
    assert (rs.tolist(), rd.tolist(), rn.tolist()) == ([5], [9], [1])


def test_blocks_exact_addresses(glm) -> None:
    stage = manifest(KVLayout(glm, 20, 40), "pp1", 0x1000_0000, 16)
    decode = manifest(KVLayout(glm, 0, 78, draft_layers=1), "decode", 0x9000_0000, 32)
    pairs = check_pair(stage, decode).pairs
    plan = TransferPlan.build(pairs, [4, 5, 6, 1], [10, 11, 12, 20])
    assert plan.num_runs == 2 and plan.num_blocks == 25 * 2
    # key-major: block 0/1 are L20/kv's two runs
    s, d = stage.region(BufferKey(20, KV)), decode.region(BufferKey(20, KV))
    pb = 656 * 64
    assert plan.blocks.src[:2].tolist() == [s.addr + 4 * pb, s.addr + 1 * pb]
    assert plan.blocks.dst[:2].tolist() == [d.addr + 10 * pb, d.addr + 20 * pb]
    assert plan.blocks.length[:2].tolist() == [3 * pb, 1 * pb]
    k = [p.key for p in pairs].index(BufferKey(22, IK))
    s, d = stage.region(BufferKey(22, IK)), decode.region(BufferKey(22, IK))
    assert plan.blocks.src[2 * k : 2 * k + 2].tolist() == [s.addr + 4 * 8448, s.addr + 8448]
    assert plan.blocks.dst[2 * k : 2 * k + 2].tolist() == [d.addr + 10 * 8448, d.addr + 20 * 8448]
    assert plan.pair_index.tolist() == np.repeat(np.arange(25), 2).tolist()
    assert (plan.blocks.length > 0).all()
    assert plan.nbytes == plan.blocks.nbytes == 4 * 881_920


def test_bytes_equal_layout_figure_no_shared_index_k(glm) -> None:
    """A 32K-token request, decode layout both sides (79 layers, elided): 54,728 B/token, of which 22*132 index-K."""
    layout = KVLayout(glm, 0, 78, draft_layers=1)
    assert layout.bytes_per_token == 54_728
    pages = 32768 // 64
    a = manifest(layout, "prefill", 0x1000_0000, pages)
    b = manifest(layout, "decode", 0x9_0000_0000, pages)
    p = check_pair(a, b)
    rng = np.random.default_rng(0)
    src, dst = rng.permutation(pages), rng.permutation(pages)
    plan = TransferPlan.build(p.pairs, src, dst)
    assert plan.nbytes == 32768 * 54_728 == layout.bytes_per_token * 32768
    assert plan.bytes_by_kind() == {KV: 32768 * 79 * 656, IK: 32768 * 22 * 132}
    ik_layers = sorted({p.key.layer for p in plan.pairs if p.key.kind is IK})
    assert len(ik_layers) == 22 and not set(ik_layers) & set(glm.shared_layers)
    assert plan.num_blocks == plan.num_runs * 101
    dense = KVLayout(glm, 0, 78, draft_layers=1, elide=False)
    assert dense.bytes_per_token == 62_252  # what would have moved without elision


def test_contiguous_request_is_one_block_per_key(glm) -> None:
    layout = KVLayout(glm, 0, 78, draft_layers=1)
    a, b = manifest(layout, "a", 0x1000_0000, 600), manifest(layout, "b", 0x9_0000_0000, 600)
    plan = TransferPlan.build(PairTable.of(check_pair(a, b).pairs), np.arange(512), np.arange(40, 552))
    assert plan.num_runs == 1 and plan.num_blocks == 101


def test_plan_refuses_bad_page_ids(glm) -> None:
    a = manifest(KVLayout(glm, 20, 40), "a", 0x1000_0000, 8)
    b = manifest(KVLayout(glm, 0, 78), "b", 0x9000_0000, 4)
    pairs = check_pair(a, b).pairs
    with pytest.raises(ValueError, match="src_pages has 2 ids but dst_pages has 1"):
        TransferPlan.build(pairs, [0, 1], [0])
    with pytest.raises(ValueError, match="dst page ids span 0..4 but L20/kv has 4 pages on the receiver"):
        TransferPlan.build(pairs, [0, 1], [0, 4])
    with pytest.raises(ValueError, match="src page ids span -1..1"):
        TransferPlan.build(pairs, [-1, 1], [0, 1])
    with pytest.raises(ValueError, match="dst page 2 appears twice"):
        TransferPlan.build(pairs, [0, 1], [2, 2])
    with pytest.raises(ValueError, match="at least one page"):
        TransferPlan.build(pairs, [], [])
    with pytest.raises(ValueError, match="integer page ids, got dtype float64"):
        TransferPlan.build(pairs, [0.0], [1.0])
    with pytest.raises(ValueError, match="at least one key pair"):
        TransferPlan.build([], [0], [1])


def test_blocks_check_refuses_zero_length_and_empty() -> None:
    with pytest.raises(TransferError, match="1 block\\(s\\) of length <= 0, first #1 .*length 0"):
        Blocks.of([0x1000, 0x2000], [0x9000, 0xA000], [4096, 0]).check()
    with pytest.raises(TransferError, match="no blocks to transfer"):
        Blocks.of([], [], []).check()


def test_batches_split_in_order() -> None:
    b = Blocks.of(np.arange(10) * 16 + 0x1000, np.arange(10) * 16 + 0x9000, np.full(10, 16))
    parts = b.batches(4)
    assert [len(p) for p in parts] == [4, 4, 2]
    assert np.concatenate([p.src for p in parts]).tolist() == b.src.tolist()
    assert sum(p.nbytes for p in parts) == 160


def test_staged_plan_exact_addresses(glm) -> None:
    stage = manifest(KVLayout(glm, 20, 40), "pp1", 0x1000_0000, 16)
    decode = manifest(KVLayout(glm, 0, 78, draft_layers=1), "decode", 0x9000_0000, 32)
    pairs = check_pair(stage, decode).pairs
    plan = TransferPlan.build(pairs, [9, 4, 1, 6, 2], [10, 11, 12, 20, 21])
    assert (plan.num_runs, plan.num_blocks, plan.num_staged_blocks) == (5, 125, 50)
    base = 0x7000_0000
    staged = plan.staged(base)
    assert staged.strategy is Strategy.STAGED and staged.staging_addr == base and staged.nbytes == plan.nbytes
    pb = 656 * 64
    d = decode.region(BufferKey(20, KV))
    # key 0 (L20/kv) occupies staging [0, 5 pb): runs at request positions 0 (3 pages) and 3 (2 pages)
    assert staged.blocks.src[:2].tolist() == [base, base + 3 * pb]
    assert staged.blocks.dst[:2].tolist() == [d.addr + 10 * pb, d.addr + 20 * pb]
    assert staged.blocks.length[:2].tolist() == [3 * pb, 2 * pb]
    offs = staged.staging_offsets
    assert offs[0] == 0 and offs[1] == 5 * int(plan.table.page_bytes[0])
    assert int(offs[-1] + 5 * plan.table.page_bytes[-1]) == plan.nbytes  # key-major, no gap, no overlap
    assert int(staged.blocks.length.sum()) == plan.nbytes
    assert plan.strategy is Strategy.BLOCKS  # the original is untouched
    with pytest.raises(ValueError, match="staging address"):
        plan.staged(0)


def test_choose_strategy_rule() -> None:
    # saved = (blocks - staged) x descriptor cost (mooncake 25 us, nixl 9 us); cost = bytes / 5 GB/s
    assert choose_strategy(6262, 224_000_000, 101, "mooncake") is Strategy.STAGED  # 154 ms saved > 45 ms copy
    assert choose_strategy(6262, 224_000_000, 101, "nixl") is Strategy.STAGED  # 55 ms saved > 45 ms copy
    assert choose_strategy(6262, 400_000_000, 101, "nixl") is Strategy.BLOCKS  # 55 ms saved < 80 ms copy
    assert choose_strategy(6262, 400_000_000, 101, "mooncake") is Strategy.STAGED
    assert choose_strategy(6464, 224_000_000, 6464, "mooncake") is Strategy.BLOCKS  # fragmented destination
    assert choose_strategy(101, 224_000_000, 101, "mooncake") is Strategy.BLOCKS  # contiguous
    assert choose_strategy(6262, 10 * 224_000_000, 101, "mooncake") is Strategy.BLOCKS  # large blocks
    assert choose_strategy(0, 0, 0) is Strategy.BLOCKS
