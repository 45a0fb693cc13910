"""The prefill leader's views (a mixin of prefill.leader.PipelineLeader): integrity, page and prefix-cache figures,
idleness and the HEALTH fields, each read under the engine's lock."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from dsakv.cache.hicache import HiCache
from dsakv.disagg.prefill.stage_context import StageContext
from dsakv.disagg.protocol.lifecycle import Phase
from dsakv.disagg.protocol.messages import StageInfo
from dsakv.engine.engine import Engine


class LeaderViews:
    """Needs (set by PipelineLeader.__init__) the attributes below."""

    ctx: StageContext
    engine: Engine
    lock: threading.RLock
    cache: HiCache | None

    # ---- views -----------------------------------------------------------------------------------------

    def integrity(self) -> str:
        with self.lock:
            try:
                self.engine.check_integrity()
            except AssertionError as e:
                return str(e)
            held = self.engine.allocator.held_by
            missing = [j.rid for j in self.ctx.jobs.in_phase(Phase.TRANSFERRING) if not held(j.rid).size]
            return f"requests {missing[:4]} await releases but hold no pages" if missing else "ok"

    def pages_used(self) -> int:
        with self.lock:
            return self.engine.allocator.num_used

    def cached_pages(self) -> list[int]:
        """Sorted page ids the prefix cache holds."""
        with self.lock:
            if self.cache is None:
                return []
            ids = [n.device for n in self.cache.radix.nodes() if n.device is not None]
            return sorted(int(p) for p in np.concatenate(ids)) if ids else []

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        return self.engine.cache_stats()

    def idle(self) -> bool:
        """Nothing queued, computing, transferring or awaiting a release."""
        with self.lock:
            return not self.ctx.jobs and not self.engine.has_unfinished() and not self.engine.scheduler.kept

    def health_fields(self) -> dict[str, Any]:
        ctx, sch = self.ctx, self.engine.scheduler
        with self.lock:
            return {
                "stages": [
                    StageInfo(stage=r, rpc=str(i["rpc"]), pid=i.get("pid"), boot=i.get("boot"))
                    for r, i in sorted(ctx.group.peer_info.items())
                ]
                if ctx.group.formed
                else [],
                "waiting": sch.num_waiting,
                "running": sch.num_running,
                "awaiting_release": len(ctx.jobs.in_phase(Phase.TRANSFERRING)),
                "prefix_cache": self.prefix_cache_stats(),
            }
