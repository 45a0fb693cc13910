"""Storage codecs: exact sizes, byte-for-byte page layouts, round-trip error bounds."""

from __future__ import annotations

import struct

import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.formats import make_index_codec, make_kv_codec
from dsakv.cache.kv_access import codec_for, read_tokens, write_tokens
from dsakv.errors import ConfigError
from dsakv.spec.layout import (
    INDEX_FORMATS,
    KV_FORMATS,
    BufferKey,
    Kind,
    KVLayout,
    index_bytes_per_token,
    kv_bytes_per_token,
)
from dsakv.spec.presets import load_spec

# e4m3fn codes of values that survive quantisation exactly
E4M3 = {448.0: 0x7E, -448.0: 0xFE, 1.0: 0x38, 2.0: 0x40, 0.5: 0x30, -1.0: 0xB8, 1.5: 0x3C, 0.0: 0x00}
BASE = [448.0, -448.0, 1.0, 2.0, 0.5, -1.0, 1.5, 0.0]


def f32(x: float) -> bytes:
    return struct.pack("<f", x)


def bf16(x: float) -> bytes:
    return struct.pack("<f", x)[2:]  # exact for values with <= 8 significant bits


def pattern(dim: int, shift: int) -> list[float]:
    return [BASE[(i + shift) % len(BASE)] for i in range(dim)]


@pytest.mark.parametrize("r,d", [(512, 64), (64, 16), (130, 8), (1, 2)])
def test_kv_codec_sizes_match_layout(r, d):
    for fmt in KV_FORMATS:
        c = make_kv_codec(fmt, r, d)
        assert c.bytes_per_token == kv_bytes_per_token(fmt, r, d)
        x = torch.randn(3, r + d)
        assert sum(s.shape[1] for s in c.encode(x)) == c.bytes_per_token
    assert make_kv_codec("fp8-656", 512, 64).bytes_per_token == 656
    assert make_kv_codec("fp8-576", 512, 64).bytes_per_token == 576
    assert make_kv_codec("bf16", 512, 64).bytes_per_token == 1152


@pytest.mark.parametrize("dim", [128, 32, 256, 130])
def test_index_codec_sizes_match_layout(dim):
    for fmt in INDEX_FORMATS:
        c = make_index_codec(fmt, dim)
        assert c.bytes_per_token == index_bytes_per_token(fmt, dim)
    assert make_index_codec("fp8-132", 128).segments == (128, 4)
    assert make_index_codec("fp4-68", 128).segments == (64, 4)
    assert make_index_codec("fp8-132", 256).segments == (256, 8)


def test_pool_page_bytes_per_format():
    spec = load_spec("glm-5.2")
    layout = KVLayout(spec, kv_format="fp8-656", index_format="fp8-132", page_size=64)
    pool = DevicePool(KVLayout(load_spec("tiny"), page_size=64), 2)
    assert layout.buffer(BufferKey(0, Kind.INDEX_K)).page_bytes == 8448 == 64 * 128 + 64 * 4
    assert codec_for(layout, Kind.INDEX_K).bytes_per_token * 64 == 8448
    assert codec_for(layout, Kind.KV).bytes_per_token * 64 == layout.buffer(BufferKey(0, Kind.KV)).page_bytes
    assert pool.tensor(BufferKey(0, Kind.KV)).shape == (2, 64 * (64 + 4 + 32))  # tiny: r=64 -> one scale group
    assert pool.tensor(BufferKey(0, Kind.INDEX_K)).shape == (2, 64 * (32 + 4))


@pytest.mark.parametrize("dim", [128, 256])
def test_index_fp8_page_layout_byte_for_byte(dim):
    """A page holds all P fp8 rows first, then all P fp32 scale groups, in slot-offset order."""
    p = 4
    c = make_index_codec("fp8-132", dim)
    g = dim // 128
    buf = torch.zeros(3, c.bytes_per_token * p, dtype=torch.uint8)
    scales = [2.0**t for t in range(p)]  # token t: pattern(t) * 2^t, amax 448 * 2^t -> scale 2^t exactly
    x = torch.tensor([[v * scales[t] for v in pattern(dim, t)] for t in range(p)])
    offsets = [2, 0, 3, 1]
    c.write(buf, torch.tensor([1 * p + o for o in offsets]), x, p)
    page = bytearray(p * dim + p * 4 * g)
    for t, o in enumerate(offsets):
        page[o * dim : (o + 1) * dim] = bytes(E4M3[v] for v in pattern(dim, t))
        page[p * dim + o * 4 * g : p * dim + (o + 1) * 4 * g] = f32(scales[t]) * g
    assert bytes(buf[1].tolist()) == bytes(page)
    assert int(buf[0].count_nonzero()) == 0 and int(buf[2].count_nonzero()) == 0
    assert torch.equal(c.read(buf, torch.tensor([1 * p + o for o in offsets]), p), x)


