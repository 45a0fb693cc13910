"""DP attention served: each DP rank its own Engine (pool, scheduler, requests), the MoE expert-parallel over all
ranks (model/parallel.EPMoE: every rank takes part in every MoE layer's all-to-all), stepped in lockstep.

    engine = LockstepEngine(Engine(model with attach_ep), ranks)   on every rank, each serving its own requests
    engine.step()   one round: all_gather of every rank's row (ROW: active, stop, pages, running, waiting,
                    integrity) -> nobody active: nothing runs (a short sleep) -> else every rank steps its engine
                    and a rank whose step ran no forward (idle, or its requests wait for KV) runs idle_forward
                    (each EPMoE with 0 rows), so every rank calls every MoE layer's collectives exactly once
    engine.rows     the last round's rows, one dict per rank (the health's per-rank view)
    engine.quiesce  rank 0: one last round with stop = 1; every rank sees it, calls on_stop and runs no more rounds

A dead rank: the EP all-to-all needs every expert for every MoE layer, so no rank can step with the group it
had. With plain Ranks (engine/ranks.py) every rank fails every request it holds, naming the dead rank (`down`; rank
0 from its watcher with the exit status, the others from the dead sibling's pid), and runs no more collectives.
With ElasticRanks (engine/elastic.py: the DP decode and prefill) the group re-forms instead: the failed collective (a
round's all_gather, an all-to-all inside a step: StepRetry, the engine holds the step's rows) sends every survivor to
`_reform` (rank 0 names the dead rank, writes the next generation without it; the others join it), the experts
are re-placed (ElasticRanks.place), and the interrupted round runs again: the survivors' requests go on with their
KV, the dead rank's requests were in the dead process. A restarted rank is admitted at a round boundary: rank 0's
row sets `join`, every member re-forms with it. `down` then means the group could not re-form (the instance is
down, as with plain Ranks).
A DP rank whose engine is a pipeline's stage 0 (DP attention x PP, pipeline/dp_stage.py) steps through the `forwarded`
and `idle` hooks (did the step run a forward; the idle share of stage 0 and of every later stage), and its row says
`down` once its pipeline broke (a stage died): that round every rank gathers the texts and fails what it holds naming
the first such DP rank (`down`), and no rank steps again (the instance is down; restart it).
Imports torch, torch.distributed and dsakv.model.parallel; nothing assumes a device.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from dsakv.engine.elastic import ElasticRanks
from dsakv.engine.ranks import RankDown, Ranks
from dsakv.errors import StepRetry
from dsakv.model.parallel import EPMoE, EPReformed, idle_forward

log = logging.getLogger(__name__)
C = TypeVar("C")

ROW = (
    "active",
    "stop",
    "pages_free",
    "pages_used",
    "pages_total",
    "running",
    "waiting",
    "integrity_ok",
    "dp_rank",
    "join",
    "down",
)
IDLE_S = 0.02  # a round in which no rank had work sleeps this long (bounds the idle rounds' CPU)
DEATH_WAIT_S = 5.0  # after a failed collective: how long to look for the dead rank (to name it)
INTEGRITY_EVERY_S = 1.0  # how often a rank refreshes its row's integrity flag


def pid_gone(pid: int) -> bool:
    """The process `pid` exited (gone, or a zombie its parent has not reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


class LockstepEngine:
    """One DP rank's engine (the Engine API passed through) stepping in lockstep with the other DP ranks."""

    def __init__(
        self,
        engine: Any,
        ranks: Ranks | ElasticRanks,
        integrity: Callable[[], bool] | None = None,
        *,
        forwarded: Callable[[], bool] | None = None,
        idle: Callable[[], Any] | None = None,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        """`forwarded()`: did the engine's last step run a forward (default: the first EPMoE layer ran); `idle()`:
        this rank's share of a round it ran no forward in (default: idle_forward over the model); `on_close()`:
        runs first in close() (a pipeline's stage 0 stops its stages). Given by pipeline/dp_stage.py."""
        self.engine, self.ranks = engine, ranks
        self.forwarded, self.idle, self.on_close = forwarded, idle, on_close
        self.elastic = isinstance(ranks, ElasticRanks)
        self.rank, self.size = ranks.rank, ranks.size
        self.integrity = integrity or (lambda: True)
        self._ok, self._checked = True, 0.0
        self._lock = threading.Lock()  # one round at a time (the step thread; quiesce from another)
        self.rows: list[dict[str, int]] = []
        self.pids: list[int] = [] if self.elastic else [int(p) for p in ranks.gather(os.getpid())]
        self.stopped = False  # a stop round ran: no more collectives
        self._down: str | None = None
        self._down_lock = threading.Lock()
        self._on_down: list[Callable[[str], None]] = []
        self.on_stop: Callable[[], None] | None = None  # a follower: rank 0 stopped the instance
        self.moe = next((m for m in engine.model.modules() if isinstance(m, EPMoE)), None)
        self.rounds = self.idle_forwards = 0
        self.reforms = 0
        ranks.on_down(self._mark_down)  # rank 0: the watcher names a dead child with its exit status
        for m in engine.model.modules():
            if isinstance(m, EPMoE):
                m.on_error = self._guard  # a broken all-to-all fails the step with RankDown naming the dead rank
        if isinstance(ranks, ElasticRanks):
            ranks.place(engine.model)  # (a restarted rank may join a group some ranks of which are down)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    # ---- liveness ----------------------------------------------------------------------------------------

    @property
    def down(self) -> str | None:
        return self._down or self.ranks.down

    def on_down(self, fn: Callable[[str], None]) -> None:
        """fn(message) once a rank is known dead (from the watcher or the thread whose collective failed)."""
        self._on_down.append(fn)
        if self.down is not None:
            fn(self.down)

    def _mark_down(self, why: str) -> None:
        with self._down_lock:
            if self._down is not None:
                return
            self._down = why
        log.error("%s: this DP rank fails every request it holds; restart the instance to re-form the group", why)
        for fn in list(self._on_down):
            fn(why)

    def find_down(self, wait: float = DEATH_WAIT_S) -> str | None:
        """The dead rank's name after a collective failed: rank 0's watcher (exit status), else a sibling whose
        pid is gone; polled for up to `wait` seconds (its sockets close before it is reaped)."""
        end = time.monotonic() + wait
        while True:
            down = self.ranks.check() if isinstance(self.ranks, Ranks) and self.ranks.children else self.ranks.down
            if down is None:
                dead = [r for r, pid in enumerate(self.pids) if r != self.rank and pid_gone(pid)]
                # rank 0 (the parent) waits for the exit status: its poll says nothing while another thread of it
                # is inside the child's wait() (Popen's waitpid lock), though the child is a zombie already
                if dead and (not self.ranks.children or time.monotonic() >= end):
                    down = f"DP rank down: dp rank {dead[0]} (pid {self.pids[dead[0]]}) died"
            if down is not None:
                self._mark_down(down)
                return self.down
            if time.monotonic() >= end:
                return None
            time.sleep(0.05)

    # ---- rounds ------------------------------------------------------------------------------------------

    def _row(self, stop: bool) -> torch.Tensor:
        sch = self.engine.scheduler
        st = self.engine.stats()
        active = bool(sch.running or sch.ready or sch.waiting)
        now = time.monotonic()
        if now - self._checked >= INTEGRITY_EVERY_S:
            self._ok, self._checked = bool(self.integrity()), now
        join = isinstance(self.ranks, ElasticRanks) and self.rank == 0 and bool(self.ranks.joiners())
        vals = (active, stop, st.pages_free, st.pages_used, st.pages_total, st.num_running, st.num_waiting, self._ok)
        down = self._engine_down() is not None
        return torch.tensor([int(v) for v in (*vals, self.rank, join, down)], dtype=torch.int64)

    def _engine_down(self) -> str | None:
        """Why this rank's engine cannot step (a pipeline's stage 0 whose pipeline broke), else None."""
        down = getattr(self.engine, "down", None)
        return down if isinstance(down, str) else None

    def _engines_down(self, rows: list[dict[str, int]]) -> None:
        """Some rank's engine is down (its row says so): every rank gathers the texts and is down naming the first."""
        try:
            texts = self.ranks.gather(self._engine_down())
        except Exception as e:  # noqa: BLE001
            self._broken(e)
            return
        r = next(r["dp_rank"] for r in rows if r["down"])
        self._mark_down(f"DP rank down: dp rank {r}: {texts[r] or 'its engine is down'}")

    def _round(self, stop: bool) -> list[dict[str, int]]:
        mine = self._row(stop)
        out = [torch.empty_like(mine) for _ in range(getattr(self.ranks, "group_size", self.size))]
        if len(out) > 1:
            dist.all_gather(out, mine)
        else:
            out = [mine]
        self.rounds += 1
        self.rows = [dict(zip(ROW, (int(v) for v in t.tolist()), strict=True)) for t in out]
        return self.rows

    def step(self) -> list[Any]:
        """One lockstep round; this rank's outputs (its failed ones naming a dead rank once one died)."""
        with self._lock:
            if self.stopped or self.down is not None:
                time.sleep(0.05)
                return []
            try:
                rows = self._round(False)
            except Exception as e:  # noqa: BLE001 (a broken collective: a rank died)
                self._broken(e)
                return []
            if any(r["stop"] for r in rows):
                self._stop_seen()
                return []
            if any(r["down"] for r in rows):
                self._engines_down(rows)
                return []
            if any(r["join"] for r in rows):  # rank 0 admits a restarted rank: every member re-forms
                self._reform(None)
                return []
            if not any(r["active"] for r in rows):
                time.sleep(IDLE_S)
                return []
            calls = self.moe.calls if self.moe is not None else 0
            try:
                outs = self.engine.step()
            except StepRetry as e:  # (elastic) the step's all-to-all broke: held by the engine, run again
                self._broken(e)
                return []
            ran = self.forwarded() if self.forwarded is not None else self.moe is None or self.moe.calls != calls
            if not ran:  # no forward ran here: this rank's share
                try:
                    if self.idle is not None:
                        self.idle()
                    else:
                        idle_forward(self.engine.model)
                    self.idle_forwards += 1
                except Exception as e:  # noqa: BLE001
                    self._broken(e)
                    return list(outs)
            if any(o.finished and o.error for o in outs):  # a failed model step: a rank died mid-collective?
                down = self.find_down()
                if down is not None:
                    outs = [
                        replace(o, error=f"{down} (its step failed: {o.error})")
                        if o.error and down not in o.error
                        else o
                        for o in outs
                    ]
            return list(outs)

    rerun_layer = False  # (elastic) a broken all-to-all re-forms the group and runs the layer again (a pipeline's
    # stage 0: its step cannot be held and run again, its later stages got the message already)

    def _guard(self, e: Exception) -> BaseException:
        if self.elastic and self.rerun_layer:
            self._reform(e)
            return EPReformed(str(e)) if self.down is None else RankDown(self.down)
        if self.elastic:
            return StepRetry(f"{type(e).__name__} in the EP all-to-all: the group re-forms")
        down = self.find_down()
        return RankDown(f"{down} ({type(e).__name__} in the EP all-to-all)") if down is not None else e

    def _reform(self, failure: BaseException | None) -> None:
        """(elastic) Re-form the group: after `failure` without the dead rank(s), else (a join round) with the
        restarted rank(s); then re-place the experts. A group that cannot re-form is the instance's death."""
        r = self.ranks
        assert isinstance(r, ElasticRanks)
        if failure is not None:
            log.warning(
                "dp rank %d: a collective failed (%s: %s): re-forming the group (%s)",
                self.rank,
                type(failure).__name__,
                failure,
                "the interrupted step runs again" if isinstance(failure, StepRetry) else "the round runs again",
            )
        try:
            if self.rank != 0:
                r.follow_reform()
            elif failure is None:
                r.lead_reform(admit=r.joiners())
            else:
                dead = r.wait_dead(DEATH_WAIT_S)
                if not dead:
                    raise RankDown(f"a collective failed ({type(failure).__name__}: {failure}) but no rank died")
                r.lead_reform(drop=sorted(dead))
            r.place(self.engine.model)
        except Exception as e:  # noqa: BLE001
            self._mark_down(f"DP rank down: the group of dp rank {self.rank} could not re-form: {e}")
            return
        self.reforms += 1
        self.rows = []

    def _broken(self, e: BaseException) -> None:
        if self.elastic:
            self._reform(e)
            return
        if self.find_down() is None:
            self._mark_down(f"DP rank down: a collective of dp rank {self.rank} failed: {type(e).__name__}: {e}")

    def _stop_seen(self) -> None:
        self.stopped = True
        if self.on_stop is not None:
            self.on_stop()

    def quiesce(self) -> None:
        """Rank 0, stopping: one last round with stop = 1 (every rank sees it and runs no more rounds)."""
        with self._lock:
            if self.stopped or self.down is not None or getattr(self.ranks, "group_size", self.size) == 1:
                return
            try:
                self._round(True)
            except Exception as e:  # noqa: BLE001
                self._broken(e)
            self.stopped = True

    def close(self) -> None:
        """Leave the group (rank 0: wait for the other ranks' exit; with a rank down: kill them, RankDown); first
        `on_close` (a pipeline's stage 0: its stages stop; then the group, even when that failed)."""
        try:
            if self.on_close is not None:
                self.on_close()
        finally:
            self._close_ranks()

    def _close_ranks(self) -> None:
        if isinstance(self.ranks, ElasticRanks):
            self.ranks.close(self.down)
            return
        if self.down is not None and self.ranks.down is None:
            for p in self.ranks.children:
                p.kill()
            raise RankDown(self.down)
        self.ranks.close()


def dp_rank_config(cfg: C, rank: int) -> C:
    """DP rank `rank`'s config (a DecodeConfig or PrefillConfig of an instance with DP attention): RPC on
    port + rank, its name with '.dp<rank>'."""
    c: Any = cfg
    if c.dp_size <= 1:
        return cfg
    name = f"{c.name}.dp{rank}" if c.name else None
    out: C = replace(c, port=c.port + rank if c.port else 0, name=name, dp_rank=rank)
    return out


def check_experts(model_dir: str | Path, dp_size: int) -> None:
    """ConfigError unless --ep-size (== --dp-size) divides the checkpoint's routed experts."""
    from dsakv.model.loader import load_config
    from dsakv.model.parallel import divide

    experts = int(load_config(Path(model_dir)).get("n_routed_experts") or 0)
    divide("n_routed_experts", experts, dp_size, "--ep-size")


def ep_model(model_dir: str | Path, dp_size: int, argv: Sequence[str], dtype: str) -> tuple[ElasticRanks, Any]:
    """(ranks, (spec, model)) of one DP rank: joins (rank 0: starts) the elastic group of `dp_size` ranks running
    `dsakv *argv` and loads the whole checkpoint with this rank's experts (model/parallel.attach_ep). A restarted
    rank then joins the running group at a round boundary (ElasticRanks.join, once its engine is built)."""
    from dsakv.engine.elastic import start_elastic
    from dsakv.model.loader import load_model
    from dsakv.model.parallel import attach_ep

    check_experts(model_dir, dp_size)
    ranks = start_elastic(dp_size, argv, label="DP")
    ranks.model_dir, ranks.dtype = str(model_dir), getattr(torch, dtype)
    try:
        spec, m = load_model(model_dir, dtype=ranks.dtype)
        return ranks, (spec, attach_ep(m, ranks.rank, ranks.size))
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise


def rank_rows(engine: Any, addrs: Sequence[str]) -> list[dict[str, Any]]:
    """The last round's rows with each rank's address (a health's per-rank view)."""
    return [{"rank": row["dp_rank"], "addr": addrs[row["dp_rank"]], **row} for row in getattr(engine, "rows", [])]


__all__ = ["ROW", "LockstepEngine", "check_experts", "dp_rank_config", "ep_model", "pid_gone", "rank_rows"]
