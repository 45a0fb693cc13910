"""An independent reference of the stored pages' MAC (cache/storage/base.py PageMac) for tests: Poly1305 in
pure Python (RFC 8439 section 2.5, checked against its test vector in tests/unit/cache/test_page_mac.py) keyed by
the one-time key HMAC-SHA256(tier key, MAC_DOMAIN | nonce | layout_id | h | u64 payload bytes)."""

from __future__ import annotations

import hmac
import struct

P1305 = (1 << 130) - 5


def poly1305(key: bytes, msg: bytes) -> bytes:
    """RFC 8439 Poly1305 of `msg` under the 32-byte one-time `key` (r clamped, s added mod 2^128)."""
    if len(key) != 32:
        raise ValueError(f"a Poly1305 key is 32 bytes, got {len(key)}")
    r = int.from_bytes(key[:16], "little") & 0x0FFFFFFC0FFFFFFC0FFFFFFC0FFFFFFF
    s = int.from_bytes(key[16:], "little")
    acc = 0
    for i in range(0, len(msg), 16):
        block = msg[i : i + 16] + b"\x01"
        acc = (acc + int.from_bytes(block, "little")) * r % P1305
    return ((acc + s) & ((1 << 128) - 1)).to_bytes(16, "little")


def page_tag(key: bytes, domain: bytes, layout_id: str, h: str, nonce: bytes, payload: bytes) -> bytes:
    """The tag of page `h` written with `nonce`: Poly1305(HMAC-SHA256(key, domain | nonce | identity), payload)."""
    ident = nonce + layout_id.encode() + h.encode() + struct.pack("<Q", len(payload))
    return poly1305(hmac.new(key, domain + ident, "sha256").digest(), payload)
