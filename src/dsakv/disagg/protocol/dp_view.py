"""The per-rank rows of an instance with DP attention, as its HEALTH reports them (decode/dp.py, prefill/dp.py):
each rank's pages / requests / integrity from the last lockstep round (engine/dp.LockstepEngine.rows), and a
rank out of the group (dead, restarting, or given up) as down with its reason (rank 0's ElasticRanks).
Imports dsakv.disagg.protocol only."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dsakv.disagg.protocol.messages_base import DPRankInfo


def dp_health(engine: Any, rank: int, addrs: Sequence[str]) -> dict[str, Any]:
    """The HEALTH fields of DP rank `rank` of an instance whose ranks listen at `addrs` (rank order); `engine`: its
    LockstepEngine."""
    rows = {
        row["dp_rank"]: DPRankInfo(
            rank=row["dp_rank"],
            addr=addrs[row["dp_rank"]],
            pages_free=row["pages_free"],
            pages_used=row["pages_used"],
            pages_total=row["pages_total"],
            running=row["running"],
            waiting=row["waiting"],
            integrity_ok=bool(row["integrity_ok"]),
        )
        for row in engine.rows
    }
    down_ranks = getattr(engine.ranks, "down_ranks", dict)
    for r, why in down_ranks().items():  # out of the group (restarting, or given up): no pool to route to
        rows[r] = DPRankInfo(r, addrs[r], 0, 0, 0, 0, 0, False, up=False, down=why)
    return {
        "dp_rank": rank,
        "dp_size": len(addrs),
        "dp_addrs": list(addrs),
        "dp_ranks": [rows[r] for r in sorted(rows)],
    }


def dp_addrs(host: str, port: int, dp_rank: int, dp_size: int) -> list[str]:
    """Every rank's RPC address: rank r of the instance listens on the instance's --port + r (`port` is this
    rank's)."""
    base = port - dp_rank if port else 0
    return [f"{host}:{base + r}" for r in range(dp_size)]


__all__ = ["dp_addrs", "dp_health"]
