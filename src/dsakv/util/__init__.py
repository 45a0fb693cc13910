"""Small helpers shared by every layer (imports nothing from dsakv but errors): ceil division, one generic
name -> object registry, the byte-level BPE byte alphabet. Sits below `spec` in the layer order."""

from __future__ import annotations

from dsakv.util.registry import Registry


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b for a >= 0, b > 0 (pages for `a` tokens at page size `b`)."""
    if b <= 0:
        raise ValueError(f"ceil_div: divisor must be positive, got {b}")
    return -(-a // b)


def byte_symbols() -> list[str]:
    """GPT-2's byte -> printable character map (byte-level BPE vocabularies spell bytes with it), by byte value."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    out = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


__all__ = ["Registry", "byte_symbols", "ceil_div"]
