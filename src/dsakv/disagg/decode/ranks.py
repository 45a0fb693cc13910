"""A decode worker with tensor-parallel ranks (`dsakv serve --role decode --tp-size T`).

    rank 0 (the DecodeWorker, RPC):   engine = RankedEngine (engine/ranks.py): prealloc / start_decode / abort are
                                      logged and replayed on every rank before its next step
    rank r (a child process, no RPC): its shard of the model, its own pool (the full keys: latent KV and index-K
                                      are replicated), its own transfer backend with that pool registered, and
                                      its manifest gathered by rank 0 at start-up (`follow_decode`)
    handshake:                        HelloReply.ranks carries ranks 1.. (each manifest holds its pool's regions
                                      and backend endpoint): the prefill pairs with every rank and writes each
                                      rank's pool per the sender rule (disagg/transfer/rank_routes.py)
    STAGE_DONE:                       rank_parts = bytes landed per decode rank; a report that misses a rank fails
                                      the request (no rank may decode on pages it never received)

Every rank reserves the same page ids (same log, same allocator: a rank that does not stops with RanksDiverged),
so one grant of rank 0's pages serves every rank's pool; destination staging slots are off (each rank would need
its own slot and scatter). The prefill reports a request only after every rank's write completed, so a rank
applying start_decode at its next step finds the KV in place. A dead rank is named by the ranks' watcher: every
request the worker holds fails with its name and exit status (waiting ones free their pages once no prefill can
still write them), preallocs are refused and the health says down (the router takes it out of routing); the
group is not re-formed: restart the worker.
Imports torch, dsakv.engine, dsakv.model and dsakv.disagg.{protocol, transfer}; never serve or cli.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from dsakv.config import DecodeConfig
from dsakv.disagg.protocol.messages import DecodeStageRef, StageDone
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.engine import Engine
from dsakv.engine.ranks import RankDown, RankedEngine
from dsakv.errors import NoFreePages

log = logging.getLogger(__name__)
DEATH_WAIT_S = 5.0  # after a failed step: how long to wait for a rank's death to be seen (to name it)


def rank_name(cfg: DecodeConfig, rank: int) -> str:
    return f"{cfg.name or f'decode@{cfg.host}:{cfg.port}'}.tp{rank}"


def _tp_engine(cfg: DecodeConfig) -> tuple[Any, Engine]:
    """(ranks, this rank's engine on its shard): joins (rank 0: starts) the TP group of cfg.tp_size ranks."""
    from dsakv.engine.ranks import start_ranks
    from dsakv.engine.tp_spec import tp_engine
    from dsakv.model.loader import load_config
    from dsakv.model.parallel import shard_config

    shard_config(load_config(Path(cfg.model)), cfg.tp_size)  # a TP size the checkpoint cannot split fails here
    ranks = start_ranks(cfg.tp_size, cfg.rank_argv)
    try:  # with MTP the draft layer is sharded as the target layers (every rank drafts the same tokens)
        return ranks, tp_engine(cfg.model, ranks.group, cfg.config.engine)
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise


class RankedDecode(RankedEngine):
    """RankedEngine on a decode worker: once a rank is down, a prealloc is refused (NoFreePages: the router
    places the request on another decode) and a step returns nothing (the requests were failed by the watcher's
    callback, DecodeTP.attach), so the worker's step loop idles instead of raising every turn."""

    def prealloc(
        self, request_id: str, prompt_ids: Sequence[int], params: Any = None, *, keep_room: bool = False
    ) -> Any:
        if self.ranks.down is not None:
            raise NoFreePages(f"{self.ranks.down}: this decode takes no request until it is restarted")
        return super().prealloc(request_id, prompt_ids, params, keep_room=keep_room)

    def step(self) -> Any:
        if self.ranks.down is not None:
            time.sleep(0.05)
            return []
        try:
            outs = super().step()
        except RankDown as e:  # the step's failed requests, each with the rank's name (not gloo's error alone)
            return [replace(o, error=str(e)) if o.finished and o.error else o for o in e.outputs]
        if not any(o.finished and o.error for o in outs):
            return outs
        # a failed model step on a TP group: a collective that broke because a rank died whose exit was not seen
        # yet (its sockets close before it is reaped): wait for the watcher's verdict, bounded, then name it
        end = time.monotonic() + DEATH_WAIT_S
        while self.ranks.check() is None and time.monotonic() < end:
            time.sleep(0.05)
        down = self.ranks.down
        if down is None:
            return outs
        return [replace(o, error=f"{down} (its step failed: {o.error})") if o.finished and o.error else o for o in outs]


class DecodeTP:
    """Rank 0's side of a decode worker's TP group (one rank: every method a no-op): the other ranks'
    manifests for the handshake, the bytes each (prefill stage, decode rank) pair received, the group's state."""

    def __init__(self, ranks: Any = None, refs: list[DecodeStageRef] | None = None) -> None:
        self.ranks, self.refs = ranks, refs or []
        self.size = 1 if ranks is None else int(ranks.size)
        self.pair_bytes: dict[str, int] = {}
        self._lock = threading.Lock()

    @classmethod
    def build(cls, cfg: DecodeConfig, model: Any = None) -> tuple[DecodeTP, Any]:
        """(the view, the engine the worker runs): a plain Engine for one rank; for T > 1 a RankedEngine over
        this rank's shard, once every rank registered its pool and sent its manifest."""
        if cfg.tp_size <= 1:
            return cls(), Engine(
                model if model is not None else Path(cfg.model), cfg.config.engine, model_dir=cfg.model
            )
        ranks, engine = _tp_engine(cfg)
        manifests = ranks.gather(b"")  # every follower's, in rank order (rank 0's is the worker's own)
        refs = [DecodeStageRef(stage=0, rpc="", manifest=m, rank=r) for r, m in enumerate(manifests) if r > 0]
        log.info("decode %s: %d TP ranks, each its own pool registered for KV transfer", rank_name(cfg, 0), ranks.size)
        return cls(ranks, refs), RankedDecode(engine, ranks)

    def attach(self, worker: Any) -> None:
        """A rank's death (the ranks' watcher) fails every request the worker holds, naming the rank and its exit
        status; its pages on rank 0 are freed as each request settles (nothing is left held)."""
        if self.ranks is None:
            return

        def down(why: str) -> None:  # in a thread of its own: the caller may be the step thread, which holds the
            # ranked engine's lock the break's aborts take (Ranks.guard polls the ranks from inside the step)
            brk = threading.Thread(target=worker.on_pipeline_break, args=(f"decode {worker.name}: {why}",))
            brk.daemon = True
            brk.start()

        self.ranks.on_down(down)

    def check_parts(self, worker: Any, p: StageDone) -> str | None:
        """Record the bytes per (prefill stage, decode rank) pair (a TP prefill: per (prefill stage and rank,
        decode rank) pair); an error if an ok report misses a decode rank or a route the sender rule gave it."""
        if self.size == 1 and p.senders == 1:
            return None
        what = f"this decode has {self.size} TP rank(s), each with its own pool"
        return check_cells(p, self.pair_bytes, self._lock, range(self.size), lambda r: f"tp{r}", what)

    def health_fields(self) -> dict[str, Any]:
        with self._lock:
            pairs = dict(self.pair_bytes)
        if self.size == 1:
            return {"kv_bytes_pairs": pairs} if pairs else {}
        return {"down": self.ranks.down, "kv_bytes_pairs": pairs}

    def quiesce(self) -> None:
        """Nothing to do before the service stops (a DP rank 0 runs its stop round here: decode/dp.py)."""

    def close(self, engine: Any) -> None:
        """Tell the other ranks to stop and wait for them (with a rank down: kill the rest, the dead one named)."""
        if self.size == 1:
            return
        try:
            engine.close()
        except Exception as e:  # noqa: BLE001 (a stop never raises: the rank's error is logged)
            log.warning("decode: closing the TP group: %s", e)


def check_cells(
    p: StageDone,
    pairs: dict[str, int],
    lock: threading.Lock,
    cells: Iterable[int],
    name: Callable[[int], str],
    what: str,
) -> str | None:
    """Record report `p`'s bytes per (prefill stage [and rank], decode cell) pair in `pairs` (key 'prefill:stage
    [.tpS]->name(cell)'); an error if an ok report did not land on exactly the `cells` it must write (a cell: a
    decode rank's pool, LinkPart.cell) or a route the sender rule gave it did not land (`what` says why each cell
    must receive the KV)."""
    want = sorted(cells)
    with lock:
        if p.senders > 1:
            for s, per in p.sender_parts.items():
                for r, n in per.items():
                    key = f"{p.prefill}:{p.stage}.tp{s}->{name(r)}"
                    pairs[key] = pairs.get(key, 0) + n
        else:
            for r, n in p.rank_parts.items():
                key = f"{p.prefill}:{p.stage}->{name(r)}"
                pairs[key] = pairs.get(key, 0) + n
    if not p.ok:
        return None
    where = f"prefill {p.prefill} stage {p.stage}"
    if sorted(p.rank_parts) != want:
        return (
            f"{where} wrote decode rank(s) {[name(c) for c in sorted(p.rank_parts)]}, but {what}: every rank must "
            "receive the KV"
        )
    if p.senders > 1:
        landed = {(s, r) for s, per in p.sender_parts.items() for r, n in per.items() if n > 0}
        routes = {(int(x[0]), int(x[1])) for x in p.routes if len(x) == 2}
        bad = sorted((s, r) for s, r in routes if not (0 <= s < p.senders and r in want))
        missing = sorted(routes - landed)
        if not routes or bad or missing or {r for _, r in routes} != set(want):
            return (
                f"{where} ({p.senders} TP ranks) reported routes {sorted(routes)} and landed "
                f"{sorted(landed)}: (prefill rank, decode rank) part(s) "
                f"{missing or bad or 'for every decode rank'} did not land; {what}, and it accepts the KV only "
                "when every part the sender rule gives landed"
            )
    return None


def follow_decode(cfg: DecodeConfig) -> int:
    """A follower rank of a TP decode worker: load the shard, register the pool, hand rank 0 the manifest, then
    replay rank 0's log and run every step until it says stop."""
    from dsakv.engine.ranks import follow

    ranks, engine = _tp_engine(cfg)
    backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
    try:
        backend.register(engine.pool.regions())
        manifest = Manifest.from_pool(engine.pool, backend.meta(), rank_name(cfg, ranks.rank))
        ranks.gather(manifest.to_bytes())
        log.info("decode TP rank %d/%d: pool registered, following rank 0", ranks.rank, ranks.size)
        return follow(engine, ranks)
    finally:
        backend.close()


__all__ = ["DecodeTP", "check_cells", "follow_decode", "rank_name"]
