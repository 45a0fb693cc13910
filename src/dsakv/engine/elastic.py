"""Elastic expert parallelism for the DP-attention decode and prefill: the group of DP ranks re-forms when one dies
and when it comes back, the experts re-placed over the ranks that are up.

    start_elastic(D, argv)   rank 0 (the command) keeps a TCPStore (DSAKV_TP_PORT) and starts ranks 1..D-1; every
                             generation g of the group is a torch.distributed group (gloo; nccl for CUDA) over the
                             store prefix 'g<g>/' of the ranks up then ('g<g>/members': their DP ranks, and why)
    a rank dies              every survivor's next collective fails (gloo: its sockets close; else the group's
                             timeout bounds it): rank 0 names the dead rank from its exit status and writes
                             generation g+1 without it; each survivor destroys the broken group and joins g+1; the
                             step the failure interrupted runs again (engine StepRetry: same rows, nothing lost)
    experts                  `ep_owners`: each expert on its home rank while it is up, a dead rank's experts round
                             robin over the survivors, loaded from the checkpoint's safetensors (model/loader.py
                             load_experts) and dropped again when their home rank is back. Loaded, not kept: a rank
                             holds only the experts it runs, so the planner's per-rank weights stay true while all
                             ranks are up (after a death a survivor holds up to ceil(E/D / survivors) more per MoE
                             layer, the figure `dsakv plan` prints as the re-form headroom)
    rejoin                   rank 0 restarts a dead rank itself (a supervisor's job: the operator runs one command
                             per instance), after RESPAWN_BACKOFF_S waits, at most len(RESPAWN_BACKOFF_S) times in a
                             row (a rank up for STABLE_S starts the count afresh); the new process loads the model
                             (its home experts), sets 'join/<r>' and waits; rank 0 sees it at the next round boundary
                             (the round's `join` column), every member joins generation g+1 with it, the original
                             placement back
    rank 0 dies              the instance is down: its ranks die with it (SIGKILL), restart the command

Imports torch.distributed, dsakv.util and dsakv.model; nothing assumes a device.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from signal import SIGKILL
from typing import Any

import torch
import torch.distributed as dist

from dsakv.engine.ranks import ADDR, POLL_S, PORT_ENV, SIZE_ENV, RankDown, exit_text
from dsakv.errors import ConfigError
from dsakv.model.parallel import INIT_TIMEOUT_S, EPMoE, ep_owners
from dsakv.util.procs import CHILD_ENV, TP_RANK_ENV, Proc, dsakv_cmd, free_ports

log = logging.getLogger(__name__)

JOIN_ENV = "DSAKV_DP_JOIN"  # set in a rank rank 0 restarted: join the running group at a round boundary
RESPAWN_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0)  # rank 0 restarts a dead rank after these waits, then gives up
STABLE_S = 300.0  # a rank up this long has its restart count reset
MEMBERS_WAIT_S = 60.0  # a survivor waits this long for rank 0's next generation (rank 0 dead: SIGKILL meanwhile)
ADMIT_WAIT_S = 600.0  # a restarted rank waits this long to be admitted
EXIT_TIMEOUT_S = 60.0


class ElasticRanks:
    """This process's place in its elastic DP/EP group: `rank` its DP rank (fixed), `size` the instance's D,
    `members` the DP ranks of the current generation `gen` (`index`: this rank's place in it). Rank 0 also holds
    the rank processes, watches them (`dead`: DP rank -> why, while out of the group) and restarts them."""

    def __init__(self, rank: int, size: int, store: Any, argv: Sequence[str], label: str, device: str) -> None:
        self.rank, self.size, self.store = rank, size, store
        self.argv, self.label, self.device = list(argv), label, device
        self.gen, self.members = -1, list(range(size))
        self.procs: dict[int, Proc] = {}
        self.dead: dict[int, str] = {}
        self.restarts: dict[int, int] = {}  # DP rank -> restarts in a row (rank 0)
        self._next_try: dict[int, float] = {}
        self._joining: set[int] = set()  # restarted, not yet admitted (rank 0)
        self._seen: dict[int, int] = {}  # DP rank -> the pid whose exit was recorded (rank 0)
        self.model_dir: str | None = None  # where a re-placement loads its guest experts from
        self.dtype = torch.float32
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closing = False  # close() began: no more restarts
        self.on_dead: Callable[[int, str], None] | None = None  # rank 0: told each death (DP rank, why) once
        self.respawn = True  # rank 0 restarts a dead rank (off: it stays out, 'not restarted', prefill/dp_pp.py)

    # ---- the Ranks interface LockstepEngine uses --------------------------------------------------------------

    lead = property(lambda self: self.rank == 0)
    down = None  # one rank's death is not the instance's: LockstepEngine decides when the group cannot re-form

    @property
    def children(self) -> list[Proc]:
        return list(self.procs.values())

    @property
    def index(self) -> int:
        return self.members.index(self.rank)

    @property
    def group_size(self) -> int:
        return len(self.members)

    def on_down(self, fn: Callable[[str], None]) -> None:
        """(Ranks') a dead rank is re-formed around, never reported as the instance's death."""

    def gather(self, value: Any) -> list[Any]:
        """`value` of every member, in member order."""
        if self.group_size == 1:
            return [value]
        out: list[Any] = [None] * self.group_size
        dist.all_gather_object(out, value)
        return out

    # ---- generations ------------------------------------------------------------------------------------------

    def _init(self, gen: int, members: list[int]) -> None:
        self.gen, self.members = gen, list(members)
        if len(members) > 1:
            backend = "nccl" if torch.device(self.device).type == "cuda" else "gloo"
            dist.init_process_group(
                backend,
                store=dist.PrefixStore(f"g{gen}/", self.store),
                rank=members.index(self.rank),
                world_size=len(members),
                timeout=_dt.timedelta(seconds=INIT_TIMEOUT_S),
            )
        log.info("%s rank %d joined generation %d of its group: ranks %s", self.label, self.rank, gen, members)

    def _leave(self) -> None:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001 (a broken group: its sockets are gone either way)
                log.warning("%s rank %d: leaving generation %d: %s", self.label, self.rank, self.gen, e)

    def _wait_key(self, key: str, wait: float, what: str) -> str:
        end = time.monotonic() + wait
        while not self.store.check([key]):
            if time.monotonic() >= end or self._stop.is_set():
                raise RankDown(f"{self.label} rank {self.rank}: {what} did not come within {wait:g} s")
            time.sleep(0.05)
        return bytes(self.store.get(key)).decode()

    def lead_reform(self, drop: Sequence[int] = (), admit: Sequence[int] = ()) -> list[int]:
        """Rank 0: generation gen+1 = the members less `drop` plus `admit`; joins it (the others join it too)."""
        new = sorted((set(self.members) - set(drop)) | set(admit))
        gen = self.gen + 1
        why = {str(r): self.dead.get(r, "") for r in drop}
        self.store.set(f"g{gen}/members", json.dumps({"members": new, "dead": why}))
        for r in admit:
            self.store.set(f"admit/{r}", str(gen))
            with self._lock:
                self._joining.discard(r)
                self.dead.pop(r, None)
        self._leave()
        self._init(gen, new)
        return new

    def follow_reform(self) -> list[int]:
        """A member r > 0: join the generation rank 0 writes next (RankDown if it does not, or drops this rank)."""
        rec = json.loads(self._wait_key(f"g{self.gen + 1}/members", MEMBERS_WAIT_S, f"generation {self.gen + 1}"))
        with self._lock:
            self.dead.update({int(r): why for r, why in rec["dead"].items()})
            for r in rec["members"]:
                self.dead.pop(r, None)
        if self.rank not in rec["members"]:
            raise RankDown(f"{self.label} rank {self.rank}: rank 0 re-formed the group without it")
        self._leave()
        self._init(self.gen + 1, rec["members"])
        return list(rec["members"])

    def join(self) -> None:
        """A restarted rank: announce itself, wait to be admitted at a round boundary, join that generation."""
        self.store.set(f"join/{self.rank}", str(os.getpid()))
        gen = int(self._wait_key(f"admit/{self.rank}", ADMIT_WAIT_S, "admission to the group"))
        rec = json.loads(bytes(self.store.get(f"g{gen}/members")).decode())
        self._init(gen, rec["members"])

    # ---- rank 0: liveness and restarts --------------------------------------------------------------------------

    def poll_dead(self) -> dict[int, str]:
        """Rank 0: the members (and restarted ranks not yet admitted) whose process exited, named with the
        exit status ('dp rank 1 (pid N) was killed by signal 9 (SIGKILL)'); restarts are scheduled."""
        now = time.monotonic()
        found = {}
        with self._lock:
            for r, p in self.procs.items():
                rc = p.poll()
                if rc is None:
                    if now - p.started_at >= STABLE_S and r in self.members:
                        self.restarts[r] = 0
                    continue
                if self._seen.get(r) == p.pid or (r not in self.members and r not in self._joining):
                    continue
                self._seen[r] = p.pid
                why = f"{p.name} (pid {p.pid}) {exit_text(rc)}" + self._left_why(r)
                self._joining.discard(r)
                n = self.restarts.get(r, 0)
                if not self.respawn:
                    why += ": not restarted (restart the instance)"
                elif n < len(RESPAWN_BACKOFF_S):
                    self._next_try[r] = now + RESPAWN_BACKOFF_S[n]
                else:
                    why += f" after {n} restarts in a row: not restarted again (restart the instance)"
                self.dead[r] = why
                found[r] = why
        for r, why in found.items():
            log.error("%s rank down: %s: its requests fail; the group re-forms over the others", self.label, why)
            if self.on_dead is not None:
                self.on_dead(r, why)
        return {r: self.dead[r] for r in self.members if r in self.dead}

    def note_left(self, why: str) -> None:
        """A rank about to exit on its own (a DP x PP cell whose pipeline broke): `why` in the store, so rank 0's
        row of it names the cause with the exit status (poll_dead; the cause is what the user needs: a later stage
        killed, not stage 0's exit 3). Best effort: rank 0 gone, nobody reads it."""
        try:
            self.store.set(f"left/{self.rank}", why)
        except Exception as e:  # noqa: BLE001 (rank 0's store is gone: the instance is down anyway)
            log.warning("%s rank %d: could not note why it leaves (%s): %s", self.label, self.rank, why, e)

    def _left_why(self, r: int) -> str:
        """': it left: <why>' when rank r noted why it left (note_left), else ''."""
        key = f"left/{r}"
        try:
            if not self.store.check([key]):
                return ""
            why = bytes(self.store.get(key)).decode(errors="replace")
            self.store.delete_key(key)
        except Exception:  # noqa: BLE001 (the store answers rank 0 itself; a hiccup loses only the cause)
            return ""
        return f": it left: {why}"

    def wait_dead(self, wait: float) -> dict[int, str]:
        """Rank 0 after a failed collective: the dead members, polled for up to `wait` s (sockets close first)."""
        end = time.monotonic() + wait
        while True:
            dead = self.poll_dead()
            if dead or time.monotonic() >= end:
                return dead
            time.sleep(0.05)

    def joiners(self) -> list[int]:
        """Rank 0: restarted ranks that loaded their model and wait to be admitted (their 'join/<r>' is set)."""
        with self._lock:
            pending = [r for r in sorted(self._joining) if self.procs[r].alive()]
        return [r for r in pending if self.store.check([f"join/{r}"])]

    def _restart_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._closing:
                return
            due = [r for r, t in self._next_try.items() if now >= t and r not in self.members]
            for r in due:
                del self._next_try[r]
                self.restarts[r] = self.restarts.get(r, 0) + 1
                for key in (f"join/{r}", f"admit/{r}", f"left/{r}"):
                    self.store.delete_key(key)
                self._joining.add(r)
        for r in due:
            self.procs[r].start()
            log.warning(
                "%s rank %d restarted (pid %d, try %d of %d): it joins the group once loaded",
                self.label,
                r,
                self.procs[r].pid,
                self.restarts[r],
                len(RESPAWN_BACKOFF_S),
            )

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            try:
                if self._closing:  # the ranks exit now: not a death (nor a restart)
                    continue
                self.poll_dead()
                self._restart_due()
            except Exception:  # noqa: BLE001 (the watcher must survive a store hiccup)
                log.exception("%s rank watcher", self.label)

    def down_ranks(self) -> dict[int, str]:
        """The DP ranks out of the group now (dead, restarting, or given up) and why."""
        with self._lock:
            return dict(self.dead)

    # ---- experts ------------------------------------------------------------------------------------------------

    def place(self, model: Any) -> None:
        """Re-place every EPMoE layer's experts over the current members (ep_owners): guests this rank now runs
        are loaded from the checkpoint (those it ran already are kept), the others dropped."""
        from dsakv.model.dsa_model import DecoderLayer
        from dsakv.model.loader import load_experts

        layers = [(i, m.mlp) for i, m in enumerate(model.model.layers) if isinstance(m, DecoderLayer)]
        moes = [(i, m) for i, m in layers if isinstance(m, EPMoE)]
        if not moes:
            return
        owners = ep_owners(len(moes[0][1].owner), self.size, self.members)
        mine = [e for e, o in enumerate(owners) if o == self.rank]
        want = {i: [e for e in mine if not 0 <= e - m.first < m.per and e not in m.guests] for i, m in moes}
        want = {i: ids for i, ids in want.items() if ids}
        if want and self.model_dir is None:
            raise ConfigError(f"{self.label} rank {self.rank}: no checkpoint to load experts {sorted(mine)} from")
        got = load_experts(self.model_dir or "", want, dtype=self.dtype) if want else {}
        index = [self.members.index(o) for o in owners]
        for i, m in moes:
            guests = {e: got[(i, e)] if (i, e) in got else m.guests[e] for e in mine if not 0 <= e - m.first < m.per}
            m.place(index, self.index, self.group_size, guests)
        extra = sorted(e for e in mine if not 0 <= e - moes[0][1].first < moes[0][1].per)
        log.info(
            "%s rank %d runs experts %s of each MoE layer (%s loaded from the checkpoint)",
            self.label,
            self.rank,
            mine,
            f"guests {extra}" if extra else "no guests",
        )

    # ---- stop ---------------------------------------------------------------------------------------------------

    def close(self, fatal: str | None = None) -> None:
        """Leave the group; rank 0 waits (bounded) for the members' exit, kills a rank not yet admitted, names a
        member that failed. With the instance down (`fatal`), the others are killed and RankDown raised."""
        with self._lock:
            self._closing = True
        if fatal is not None:
            self._stop.set()
            for p in self.children:
                p.kill()
            raise RankDown(fatal)
        if self.group_size > 1 and dist.is_initialized():
            dist.barrier()
        self._leave()
        bad = []
        with self._lock:
            members = [r for r in self.procs if r in self.members]
            others = [r for r in self.procs if r not in self.members]
        for r in others:
            self.procs[r].kill()
        for r in members:
            p = self.procs[r]
            try:
                rc: int | None = p.wait(EXIT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 (a rank that does not exit in time is killed and named)
                rc = p.kill()
            if rc != 0:
                bad.append(f"{p.name} exited {rc}")
        self._stop.set()  # after the waits: a restarted rank was started by the watcher thread (its death signal)
        if bad:
            raise ConfigError(f"DP ranks failed: {', '.join(bad)} (their errors are above)")
        if members:
            log.info("%s group stopped: %s exited 0", self.label, ", ".join(self.procs[r].name for r in members))


def start_elastic(size: int, argv: Sequence[str], device: str = "cpu", label: str = "DP") -> ElasticRanks:
    """Join (or, as rank 0, start and join) generation 0 of an elastic group of `size` DP ranks running
    `dsakv *argv`; a restarted rank (JOIN_ENV) only connects to the store: it joins later (ElasticRanks.join)."""
    env_rank = os.environ.get(TP_RANK_ENV)
    timeout = _dt.timedelta(seconds=INIT_TIMEOUT_S)
    if env_rank is None:
        port = free_ports(1)
        store = dist.TCPStore(ADDR, port, is_master=True, wait_for_workers=False, timeout=timeout)
        ranks = ElasticRanks(0, size, store, argv, label, device)
        store.set("g0/members", json.dumps({"members": ranks.members, "dead": {}}))
        for r in range(1, size):
            env = {**os.environ, **CHILD_ENV, TP_RANK_ENV: str(r), PORT_ENV: str(port), SIZE_ENV: str(size)}
            # SIGKILL when rank 0 dies (a serving follower ignores SIGTERM)
            proc = Proc(
                f"{label.lower()} rank {r}", dsakv_cmd(*argv), env=env, new_session=False, parent_death_signal=SIGKILL
            )
            ranks.procs[r] = proc.start()
            proc.env[JOIN_ENV] = "1"  # its restarts join the running group
    else:
        rank, port = int(env_rank), int(os.environ[PORT_ENV])
        if int(os.environ.get(SIZE_ENV, size)) != size:
            raise ConfigError(f"this rank was started for a DP group of {os.environ[SIZE_ENV]}, not --dp-size {size}")
        store = dist.TCPStore(ADDR, port, is_master=False, timeout=timeout)
        ranks = ElasticRanks(rank, size, store, argv, label, device)
        if os.environ.get(JOIN_ENV):
            return ranks
    try:
        _join0(ranks)
    except BaseException:
        for p in ranks.children:
            p.kill()
        raise
    if ranks.procs:
        threading.Thread(target=ranks._watch, name="dsakv-dp-watch", daemon=True).start()
    return ranks


def _join0(ranks: ElasticRanks) -> None:
    """Generation 0; rank 0 joins in a thread while it polls its children (one that dies first fails at once)."""
    if not ranks.procs:
        ranks._init(0, list(range(ranks.size)))
        return
    box: list[BaseException | None] = []

    def join() -> None:
        try:
            ranks._init(0, list(range(ranks.size)))
            box.append(None)
        except BaseException as e:  # noqa: BLE001 (re-raised below)
            box.append(e)

    t = threading.Thread(target=join, name="dsakv-rank-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(POLL_S)
        for p in ranks.children:
            rc = p.poll()
            if rc is not None and t.is_alive():
                raise RankDown(
                    f"{p.name} (pid {p.pid}) {exit_text(rc)} before joining the DP group (its error is above)"
                )
    if box[0] is not None:
        raise box[0]


__all__ = ["JOIN_ENV", "RESPAWN_BACKOFF_S", "ElasticRanks", "start_elastic"]
