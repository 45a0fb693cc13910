"""Handshake check: pairing by key (PP 20-39 vs decode 0-77), one-sided elision, refusals.

Failure mode 3: a PP stage (20 layers) vs a decode worker (78 layers + draft) must pair, by key,
with every destination being the receiver's buffer of the same layer (positional pairing would
send L20 to the decode's L0). Failure mode 4: one-sided index-K elision is skipped, in both
directions, and only for index-K of shared layers; any size or format mismatch is refused at
handshake naming layer, kind and both sizes.
"""

from __future__ import annotations

import dataclasses

import pytest

from dsakv.disagg.transfer import BackendMeta, IncompatiblePeer, Manifest, RegionInfo, check_pair, pair
from dsakv.spec import BufferKey, Kind, KVLayout, load_spec

KV, IK = Kind.KV, Kind.INDEX_K
GLM52_PRODUCERS = (0, 1, 2, 6, 10, 14, 18, 22, 26, 30, 34, 38, 42, 46, 50, 54, 58, 62, 66, 70, 74)


def manifest(layout: KVLayout, worker: str, base: int, num_pages: int = 4) -> Manifest:
    regions, addr = {}, base
    for b in layout.buffers:
        regions[b.key] = RegionInfo(addr, b.page_bytes, num_pages)
        addr += b.page_bytes * num_pages
    return Manifest.from_layout(layout, regions, BackendMeta("local", worker.encode()), worker)


@pytest.fixture(scope="module")
def glm():
    return load_spec("glm-5.2")


@pytest.fixture(scope="module")
def decode(glm) -> Manifest:
    return manifest(KVLayout(glm, 0, 78, draft_layers=1), "decode", 0x7000_0000_0000)


def test_glm52_producers(glm) -> None:
    assert glm.producers == GLM52_PRODUCERS


def test_pp_stage_pairs_by_key_with_full_decode(glm, decode) -> None:
    stage1 = manifest(KVLayout(glm, 20, 40), "prefill-pp1", 0x1000_0000_0000)
    p = check_pair(stage1, decode)
    assert p.layers == tuple(range(20, 40))
    want = sorted([BufferKey(i, KV) for i in range(20, 40)] + [BufferKey(i, IK) for i in (22, 26, 30, 34, 38)])
    assert [kp.key for kp in p.pairs] == want
    assert p.skipped == ()
    for kp in p.pairs:  # every destination is the decode's buffer of the same key, not of the same position
        assert kp.dst == decode.regions[kp.key] and kp.src == stage1.regions[kp.key]
    first = p.pairs[0]
    assert first.key == BufferKey(20, KV) and first.dst != decode.regions[BufferKey(0, KV)]
    assert p.bytes_per_page == 20 * 656 * 64 + 5 * 132 * 64 == 881_920
    assert pair(stage1, decode) == list(p.pairs)


def test_pp_stage0_with_draft_layer(glm, decode) -> None:
    stage0 = manifest(KVLayout(glm, 0, 20, draft_layers=1), "prefill-pp0", 0x1000_0000_0000)
    p = check_pair(stage0, decode)
    assert p.layers == (*range(20), 78)
    ik = [kp.key.layer for kp in p.pairs if kp.key.kind is IK]
    assert ik == [0, 1, 2, 6, 10, 14, 18, 78]  # 7 producers + the draft layer, as the reference says
    assert p.bytes_per_page == (21 * 656 + 8 * 132) * 64


def _shared_in(lo: int, hi: int) -> list[int]:
    return [i for i in range(lo, hi) if i not in GLM52_PRODUCERS]


def test_one_sided_elision_sender_dense_is_skipped(glm, decode) -> None:
    dense_stage = manifest(KVLayout(glm, 20, 40, elide=False), "prefill-dense", 0x1000_0000_0000)
    p = check_pair(dense_stage, decode)
    assert [s.key for s in p.skipped] == [BufferKey(i, IK) for i in _shared_in(20, 40)]
    assert {s.held_by for s in p.skipped} == {"sender"}
    assert p.skipped[0].reason == "layer 20 is shared: its index-K is never read; the receiver elides it"
    assert p.bytes_per_page == 881_920  # no index-K bytes for shared layers


