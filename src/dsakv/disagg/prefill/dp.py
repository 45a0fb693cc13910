"""A prefill instance with DP attention (`dsakv serve --role prefill --tp-size D --dp-size D --enable-dp-attention
--ep-size D`): D rank processes, each a whole one-stage prefill worker (PrefillStage) of its own.

    rank 0 (the command)   starts ranks 1..D-1 as copies of itself (engine/elastic.py, DSAKV_TP_RANK set); all
                           join one gloo group (the EP group)
    rank r                 RPC on --port + r (name '<name>.dp<r>'), its own pool, prefix cache, scheduler, jobs,
                           transfer backend, manifest and decode links: it sends the KV of its own requests to
                           whatever decode they name (single rank, TP or DP), as a one-rank prefill does
    model                  the whole checkpoint with each MoE layer an EPMoE holding experts [r E/D, (r+1) E/D)
    steps                  engine/dp.LockstepEngine around the leader's Engine: a round gathers every rank's row;
                           every rank runs each MoE layer's all-to-all once per round (an idle rank with 0 rows)
    routing                every rank's health names the instance's ranks (dp_addrs) and each rank's pages /
                           running / waiting / integrity (dp_ranks); the router adds each rank as a prefill of its
                           own (its own load, its own prefix-cache mirror from its cache events): it picks the DP
                           rank by prefix affinity and load (disagg/router/peers.py)
    a dead rank            its requests were in its process: the decode's liveness ping finds it gone and fails
                           them naming it ('prefill <name>.dp<r> stage 0 at <addr> is dead'); the router marks it
                           down (with rank 0's reason: its exit status) and routes to the others; the survivors
                           re-form the EP group without it (engine/elastic.py) and go on with their requests and
                           KV; rank 0 restarts it (bounded backoff) and it joins at a round boundary. A group that
                           cannot re-form (rank 0 dead: its ranks die with it) is the instance's death: every rank
                           fails what it holds, health down, submissions refused (Unavailable)
    stop                   rank 0 runs a last round with stop = 1; every rank then stops (ranks >= 1 ignore
                           SIGTERM / Ctrl-C: rank 0 stops them)

Imports torch, dsakv.engine and dsakv.disagg.protocol; never serve or cli.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from dsakv.config import PrefillConfig
from dsakv.disagg.protocol.dp_view import dp_addrs, dp_health
from dsakv.engine.dp import LockstepEngine
from dsakv.engine.elastic import ElasticRanks

log = logging.getLogger(__name__)


class PrefillDPEngine(LockstepEngine):
    """LockstepEngine on a prefill rank: a round in which any rank had work wakes the leader's loop at once (an
    idle rank runs the next round's idle forward without waiting out its idle tick)."""

    wake: Callable[[], None] | None = None

    def step(self) -> list[Any]:
        outs = super().step()
        if self.wake is not None and any(r["active"] for r in self.rows):
            self.wake()
        return outs


class PrefillDP:
    """One DP rank's view of its prefill instance: the lockstep engine (installed on the leader), the per-rank
    health rows, liveness, the stop round."""

    def __init__(self, cfg: PrefillConfig, ranks: ElasticRanks, leader: Any) -> None:
        if ranks.gen < 0:  # a restarted rank: admitted at the next round boundary
            ranks.join()
        self.engine = PrefillDPEngine(leader.engine, ranks)
        self.engine.wake = leader.ctx.wake.set
        leader.engine = self.engine
        self.leader = leader
        self.rank, self.size = ranks.rank, ranks.size
        self.addrs = dp_addrs(cfg.host, cfg.port, cfg.dp_rank, self.size)
        log.info("prefill DP rank %d/%d: its experts, own pool, prefix cache and requests", self.rank, self.size)

    def attach(self, stage: Any) -> None:
        """A group that cannot re-form fails every request this rank holds and refuses submissions (naming why);
        rank 0's stop reaches a follower's stage."""
        self.engine.integrity = lambda: self.leader.integrity() == "ok"
        ctx = self.leader.ctx

        def down(why: str) -> None:  # a thread of its own: the caller may hold the step's locks
            def fail() -> None:
                with self.leader.lock:
                    ctx.down_reason = f"prefill {ctx.name}: {why}"
                    self.leader.on_break(ctx.down_reason)

            threading.Thread(target=fail, name="prefill-dp-down", daemon=True).start()

        self.engine.on_down(down)
        if self.rank > 0:
            self.engine.on_stop = stage.request_stop

    def health_fields(self) -> dict[str, Any]:
        return dp_health(self.engine, self.rank, self.addrs)

    def quiesce(self) -> None:
        """Rank 0, stopping: the stop round (every rank stops after it)."""
        if self.rank == 0:
            self.engine.quiesce()

    def close(self) -> None:
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001 (a stop never raises: the rank's error is logged)
            log.warning("prefill DP rank %d: leaving the group: %s", self.rank, e)


__all__ = ["PrefillDP", "PrefillDPEngine"]
