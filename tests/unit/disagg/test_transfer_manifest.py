"""Manifest: exact contents from a pool, wire round trip, and clear refusals of bad input.

Failure mode 5 (buffers backing buffers that do not exist) at the transfer layer: a manifest whose
regions are those of a pool sized for every layer, while its layout elides shared index-K, is refused.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from dsakv.disagg.transfer import BackendMeta, Manifest, ManifestError, RegionInfo
from dsakv.spec import BufferKey, Kind, KVLayout, load_spec

KV, IK = Kind.KV, Kind.INDEX_K
META = BackendMeta("local", b"peer-1")


def fake_regions(layout: KVLayout, num_pages: int = 4, base: int = 0x10000) -> dict[BufferKey, RegionInfo]:
    """Non-overlapping synthetic regions, one per layout buffer, in key order."""
    out, addr = {}, base
    for b in layout.buffers:
        out[b.key] = RegionInfo(addr, b.page_bytes, num_pages)
        addr += b.page_bytes * num_pages + 4096
    return out


@pytest.fixture(scope="module")
def glm():
    return load_spec("glm-5.2")


def test_from_pool_exact_fields() -> None:
    torch = pytest.importorskip("torch")
    from dsakv.cache.device_pool import DevicePool

    spec = load_spec("tiny")
    layout = KVLayout(spec)  # 12 layers, producers 0, 1, 2, 6, 10; kv 64+4+32=100 B/token, index 32+4=36
    pool = DevicePool(layout, 3)
    m = Manifest.from_pool(pool, META, "decode-0")
    assert m.worker == "decode-0" and m.model_hash == spec.identity_hash()
    assert (m.layer_start, m.layer_end, m.draft_layers, m.page_size) == (0, 12, (), 64)
    assert m.shared_layers == (3, 4, 5, 7, 8, 9, 11)
    assert m.keys == tuple(sorted([BufferKey(i, KV) for i in range(12)] + [BufferKey(i, IK) for i in (0, 1, 2, 6, 10)]))
    r = m.region(BufferKey(6, IK))
    assert (r.addr, r.page_bytes, r.num_pages) == (pool.tensor(BufferKey(6, IK)).data_ptr(), 36 * 64, 3)
    assert m.region(BufferKey(3, KV)).page_bytes == 100 * 64
    assert m.bytes_per_token == layout.bytes_per_token == 12 * 100 + 5 * 36
    with pytest.raises(KeyError, match="holds no buffer L3/index_k"):
        m.region(BufferKey(3, IK))
    del torch


def test_round_trip_is_exact(glm) -> None:
    layout = KVLayout(glm, 20, 40, draft_layers=1)
    m = Manifest.from_layout(layout, fake_regions(layout), META, "prefill-pp1")
    again = Manifest.from_bytes(m.to_bytes())
    assert again == m
    assert again.draft_layers == (78,) and again.layers == (*range(20, 40), 78)
    # 20 KV + producers 22, 26, 30, 34, 38 + draft 78 (KV + index-K)
    assert len(again.regions) == 20 + 5 + 2
    assert again.backend_meta == BackendMeta("local", b"peer-1")


def test_pool_sized_for_every_layer_is_refused(glm) -> None:
    """Failure mode 5: regions of a dense (every-layer) pool under an elided layout."""
    elided = KVLayout(glm, 0, 78)
    dense_regions = fake_regions(elided.with_elide(False))
    with pytest.raises(ManifestError) as e:
        Manifest.from_layout(elided, dense_regions, META, "host")
    msg = str(e.value)
    assert "L3/index_k (layer 3, kind index_k)" in msg and "layer 3 is shared and elision is on" in msg
    assert "57 such key(s)" in msg


def test_missing_region_and_size_disagreement_are_refused(glm) -> None:
    layout = KVLayout(glm, 20, 40)
    regions = fake_regions(layout)
    del regions[BufferKey(22, IK)]
    with pytest.raises(ManifestError, match=r"no region for L22/index_k \(layer 22, kind index_k\)"):
        Manifest.from_layout(layout, regions, META)
    regions = fake_regions(layout)
    r = regions[BufferKey(21, KV)]
    regions[BufferKey(21, KV)] = RegionInfo(r.addr, 576 * 64, r.num_pages)
    with pytest.raises(ManifestError, match="L21/kv .* 36864 B/page but the layout says 41984 B/page"):
        Manifest.from_layout(layout, regions, META)


def test_overlapping_and_zero_sized_regions_are_refused(glm) -> None:
    layout = KVLayout(glm, 20, 40)
    regions = fake_regions(layout)
    a = regions[BufferKey(20, KV)]
    regions[BufferKey(21, KV)] = RegionInfo(a.addr + 64, a.page_bytes, a.num_pages)
    with pytest.raises(ManifestError, match="regions L20/kv .* and L21/kv .* overlap"):
        Manifest.from_layout(layout, regions, META)
    with pytest.raises(ManifestError, match="zero-sized region"):
        RegionInfo(0x1000, 41984, 0)


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "msgpack decoding failed"),
        (b"\xc1garbage", "msgpack decoding failed"),
        (msgpack.packb([1, 2, 3]), "foreign manifest: expected format 'dsakv-kv-manifest', got 'list'"),
        (msgpack.packb({"format": "sglang-kv-args"}), "foreign manifest: .* got 'sglang-kv-args'"),
        (msgpack.packb({"format": "dsakv-kv-manifest", "version": 2}), "manifest version 2 is not supported"),
        ("not bytes", "a manifest is bytes, got str"),
    ],
)
def test_malformed_or_foreign_bytes_are_refused(data, match) -> None:
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(data)


def _good_dict(glm) -> dict:
    layout = KVLayout(glm, 20, 40)
    return Manifest.from_layout(layout, fake_regions(layout), META, "p").to_dict()


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d.pop("page_size"), "missing field 'page_size'"),
        (lambda d: d.update(page_size="64"), "field 'page_size' = '64' must be of type int"),
        (lambda d: d.update(elide=1), "field 'elide' = 1 must be of type bool"),
        (lambda d: d.update(layer_end=90), "layer range 20..89 is not a non-empty range"),
        (lambda d: d.update(kv_format="fp9"), "unknown KV format 'fp9'"),
        (lambda d: d["regions"].append([20, "kv", 0x9, 41984, 4]), "lists L20/kv twice"),
        (lambda d: d["regions"].append([20, "vk", 0x9, 41984, 4]), r"bad key \(layer 20, kind 'vk'\)"),
        (lambda d: d["regions"].append([20, "kv"]), "must be \\[layer, kind, addr, page_bytes, pages\\]"),
        (lambda d: d["regions"].pop(0), r"no region for L20/kv"),
        (lambda d: d.update(backend_meta="x"), "'backend_meta' must be bytes, got str"),
    ],
)
def test_malformed_fields_are_refused(glm, mutate, match) -> None:
    d = _good_dict(glm)
    mutate(d)
    with pytest.raises(ManifestError, match=match):
        Manifest.from_bytes(msgpack.packb(d, use_bin_type=True))


def test_manifest_is_frozen(glm) -> None:
    layout = KVLayout(glm, 20, 40)
    m = Manifest.from_layout(layout, fake_regions(layout), META)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.page_size = 32  # type: ignore[misc]