def test_one_sided_elision_receiver_dense_is_skipped(glm) -> None:
    stage = manifest(KVLayout(glm, 20, 40), "prefill-pp1", 0x1000_0000_0000)
    dense_decode = manifest(KVLayout(glm, 0, 78, draft_layers=1, elide=False), "decode-dense", 0x7000_0000_0000)
    p = check_pair(stage, dense_decode)
    assert [s.key for s in p.skipped] == [BufferKey(i, IK) for i in _shared_in(20, 40)]
    assert {s.held_by for s in p.skipped} == {"receiver"}
    assert p.bytes_per_page == 881_920


def test_both_dense_pairs_every_index_k(glm) -> None:
    a = manifest(KVLayout(glm, 20, 40, elide=False), "a", 0x1000_0000_0000)
    b = manifest(KVLayout(glm, 0, 78, elide=False), "b", 0x7000_0000_0000)
    p = check_pair(a, b)
    assert p.skipped == () and len(p.pairs) == 40
    assert p.bytes_per_page == 20 * (656 + 132) * 64


def test_kv_size_mismatch_names_layer_kind_and_sizes(glm, decode) -> None:
    stage = manifest(KVLayout(glm, 20, 40), "prefill-pp1", 0x1000_0000_0000)
    # a peer whose manifest says fp8-656 but whose KV pages are 576 B/token (a bug, or another build)
    bad = {k: (RegionInfo(r.addr, 576 * 64, r.num_pages) if k.kind is KV else r) for k, r in stage.regions.items()}
    liar = dataclasses.replace(stage, regions=bad)
    with pytest.raises(IncompatiblePeer) as e:
        check_pair(liar, decode)
    msg = str(e.value)
    assert "L20/kv (layer 20, kind kv): size differs, sender 36864 B/page vs receiver 41984 B/page" in msg
    assert "(and 15 more)" in msg  # 20 KV keys differ; 5 are listed


def test_format_mismatch_names_layer_kind_and_sizes(glm, decode) -> None:
    stage = manifest(KVLayout(glm, 20, 40, kv_format="fp8-576"), "prefill-576", 0x1000_0000_0000)
    with pytest.raises(IncompatiblePeer) as e:
        check_pair(stage, decode)
    msg = str(e.value)
    assert "L20/kv (layer 20, kind kv): format differs, sender fp8-576 (36864 B/page) vs receiver fp8-656 " in msg
    assert "(41984 B/page)" in msg and "--kv-format" in msg
    stage = manifest(KVLayout(glm, 20, 40, index_format="bf16"), "prefill-bf16ik", 0x1000_0000_0000)
    with pytest.raises(IncompatiblePeer, match=r"L22/index_k \(layer 22, kind index_k\): format differs, sender bf16 "):
        check_pair(stage, decode)


def test_missing_producer_index_k_is_refused(glm, decode) -> None:
    stage = manifest(KVLayout(glm, 20, 40), "prefill-pp1", 0x1000_0000_0000)
    regions = dict(stage.regions)
    del regions[BufferKey(22, IK)]
    object.__setattr__(stage, "regions", regions)  # bypass validation: a peer that lost a producer buffer
    with pytest.raises(IncompatiblePeer) as e:
        check_pair(stage, decode)
    assert "L22/index_k (layer 22, kind index_k): held by the receiver (8448 B/page) but not by the sender" in str(
        e.value
    )


def test_model_page_size_and_layer_refusals(glm, decode) -> None:
    other = manifest(KVLayout(load_spec("glm-5.1"), 20, 40), "glm51", 0x1000_0000_0000)
    with pytest.raises(IncompatiblePeer, match="model identity differs: sender runs 'glm-5.1'"):
        check_pair(other, decode)
    small_pages = manifest(KVLayout(glm, 20, 40, page_size=32), "p32", 0x1000_0000_0000)
    with pytest.raises(IncompatiblePeer, match="page size differs: sender 32 tokens/page, receiver 64"):
        check_pair(small_pages, decode)
    late = manifest(KVLayout(glm, 40, 78), "pp2", 0x1000_0000_0000)
    early_decode = manifest(KVLayout(glm, 0, 40), "decode-pp0", 0x7000_0000_0000)
    with pytest.raises(IncompatiblePeer, match="no layer in common: sender holds layers 40-77, receiver holds 0-39"):
        check_pair(late, early_decode)
