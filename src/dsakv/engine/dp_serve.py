"""Colocated serving over DP attention ranks (`dsakv serve --tp-size D --dp-size D --enable-dp-attention
--ep-size D`): rank 0 serves HTTP through `DPServeEngine` (the Engine API EngineBackend drives), ranks 1..D-1
`follow_dp`; every rank is a LockstepEngine (engine/dp.py: own pool, scheduler and requests, the MoE expert-parallel
over all ranks). Per round, on every rank, in this order:

    broadcast   rank 0's log since the last round: DPAdd(rank, prompt, params, rid) / DPAbort(rank, rid), each
                applied by the rank it names (rank 0 applied its own at once)
    step        LockstepEngine.step (rows all-gathered, every rank steps, an idle one runs idle_forward)
    gather      every rank's outputs (plus its abort outputs) and EngineStats, to rank 0, which fans the outputs
                out to the requests' readers and keeps the stats as the per-rank rows of /health and /metrics

Placement (rank 0, at add): the rank with the fewest requests in flight (its running + waiting + the adds it has
not applied yet: rank 0's own book, exact, updated at add and at each finished output), ties to the lowest rank;
a request's n choices stay on its rank. A request meant for rank r > 0 is validated first as rank 0's engine would
(the same options on every rank), so a bad one gets its error at add, not from another process; a seed is drawn
on rank 0 when the request gives none. Rank death / rejoin is not handled here (a broken collective fails every
request in flight, as a TP group's). Imports torch.distributed through engine/ranks.py and engine/dp.py.
"""

from __future__ import annotations

import itertools
import random
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

from dsakv.engine.dp import LockstepEngine
from dsakv.engine.engine_stats import EngineStats
from dsakv.engine.ranks import IDLE_STEP_S, RankDown, Ranks
from dsakv.engine.request import FinishReason, RequestOutput, SamplingParams
from dsakv.errors import ConfigError

_STOP = "stop"
_MIN = ("capacity_tokens",)  # a request runs on one rank: the instance takes what one rank's pool holds
_SAME = ("page_size", "bytes_per_token")
_MAX = ("steps",)  # lockstep rounds that stepped


@dataclass(frozen=True)
class DPAdd:
    rank: int
    prompt: list[int]
    params: SamplingParams
    rid: str


@dataclass(frozen=True)
class DPAbort:
    rank: int
    rid: str


def choice_ids(rid: str, n: int) -> list[str]:
    """The engine ids of a request's n choices (Engine's names: '<id>', '<id>/1', ...)."""
    return [rid] + [f"{rid}/{i}" for i in range(1, n)]


def failed(rid: str, params: SamplingParams, error: str) -> list[RequestOutput]:
    """Final 'error' outputs of every choice of a request a rank could not add."""
    return [
        RequestOutput(cid, (), (), True, FinishReason.ERROR, error, choice_index=i)
        for i, cid in enumerate(choice_ids(rid, params.n))
    ]


def total(stats: Sequence[EngineStats]) -> EngineStats:
    """The instance's figures: sums over the ranks, except one rank's capacity and the rounds stepped."""
    out: dict[str, int] = {}
    for f in fields(EngineStats):
        vals = [int(getattr(s, f.name)) for s in stats]
        out[f.name] = (
            min(vals) if f.name in _MIN else vals[0] if f.name in _SAME else max(vals) if f.name in _MAX else sum(vals)
        )
    return EngineStats(**out)


