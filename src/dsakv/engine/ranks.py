"""Engine ranks as processes: the command a user starts is rank 0 of its tensor-parallel group and starts ranks
1..T-1 as copies of itself (same argv, DSAKV_TP_RANK / DSAKV_TP_PORT set), each a process of its own that dies
with rank 0. Every rank loads its shard (model/parallel.py), builds its own pool (the full keys: latent KV and
index-K are replicated) and runs the same engine on the same requests: the scheduler is deterministic and the
all-reduced hidden states are bitwise equal on every rank, so every rank samples the same tokens (a seed is
drawn once, on rank 0, and broadcast). `Ranks.agree` gathers a value from every rank so the lead can check
that they did. Nothing here assumes a device: the group's backend follows the model's device.

Liveness: rank 0 polls its rank processes (a watcher thread on the Popen objects, every POLL_S). A child that
dies before joining fails start-up at once with its exit status (the join runs in a thread while rank 0 watches);
once the group is up, a dead rank makes `Ranks.down` name it and its exit status, the next collective of
RankedEngine raises RankDown with that text instead of running (or, when the death breaks a collective in
flight, the collective's error is replaced by it), and the group's collectives are bounded by its timeout
(model/parallel.py COLLECTIVE_TIMEOUT_S), so no step waits for a dead rank for longer. The group is not re-formed:
the server reports the rank down (503) until it is restarted (the DP decode's group re-forms instead:
engine/elastic.py).
Imports torch.distributed, dsakv.util and dsakv.model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from signal import SIGKILL
from typing import Any, cast

import torch.distributed as dist

from dsakv.engine.tp_spec import agree_step
from dsakv.errors import ConfigError, Unavailable
from dsakv.model.parallel import TPGroup, init_group
from dsakv.util.procs import CHILD_ENV, TP_RANK_ENV, Proc, dsakv_cmd, free_ports

log = logging.getLogger(__name__)

PORT_ENV = "DSAKV_TP_PORT"
SIZE_ENV = "DSAKV_TP_SIZE"
ADDR = "127.0.0.1"
EXIT_TIMEOUT_S = 60.0
POLL_S = 0.1  # how often rank 0 polls its rank processes
IDLE_STEP_S = 0.25  # an idle rank 0 (nothing logged, nothing to run) broadcasts a step at most this often


class RanksDiverged(ConfigError):
    """Ranks of one TP group computed different results (a bug, never a user error: reported, not hidden)."""


class RankDown(Unavailable):
    """A rank of this TP group died: names it and its exit status; the group cannot run a step any more.
    `outputs`: the outputs of the step it broke, when the engine failed its requests itself."""

    outputs: Sequence[Any] = ()


def exit_text(rc: int) -> str:
    """'exited with status 3' or 'was killed by signal 9 (SIGKILL)'."""
    if rc >= 0:
        return f"exited with status {rc}"
    import signal

    try:
        name = f" ({signal.Signals(-rc).name})"
    except ValueError:
        name = ""
    return f"was killed by signal {-rc}{name}"


def dead_child(children: Sequence[Proc]) -> str | None:
    """'tp rank 1 (pid 123) was killed by signal 9 (SIGKILL)' for the first child that exited, else None."""
    for p in children:
        rc = p.poll()
        if rc is not None:
            return f"{p.name} (pid {p.pid}) {exit_text(rc)}"
    return None


class Ranks:
    """This process's place in its TP group; rank 0 also holds the processes of ranks 1..T-1 and watches them
    (`down`: the first dead rank and its exit status, None while every rank runs)."""

    def __init__(self, group: TPGroup, children: Sequence[Proc] = (), label: str = "TP") -> None:
        import threading

        self.group, self.children, self.label = group, list(children), label
        group.on_error = self.guard  # a model step's reduce broken by a dead rank raises RankDown naming it
        self._down: str | None = None
        self._closing = False
        self._stop = threading.Event()
        self._check_lock = threading.Lock()
        self._watchers: list[Any] = []
        if self.children:
            threading.Thread(target=self._watch, name="dsakv-rank-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.check() is not None:
                return

    def check(self) -> str | None:
        """Poll the rank processes now; the first death found is kept, logged and told to `on_down` callbacks."""
        with self._check_lock:
            if self._down is not None or self._closing:
                return self._down
            dead = dead_child(self.children)
            if dead is None:
                return None
            self._down = f"{self.label} rank down: {dead}"
        log.error("%s: every request in flight fails; restart the server to re-form the group", self._down)
        for fn in list(self._watchers):
            fn(self._down)
        return self._down

    @property
    def down(self) -> str | None:
        return self._down

    def on_down(self, fn: Any) -> None:
        """Call fn(message) (from the watcher thread) when a rank dies."""
        self._watchers.append(fn)
        if self._down is not None:
            fn(self._down)

    def guard(self, exc: BaseException) -> BaseException:
        """The error to raise for `exc` out of a collective: RankDown naming the dead rank when one died (a
        follower's death can take a moment to be seen after the collective broke: polled for up to 1 s)."""
        import time

        end = time.monotonic() + (1.0 if self.children else 0.0)
        while self.check() is None and time.monotonic() < end:
            time.sleep(POLL_S / 2)
        if self._down is not None:
            return RankDown(f"{self._down} ({type(exc).__name__} in the group's collective)")
        return exc

    @property
    def rank(self) -> int:
        return self.group.rank

    @property
    def size(self) -> int:
        return self.group.size

    @property
    def lead(self) -> bool:
        return self.group.lead

    def broadcast(self, value: Any) -> Any:
        """Rank 0's `value` on every rank."""
        if self.size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        """`value` of every rank, in rank order, on every rank."""
        if self.size == 1:
            return [value]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        return out

    def agree(self, value: Any, what: str) -> Any:
        """Gather `value` from every rank; raise RanksDiverged naming the first rank that differs from rank 0 (a
        dict: one gather, and the error names the first entry that differs, `what` + its key, and both values)."""
        if self.size == 1:
            return value
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        for r, v in enumerate(out):
            if v != out[0]:
                if isinstance(v, dict) and isinstance(out[0], dict):
                    k = next(k for k in {**out[0], **v} if v.get(k) != out[0].get(k))
                    what = f"{what}{k} {v.get(k)} (rank 0: {out[0].get(k)})"
                raise RanksDiverged(f"TP rank {r} computed other {what} than rank 0: the ranks diverged")
        return out[0]

    def close(self) -> None:
        """Leave the group; rank 0 waits (bounded) for the other ranks' exit and names one that failed. With a rank
        down, the survivors are killed (no collective with a dead rank) and the dead one is named."""
        self._stop.set()
        if self._down is not None:
            for p in self.children:
                p.kill()
            raise RankDown(self._down)
        self._closing = True
        if self.size > 1 and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        bad = []
        for p in self.children:
            try:
                rc: int | None = p.wait(EXIT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 (a rank that does not exit in time is killed and named)
                rc = p.kill()
            if rc != 0:
                bad.append(f"{p.name} exited {rc}")
        if bad:
            raise ConfigError(f"tensor-parallel ranks failed: {', '.join(bad)} (their errors are above)")
        if self.children:
            log.info("%s group stopped: %s exited 0", self.label, ", ".join(p.name for p in self.children))


def start_ranks(size: int, argv: Sequence[str], device: str = "cpu", label: str = "TP") -> Ranks:
    """Join (or, as rank 0, start and join) the TP group of `size` ranks running `dsakv *argv` (`label`: how the
    ranks are named, "TP" or "DP": 'dp rank 1 (pid N) ...')."""
    env_rank = os.environ.get(TP_RANK_ENV)
    if size == 1:
        if env_rank is not None:
            raise ConfigError(f"{TP_RANK_ENV}={env_rank} is set but --tp-size is 1: unset it")
        return Ranks(TPGroup(0, 1), label=label)
    children: list[Proc] = []
    if env_rank is None:
        port = free_ports(1)
        for r in range(1, size):
            env = {**os.environ, **CHILD_ENV, TP_RANK_ENV: str(r), PORT_ENV: str(port), SIZE_ENV: str(size)}
            # SIGKILL when rank 0 dies: a serving follower ignores SIGTERM (see follow)
            child = Proc(
                f"{label.lower()} rank {r}", dsakv_cmd(*argv), env=env, new_session=False, parent_death_signal=SIGKILL
            )
            children.append(child.start())
        rank = 0
    else:
        rank, port = int(env_rank), int(os.environ[PORT_ENV])
        if int(os.environ.get(SIZE_ENV, size)) != size:
            raise ConfigError(f"this rank was started for a TP group of {os.environ[SIZE_ENV]}, not --tp-size {size}")
    try:
        group = _join(rank, size, port, device, children)
    except BaseException:
        for p in children:
            p.kill()
        raise
    log.info("%s rank %d/%d joined on %s:%d", label, rank, size, ADDR, port)
    return Ranks(group, children, label)


def _join(rank: int, size: int, port: int, device: str, children: Sequence[Proc]) -> TPGroup:
    """init_group; on rank 0 in a thread while the children are polled: a child that dies first fails at once."""
    if not children:
        return init_group(rank, size, ADDR, port, device)
    import threading

    box: list[Any] = []

    def join() -> None:
        try:
            box.append(init_group(rank, size, ADDR, port, device))
        except BaseException as e:  # noqa: BLE001 (re-raised by the caller)
            box.append(e)

    t = threading.Thread(target=join, name="dsakv-rank-join", daemon=True)
    t.start()
    while t.is_alive():
        t.join(POLL_S)
        dead = dead_child(children)
        if dead is not None and t.is_alive():
            raise RankDown(f"{dead} before joining the TP group of {size} ranks (its error is above)")
    if isinstance(box[0], BaseException):
        raise box[0]
    return cast(TPGroup, box[0])


# ---- serving: rank 0 takes the requests, every rank runs every step ------------------------------------------

_STOP = "stop"


@dataclass(frozen=True)
class AddOp:
    """Rank 0 added request `rid` (its params carry the seed rank 0 drew); `kw`: add_request's keywords (a
    prefill's keep_pages)."""

    prompt: list[int]
    params: Any
    rid: str
    kw: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class PreallocOp:
    """A decode worker's rank 0 reserved `pages` for request `rid` (a follower must reserve the same ones)."""

    rid: str
    prompt: list[int]
    params: Any
    pages: list[int]


@dataclass(frozen=True)
class StartOp:
    """Rank 0 started decoding request `rid` (its KV landed): Engine.start_decode(rid, *args, **kw)."""

    rid: str
    args: tuple[Any, ...]
    kw: dict[str, Any]


@dataclass(frozen=True)
class AbortOp:
    rid: str


@dataclass(frozen=True)
class ReleaseOp:
    """Rank 0 released the pages a finished keep_pages request kept (a prefill: its KV was sent)."""

    rid: str


RankOp = AddOp | PreallocOp | StartOp | AbortOp | ReleaseOp  # one entry of a step's request log (pickled)


class RankedEngine:
    """Rank 0's engine in a served TP group: the Engine API (add_request, abort, step, everything else passed
    through), with each step's request log broadcast to ranks 1..T-1 before the step runs (`follow`).

    The log holds the adds (with the seed drawn here when a request gives none), aborts and, on a decode worker,
    the preallocs (with rank 0's page ids: a follower that reserves other pages stops, RanksDiverged) and
    start_decodes applied since the last step, in the order rank 0 applied them; one lock covers applying +
    logging and taking the log + stepping, so every rank starts every step from the same requests. An idle step
    (empty log, nothing to run) is skipped unless IDLE_STEP_S passed since the last one; the serving loop steps
    at least every 0.5 s while idle, which keeps the followers' receive inside the group's timeout."""

    def __init__(self, engine: Any, ranks: Ranks) -> None:
        import random
        import threading

        self.engine, self.ranks = engine, ranks
        self._log: list[RankOp] = []
        self._lock = threading.Lock()
        self._rng = random.Random(getattr(getattr(engine, "config", None), "seed", None))  # as Engine draws
        self._closed = False
        self._last = 0.0  # monotonic time of the last step broadcast
        self.after_step: Callable[[], None] | None = None  # every rank: called after each step (follow's after_step)
        self.busy: Callable[[], bool] | None = None  # True: step even when idle (the followers have work to report)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def _seeded(self, params: Any) -> Any:
        from dataclasses import replace

        from dsakv.engine.request import SamplingParams

        params = params or SamplingParams()
        return replace(params, seed=self._rng.getrandbits(63)) if params.seed is None else params

    def add_request(
        self, prompt_ids: Sequence[int], params: Any = None, request_id: str | None = None, **kw: Any
    ) -> str:
        params = self._seeded(params)
        with self._lock:
            rid = self.engine.add_request(prompt_ids, params, request_id=request_id, **kw)
            self._log.append(AddOp(list(prompt_ids), params, rid, dict(kw)))
        return str(rid)

    def release(self, request_id: str) -> Any:
        with self._lock:
            out = self.engine.release(request_id)
            self._log.append(ReleaseOp(request_id))
        return out

    def log(self, op: Any) -> None:
        """Append an op of the caller's own (a follow `apply` hook applies it on every other rank)."""
        with self._lock:
            self._log.append(op)

    def prealloc(
        self, request_id: str, prompt_ids: Sequence[int], params: Any = None, *, keep_room: bool = False
    ) -> Any:
        """Engine.prealloc on every rank (a decode worker: each rank's pool receives the request's KV); the
        admission rule (`keep_room`) is rank 0's, the followers replay what it admitted."""
        params = self._seeded(params)
        with self._lock:
            pages = self.engine.prealloc(request_id, prompt_ids, params, keep_room=keep_room)
            self._log.append(PreallocOp(request_id, list(prompt_ids), params, [int(p) for p in pages]))
        return pages

    def start_decode(self, request_id: str, *args: Any, **kw: Any) -> Any:
        with self._lock:
            out = self.engine.start_decode(request_id, *args, **kw)
            self._log.append(StartOp(request_id, args, kw))
        return out

    def abort(self, request_id: str) -> Any:
        with self._lock:
            out = self.engine.abort(request_id)
            self._log.append(AbortOp(request_id))
        return out

    def step(self) -> Any:
        """One step on every rank; RankDown (naming the rank and its exit status) once a rank died."""
        with self._lock:
            if self._closed:
                return []
            if self.ranks.down is not None:
                raise RankDown(self.ranks.down)
            sch = self.engine.scheduler
            idle = not (sch.running or sch.ready or sch.waiting or getattr(self.engine, "_pending", 1))
            if not self._log and idle and not (self.busy is not None and self.busy()):
                if time.monotonic() - self._last < IDLE_STEP_S:
                    return []
            self._last = time.monotonic()
            log_, self._log = self._log, []
            try:
                self.ranks.broadcast(log_)
                outs = self.engine.step()
                agree_step(self.engine, self.ranks)
                if self.after_step is not None:
                    self.after_step()
            except Exception as e:
                raise self.ranks.guard(e) from e
            # the engine fails a step's requests itself when its model step raised (a collective with a dead rank
            # among the causes): then RankDown, so that every request in flight gets the rank's name, not gloo's
            bad = next((o.error for o in outs if o.finished and o.finish_reason == "error"), None)
            if bad is not None and isinstance(self.ranks.guard(RuntimeError(bad)), RankDown):
                down = RankDown(f"{self.ranks.down} (its step failed: {bad})")
                down.outputs = outs  # a decode worker reports them (disagg/decode/ranks.py)
                raise down
            return outs

    def close(self) -> None:
        """Tell the followers to stop, leave the group, wait for their exit (with a rank down: kill the others)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self.ranks.down is None:
                self.ranks.broadcast(_STOP)
        self.ranks.close()


def follow(
    engine: Any,
    ranks: Ranks,
    apply: Callable[[Any], None] | None = None,
    after_step: Callable[[Any], None] | None = None,
) -> int:
    """A follower rank of a served TP group: apply rank 0's log, run the step, until rank 0 says stop. The stop
    signals of the server's process group (SIGTERM, Ctrl-C) are rank 0's to handle: it stops the loop, then tells
    this rank to stop; dying first would be a rank down at every clean stop (rank 0's death kills it: SIGKILL).
    `apply`: applies the ops rank 0 logged with RankedEngine.log; `after_step(outputs)` runs after each step (the
    same collectives as rank 0's RankedEngine.after_step)."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    while True:
        log_ = ranks.broadcast(None)
        if log_ == _STOP:
            ranks.close()
            return 0
        for op in log_:
            if isinstance(op, PreallocOp):
                got = [int(p) for p in engine.prealloc(op.rid, op.prompt, op.params)]
                if got != op.pages:
                    raise RanksDiverged(
                        f"TP rank {ranks.rank} reserved pages {got[:8]} for request {op.rid}, rank 0 {op.pages[:8]}: "
                        "the ranks diverged (the prefill wrote rank 0's pages into every rank's pool)"
                    )
            elif isinstance(op, AddOp):
                engine.add_request(op.prompt, op.params, request_id=op.rid, **op.kw)
            elif isinstance(op, StartOp):
                engine.start_decode(op.rid, *op.args, **op.kw)
            elif isinstance(op, AbortOp):
                engine.abort(op.rid)
            elif isinstance(op, ReleaseOp):
                engine.release(op.rid)
            elif apply is not None:
                apply(op)
            else:
                raise RanksDiverged(f"TP rank {ranks.rank} got an op it cannot apply: {type(op).__name__}")
        outs = engine.step()
        agree_step(engine, ranks)
        if after_step is not None:
            after_step(outs)
