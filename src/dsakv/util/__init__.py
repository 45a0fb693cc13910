"""Small helpers shared by every layer (imports nothing from dsakv but errors): ceil division, one generic
name -> object registry. Sits below `spec` in the layer order."""

from __future__ import annotations

from dsakv.util.registry import Registry


def ceil_div(a: int, b: int) -> int:
    """Smallest integer >= a / b for a >= 0, b > 0 (pages for `a` tokens at page size `b`)."""
    if b <= 0:
        raise ValueError(f"ceil_div: divisor must be positive, got {b}")
    return -(-a // b)


__all__ = ["Registry", "ceil_div"]