class DPServeEngine:
    """Rank 0 of a colocated DP-attention instance: the Engine API over every DP rank (see module docstring)."""

    def __init__(self, lockstep: LockstepEngine, ranks: Ranks) -> None:
        self.lockstep, self.ranks, self.engine = lockstep, ranks, lockstep.engine
        self.size = ranks.size
        self._lock = threading.RLock()
        self._log: list[DPAdd | DPAbort] = []
        self._rng = random.Random(getattr(self.engine.config, "seed", None))
        self._ids = itertools.count()
        self.placed: dict[str, int] = {}  # engine id of every choice in flight -> its DP rank
        self.load = [0] * self.size  # choices in flight per rank
        self.requests_total = [0] * self.size  # requests placed per rank since start
        self.rank_stats: list[EngineStats] = [self.engine.stats()] * self.size  # the last round's, per rank
        self._closed = False
        self._last = 0.0

    def __getattr__(self, name: str) -> Any:  # spec, layout, max_seq_len, cache / spec stats: rank 0's engine
        return getattr(self.engine, name)

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    # ---- requests ------------------------------------------------------------------------------------------

    def pick(self) -> int:
        """The DP rank for the next request: fewest in flight, ties to the lowest rank."""
        return min(range(self.size), key=lambda r: (self.load[r], r))

    def add_request(
        self, prompt_ids: Sequence[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        params = params or SamplingParams()
        if params.seed is None:
            params = replace(params, seed=self._rng.getrandbits(63))
        with self._lock:
            rid = request_id if request_id is not None else f"req-{next(self._ids)}"
            ids = choice_ids(rid, params.n)
            if any(i in self.placed for i in ids):
                raise ConfigError(f"request id {rid!r} is already in use: give each request a unique id")
            r = self.pick()
            if r == 0:
                self.engine.add_request(prompt_ids, params, request_id=rid)
            else:  # the checks rank r's add will run (same options on every rank): errors reach the caller here
                eng = self.engine
                req = eng._with_forks(eng._new_request(rid, prompt_ids, params, False))
                eng.scheduler.check_fits(rid, req.num_prompt_tokens, params.max_new_tokens)
                self._log.append(DPAdd(r, list(prompt_ids), params, rid))
            for i in ids:
                self.placed[i] = r
            self.load[r] += len(ids)
            self.requests_total[r] += 1
        return rid

    def placement(self, request_id: str) -> dict[str, Any] | None:
        """The response fields naming where a request in flight runs: {"dp_rank": r}."""
        r = self.placed.get(request_id)
        return None if r is None else {"dp_rank": r}

    def _done(self, out: RequestOutput) -> None:
        r = self.placed.pop(out.request_id, None) if out.finished else None
        if r is not None:
            self.load[r] -= 1

    def abort(self, request_id: str) -> RequestOutput | None:
        """Rank 0's own: aborted now (its output returned); another rank's: logged, its output comes with the
        next round's gather."""
        with self._lock:
            r = self.placed.get(request_id)
            if r is None:
                return None
            if r != 0:
                self._log.append(DPAbort(r, request_id))
                return None
            out = self.engine.abort(request_id)
            if out is not None:
                self._done(out)
            else:  # finished in a round that broke before its outputs were handled: no longer in flight
                self.placed.pop(request_id, None)
                self.load[0] -= 1
            self.rank_stats = [self.engine.stats(), *self.rank_stats[1:]]  # its pages are free now
            return out

    def has_unfinished(self) -> bool:
        return bool(self.placed or self._log)

    # ---- rounds --------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One round on every rank; the outputs of every rank's requests."""
        with self._lock:
            if self._closed:
                return []
            down = self.ranks.down or self.lockstep.down  # a dead rank, or (DP x PP) a DP rank's broken pipeline
            if down is not None:
                raise RankDown(down)
            if not self._log and not self.placed and time.monotonic() - self._last < IDLE_STEP_S:
                return []
            self._last = time.monotonic()
            log_, self._log = self._log, []
            try:
                self.ranks.broadcast(log_)
                outs = self.lockstep.step()
                parts = self.ranks.gather((list(outs), self.engine.stats()))
            except Exception as e:
                raise self.ranks.guard(e) from e
            self.rank_stats = [st for _, st in parts]
            every = [o for part, _ in parts for o in part]
            for o in every:
                self._done(o)
            return every

    def stats(self) -> EngineStats:
        return total(self.rank_stats)

    def rank_rows(self) -> list[dict[str, int]]:
        """Per DP rank: its pool and scheduler figures from the last round, and rank 0's placement book."""
        return [
            {
                "dp_rank": r,
                "pages_total": st.pages_total,
                "pages_used": st.pages_used,
                "pages_free": st.pages_free,
                "running": st.num_running,
                "waiting": st.num_waiting,
                "in_flight": self.load[r],
                "requests_total": self.requests_total[r],
                "generated_tokens": st.generated_tokens,
            }
            for r, st in enumerate(self.rank_stats)
        ]

    def close(self) -> None:
        """Tell the other ranks to stop, leave the group, wait for their exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.ranks.down is None:
                self.ranks.broadcast(_STOP)
        self.lockstep.close()


def follow_dp(lockstep: LockstepEngine, ranks: Ranks) -> int:
    """DP rank r > 0 of a colocated instance: apply the ops rank 0 logged for this rank, step, hand rank 0 the
    outputs and stats, until rank 0 says stop (the server's SIGTERM / Ctrl-C are rank 0's to handle)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    engine = lockstep.engine
    while True:
        log_ = ranks.broadcast(None)
        if log_ == _STOP:
            lockstep.close()
            return 0
        extra: list[RequestOutput] = []
        for op in log_:
            if op.rank != ranks.rank:
                continue
            if isinstance(op, DPAdd):
                try:
                    engine.add_request(op.prompt, op.params, request_id=op.rid)
                except Exception as e:  # noqa: BLE001 (rank 0 checked it: only a bug lands here, failing it alone)
                    extra += failed(op.rid, op.params, f"DP rank {ranks.rank} could not add it: {e}")
            else:
                out = engine.abort(op.rid)
                if out is not None:
                    extra.append(out)
        outs = lockstep.step()
        ranks.gather((extra + list(outs), engine.stats()))


__all__ = ["DPAbort", "DPAdd", "DPServeEngine", "follow_dp", "total"]
