"""A decode instance with DP attention (`dsakv serve --role decode --tp-size D --dp-size D --enable-dp-attention
--ep-size D`): D rank processes, each a whole DecodeWorker of its own.

    rank 0 (the command)   starts ranks 1..D-1 as copies of itself (engine/ranks.py, DSAKV_TP_RANK set); all join
                           one gloo group (the EP group)
    rank r                 RPC on --port + r (name '<name>.dp<r>'), its own pool, scheduler, requests, transfer
                           backend and manifest: the prefill handshakes each rank as a decode of its own and writes a
                           request's KV into the pool of the rank that holds it only (one receiver per key)
    model                  the whole checkpoint with each MoE layer an EPMoE holding experts [r E/D, (r+1) E/D)
    steps                  engine/dp.LockstepEngine: a round gathers every rank's row; every rank runs each MoE
                           layer's all-to-all once per round (an idle rank with 0 rows)
    MTP                    (--speculative-num-steps) each rank drafts and verifies its own requests as a single-rank
                           MTP decode (the draft's KV and hidden state from the prefill), with the whole draft layer
                           (its MoE not expert-parallel: a draft runs no collective); only the verify calls the
                           EPMoE layers, once per round like a plain step (a broken verify is held: StepRetry)
    routing                every rank's health names the instance's ranks (dp_addrs) and, from the last round, each
                           rank's pages / running / waiting / integrity (dp_ranks); the router adds each rank as a
                           decode it routes to by load (disagg/router/peers.py): it picks the DP rank
    a dead rank            its requests were in its process (the router fails them naming its DP rank, and rank
                           0's reason: exit status); the survivors re-form the group without it (engine/elastic.py:
                           its experts loaded from the checkpoint onto them) and go on with their requests and KV;
                           rank 0's health row shows it down (`up` False, `down` the reason); rank 0 restarts it
                           (bounded backoff), it joins at a round boundary and the router routes to it again. A
                           group that cannot re-form (rank 0 dead: its ranks die with it) is the instance's death:
                           every rank fails what it holds, health down, preallocs refused (NoFreePages)
    stop                   rank 0 runs a last round with stop = 1; every rank then stops its worker (ranks >= 1
                           ignore SIGTERM / Ctrl-C: rank 0 stops them)

Imports torch, dsakv.engine, dsakv.model and dsakv.disagg.protocol; never serve or cli.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from dsakv.config import DecodeConfig
from dsakv.disagg.protocol.dp_view import dp_addrs, dp_health
from dsakv.disagg.protocol.messages import StageDone
from dsakv.engine.dp import LockstepEngine, dp_rank_config, ep_model
from dsakv.errors import NoFreePages

log = logging.getLogger(__name__)


class DPDecodeEngine(LockstepEngine):
    """LockstepEngine on a decode rank: once a rank is down a prealloc is refused (the router places elsewhere)."""

    def prealloc(self, request_id: str, prompt_ids: Any, params: Any = None, *, keep_room: bool = False) -> Any:
        if self.down is not None:
            raise NoFreePages(f"{self.down}: this decode instance takes no request until it is restarted")
        return self.engine.prealloc(request_id, prompt_ids, params, keep_room=keep_room)


class DecodeDP:
    """One DP rank's view of its instance (the DecodeTP interface the worker calls): the bytes landed per
    (prefill stage[.rank], this DP rank), the per-rank rows, liveness, the stop round."""

    refs: list[Any] = []  # no other attention rank shares this pool: the handshake carries this rank only
    size = 1  # attention-TP ranks per DP rank

    def __init__(self, cfg: DecodeConfig, engine: DPDecodeEngine) -> None:
        self.cfg, self.engine = cfg, engine
        self.rank, self.dp_size = engine.rank, engine.size
        self.addrs = dp_addrs(cfg.host, cfg.port, cfg.dp_rank, self.dp_size)
        self.pair_bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def build(cls, cfg: DecodeConfig, model: Any = None) -> tuple[DecodeDP, DPDecodeEngine]:
        """(the view, the engine): joins (rank 0: starts) the group of cfg.dp_size ranks and loads the whole
        checkpoint with this rank's experts."""
        from dsakv.engine.engine import Engine

        ranks, model = ep_model(cfg.model, cfg.dp_size, cfg.rank_argv, cfg.config.engine.dtype)
        try:
            engine = Engine(model, cfg.config.engine, model_dir=cfg.model)
            if ranks.gen < 0:  # a restarted rank: admitted at the next round boundary
                ranks.join()
            dp = DPDecodeEngine(engine, ranks)
        except BaseException:
            for p in ranks.children:
                p.kill()
            raise
        log.info(
            "decode DP rank %d/%d: experts %d/%d, own pool and requests", ranks.rank, ranks.size, ranks.rank, ranks.size
        )
        return cls(cfg, dp), dp

    def attach(self, worker: Any) -> None:
        """A group that cannot re-form fails every request this rank holds (naming why); rank 0's stop reaches a
        follower's worker."""
        self.engine.integrity = lambda: worker.integrity() == "ok"

        def down(why: str) -> None:  # a thread of its own: the caller may hold the step's locks
            brk = threading.Thread(target=worker.on_pipeline_break, args=(f"decode {worker.name}: {why}",))
            brk.daemon = True
            brk.start()

        self.engine.on_down(down)
        if self.rank > 0:
            self.engine.on_stop = worker.request_stop

    def check_parts(self, worker: Any, p: StageDone) -> str | None:
        """Record the bytes landed per (prefill stage[.prefill rank], this DP rank) pair; a report naming any other
        receiving rank is refused (this rank's pool is the only one the link has)."""
        with self._lock:
            if p.senders > 1:
                for s, per in p.sender_parts.items():
                    n = sum(per.values())
                    key = f"{p.prefill}:{p.stage}.tp{s}->dp{self.rank}"
                    self.pair_bytes[key] = self.pair_bytes.get(key, 0) + n
            else:
                key = f"{p.prefill}:{p.stage}->dp{self.rank}"
                n = sum(p.rank_parts.values()) if p.rank_parts else p.bytes  # (a one-part link reports bytes only)
                self.pair_bytes[key] = self.pair_bytes.get(key, 0) + n
        if p.ok and sorted(p.rank_parts) not in ([], [0]):
            return (
                f"prefill {p.prefill} stage {p.stage} wrote decode rank(s) {sorted(p.rank_parts)}, but DP rank "
                f"{self.rank} has one pool (part 0)"
            )
        return None

    def health_fields(self) -> dict[str, Any]:
        with self._lock:
            pairs = dict(self.pair_bytes)
        return {"down": self.engine.down, "kv_bytes_pairs": pairs, **dp_health(self.engine, self.rank, self.addrs)}

    def quiesce(self) -> None:
        """Rank 0, stopping: the stop round (every rank stops its worker after it)."""
        if self.rank == 0:
            self.engine.quiesce()

    def close(self, engine: Any) -> None:
        try:
            self.engine.close()
        except Exception as e:  # noqa: BLE001 (a stop never raises: the rank's error is logged)
            log.warning("decode DP rank %d: leaving the group: %s", self.rank, e)


__all__ = ["DPDecodeEngine", "DecodeDP", "dp_rank_config"]  # (dp_rank_config: engine/dp.py, shared)