def test_kv_fp8_656_row_byte_for_byte():
    """One row per token: latent fp8 | fp32 scale per 128 latent values | rope bf16."""
    r, d, p = 64, 16, 2
    c = make_kv_codec("fp8-656", r, d)
    rope = [1.5, -2.0, 0.25, 3.0] * (d // 4)
    x = torch.tensor([[v * 4.0 for v in pattern(r, 3)] + rope])
    buf = torch.zeros(2, c.bytes_per_token * p, dtype=torch.uint8)
    c.write(buf, torch.tensor([3]), x, p)  # page 1, offset 1
    row = bytes(E4M3[v] for v in pattern(r, 3)) + f32(4.0) + b"".join(bf16(v) for v in rope)
    assert len(row) == 100 == c.bytes_per_token
    assert bytes(buf[1].tolist()) == bytes(c.bytes_per_token) + row
    assert torch.equal(c.read(buf, torch.tensor([3]), p), x)


def test_kv_fp8_576_and_bf16_rows_byte_for_byte():
    vals = [1.0, -448.0, 0.5, 2.0]
    c576 = make_kv_codec("fp8-576", 2, 2)
    assert bytes(c576.encode(torch.tensor([vals]))[0][0].tolist()) == bytes(E4M3[v] for v in vals)
    cbf = make_kv_codec("bf16", 2, 2)
    assert bytes(cbf.encode(torch.tensor([vals]))[0][0].tolist()) == b"".join(bf16(v) for v in vals)


def test_index_fp4_bytes():
    c = make_index_codec("fp4-68", 8)
    x = torch.tensor([[6.0, -6.0, 4.0, 3.0, 0.5, 0.0, -4.0, 1.0]]) * 0.5  # amax 3 -> scale 0.5
    data, scales = c.encode(x)
    # codes 7, 15, 6, 5, 1, 0, 14, 2; even element in the low nibble
    assert data[0].tolist() == [7 | 15 << 4, 6 | 5 << 4, 1 | 0 << 4, 14 | 2 << 4]
    assert bytes(scales[0].tolist()) == f32(0.5)
    assert torch.equal(c.decode([data, scales]), x)


def test_fp32_round_trip_exact_and_bf16_close():
    torch.manual_seed(0)
    for c in (make_kv_codec("fp32", 64, 16), make_index_codec("fp32", 32)):
        x = torch.randn(50, c.dim) * 10
        buf = torch.zeros(7, c.bytes_per_token * 8, dtype=torch.uint8)
        slots = torch.randperm(56)[:50]
        c.write(buf, slots, x, 8)
        assert torch.equal(c.read(buf, slots, 8), x)
    c = make_kv_codec("bf16", 64, 16)
    x = torch.randn(50, 80)
    y = c.decode(c.encode(x))
    assert ((x - y).abs() <= x.abs() * 2**-8).all()


@pytest.mark.parametrize("fmt,dim", [("fp8-656", 200), ("fp8-132", 256), ("fp8-132", 32)])
def test_fp8_error_bounded(fmt, dim):
    torch.manual_seed(1)
    c = make_kv_codec(fmt, dim, 16) if fmt.startswith("fp8-6") else make_index_codec(fmt, dim)
    x = torch.randn(64, c.dim) * torch.logspace(-3, 3, 64)[:, None]
    y = c.decode(c.encode(x))
    lat = x[:, :dim]
    groups = torch.nn.functional.pad(lat.abs(), (0, -dim % 128)).view(64, -1, 128).amax(-1)
    scale = groups.repeat_interleave(128, 1)[:, :dim] / 448.0
    err = (lat - y[:, :dim]).abs()
    assert (err <= lat.abs() * 2**-4 + scale * 2**-9 + lat.abs() * 1e-6).all()
    assert err.max() > 0
    if fmt == "fp8-656":  # the rope part is bf16
        assert ((x[:, dim:] - y[:, dim:]).abs() <= x[:, dim:].abs() * 2**-8).all()


def test_fp4_error_bounded():
    torch.manual_seed(2)
    c = make_index_codec("fp4-68", 128)
    x = torch.randn(32, 128)
    y = c.decode(c.encode(x))
    scale = x.abs().amax(-1, keepdim=True) / 6.0
    assert ((x - y).abs() <= scale * 1.0 + 1e-6).all()


def test_slots_and_buffers_are_checked():
    c = make_index_codec("fp8-132", 128)
    buf = torch.zeros(2, c.bytes_per_token * 4, dtype=torch.uint8)
    with pytest.raises(IndexError, match="slots 0..7"):
        c.write(buf, torch.tensor([8]), torch.ones(1, 128), 4)
    with pytest.raises(IndexError, match="padding -1"):
        c.read(buf, torch.tensor([-1, 0]), 4)
    with pytest.raises(ValueError, match="one slot per token"):
        c.write(buf, torch.tensor([0, 1]), torch.ones(1, 128), 4)
    with pytest.raises(ValueError, match="pages of 1056 bytes"):
        c.read(buf, torch.tensor([0]), 8)
    with pytest.raises(ValueError, match=r"encodes \[N, 128\]"):
        c.encode(torch.ones(2, 64))
    with pytest.raises(ConfigError, match="unknown KV format"):
        make_kv_codec("fp8-999", 512, 64)
    with pytest.raises(ConfigError, match="even index_head_dim"):
        make_index_codec("fp4-68", 33)


def test_pool_access_by_key():
    spec = load_spec("tiny")
    layout = KVLayout(spec, kv_format="fp32", index_format="fp32", page_size=4, elide=True)
    pool = DevicePool(layout, 3)
    x = torch.randn(5, 80)
    slots = torch.tensor([11, 0, 5, 4, 9])
    write_tokens(pool, BufferKey(3, Kind.KV), slots, x)
    assert torch.equal(read_tokens(pool, BufferKey(3, Kind.KV), slots), x)
    assert int(pool.tensor(BufferKey(2, Kind.KV)).count_nonzero()) == 0
    with pytest.raises(KeyError, match="layer 3 is a shared layer"):
        write_tokens(pool, BufferKey(3, Kind.INDEX_K), slots, torch.randn(5, 32))
    with pytest.raises(KeyError, match="outside this layout"):
        read_tokens(pool, BufferKey(12, Kind.KV), slots)
