"""Per-stage views of pipelined decode workers for the router: its /health rows and labelled /metrics gauges.

A pipelined decode's stage 0 reports every stage in DecodeHealth.pipeline (StageInfo: ok, layers, pages, integrity, as
each stage reports itself); the router shows them as `stages` in that decode's row of its instance table and as

    decode_stage_up{addr="<stage 0>",stage="k"}   decode_stage_pages_used{...}   decode_stage_pages_total{...}
    decode_stage_pages_free{...}   decode_stage_bytes_per_token{...}   decode_stage_integrity_ok{...}

Standard library and dsakv.disagg.{codec, messages} only (the router imports it: no torch).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dsakv.disagg.protocol.codec import to_wire
from dsakv.disagg.protocol.messages import DecodeHealth


def stage_rows(h: DecodeHealth | None) -> list[dict[str, Any]] | None:
    """The decode pipeline's stages as plain rows (None for a single-stage decode or no health yet)."""
    if h is None or not h.pipeline:
        return None
    return [to_wire(s) for s in h.pipeline]


def decode_stage_metrics(decodes: Iterable[tuple[str, DecodeHealth | None]]) -> dict[str, float]:
    """Labelled gauges of every stage of every pipelined decode, keyed `name{addr="...",stage="k"}`."""
    out: dict[str, float] = {}
    for addr, h in decodes:
        for s in (h.pipeline or []) if h is not None else []:
            lab = f'{{addr="{addr}",stage="{s.stage}"}}'
            vals: dict[str, float | None] = {
                "up": float(bool(s.ok)),
                "pages_used": s.pages_used,
                "pages_total": s.pages_total,
                "pages_free": None if s.pages_used is None or s.pages_total is None else s.pages_total - s.pages_used,
                "bytes_per_token": s.bytes_per_token,
                "integrity_ok": None if s.integrity is None else float(s.integrity == "ok"),
            }
            for k, v in vals.items():
                if v is not None:
                    out[f"decode_stage_{k}{lab}"] = float(v)
    return out
