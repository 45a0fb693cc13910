"""Parsing and printing byte sizes ('96.33GiB', '80GB', '1024'). No torch."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from dsakv.errors import ConfigError

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int | float, what: str = "size") -> int:
    """'96.33GiB' -> 103433549905 bytes (floored). Plain numbers are bytes."""
    if isinstance(text, bool):
        raise ConfigError(f"{what} = {text!r} is not a size")
    if isinstance(text, (int, float)):
        value, unit = Decimal(str(text)), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what} = {text!r} is not a size: write a number with an optional unit, e.g. 96.33GiB, 80GB, 512MiB"
            )
        try:
            value = Decimal(m.group(1))
        except InvalidOperation:  # pragma: no cover - regex guards this
            raise ConfigError(f"{what} = {text!r} is not a number") from None
        unit = m.group(2).lower()
    if not value.is_finite() or value * _UNITS[unit] >= 2**63:
        raise ConfigError(f"{what} = {text!r} is larger than any memory (at most 8 EiB): give a real size")
    out = int(value * _UNITS[unit])
    if out < 0:
        raise ConfigError(f"{what} = {text!r} must not be negative")
    return out


def fmt_bytes(n: float) -> str:
    """1.5 GiB style, binary units."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"
