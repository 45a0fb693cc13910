"""Engine ranks as processes: the command a user starts is rank 0 of its tensor-parallel group and starts ranks
1..T-1 as copies of itself (same argv, DSAKV_TP_RANK / DSAKV_TP_PORT set), each a process of its own that dies
with rank 0. Every rank loads its shard (model/parallel.py), builds its own pool (the full keys: latent KV and
index-K are replicated) and runs the same engine on the same requests: the scheduler is deterministic and the
all-reduced hidden states are bitwise equal on every rank, so every rank samples the same tokens (a seed is
drawn once, on rank 0, and broadcast). `Ranks.agree` gathers a value from every rank so the lead can check
that they did. Nothing here assumes a device: the group's backend follows the model's device.
Imports torch.distributed, dsakv.util and dsakv.model.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from dsakv.errors import ConfigError
from dsakv.model.parallel import TPGroup, init_group
from dsakv.util.procs import CHILD_ENV, Proc, dsakv_cmd, free_ports

log = logging.getLogger(__name__)

RANK_ENV = "DSAKV_TP_RANK"
PORT_ENV = "DSAKV_TP_PORT"
SIZE_ENV = "DSAKV_TP_SIZE"
ADDR = "127.0.0.1"
EXIT_TIMEOUT_S = 60.0


class RanksDiverged(ConfigError):
    """Ranks of one TP group computed different results (a bug, never a user error: reported, not hidden)."""


class Ranks:
    """This process's place in its TP group; rank 0 also holds the processes of ranks 1..T-1."""

    def __init__(self, group: TPGroup, children: Sequence[Proc] = ()) -> None:
        self.group, self.children = group, list(children)

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
        """Gather `value` from every rank; raise RanksDiverged naming the first rank that differs from rank 0."""
        if self.size == 1:
            return value
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, value)
        for r, v in enumerate(out):
            if v != out[0]:
                raise RanksDiverged(f"TP rank {r} computed other {what} than rank 0: the ranks diverged")
        return out[0]

    def close(self) -> None:
        """Leave the group; rank 0 waits (bounded) for the other ranks' exit and names one that failed."""
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


def start_ranks(size: int, argv: Sequence[str], device: str = "cpu") -> Ranks:
    """Join (or, as rank 0, start and join) the TP group of `size` ranks running `dsakv *argv`."""
    env_rank = os.environ.get(RANK_ENV)
    if size == 1:
        if env_rank is not None:
            raise ConfigError(f"{RANK_ENV}={env_rank} is set but --tp-size is 1: unset it")
        return Ranks(TPGroup(0, 1))
    children: list[Proc] = []
    if env_rank is None:
        port = free_ports(1)
        for r in range(1, size):
            env = {**os.environ, **CHILD_ENV, RANK_ENV: str(r), PORT_ENV: str(port), SIZE_ENV: str(size)}
            children.append(Proc(f"tp rank {r}", dsakv_cmd(*argv), env=env, new_session=False).start())
        rank = 0
    else:
        rank, port = int(env_rank), int(os.environ[PORT_ENV])
        if int(os.environ.get(SIZE_ENV, size)) != size:
            raise ConfigError(f"this rank was started for a TP group of {os.environ[SIZE_ENV]}, not --tp-size {size}")
    try:
        group = init_group(rank, size, ADDR, port, device)
    except Exception:
        for p in children:
            p.kill()
        raise
    log.info("TP rank %d/%d joined on %s:%d", rank, size, ADDR, port)
    return Ranks(group, children)


# ---- serving: rank 0 takes the requests, every rank runs every step ------------------------------------------

_STOP = "stop"


class RankedEngine:
    """Rank 0's engine in a served TP group: the Engine API (add_request, abort, step, everything else passed
    through), with each step's request log broadcast to ranks 1..T-1 before the step runs (`follow`).

    The log holds the adds (with the seed drawn here when a request gives none) and aborts applied since the last
    step, in the order rank 0 applied them; one lock covers applying + logging and taking the log + stepping, so
    every rank starts every step from the same requests. The serving loop steps at least every 0.5 s while idle,
    which keeps the followers' receive inside the group's timeout."""

    def __init__(self, engine: Any, ranks: Ranks) -> None:
        import random
        import threading

        self.engine, self.ranks = engine, ranks
        self._log: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._rng = random.Random(getattr(getattr(engine, "config", None), "seed", None))  # as Engine draws
        self._closed = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, prompt_ids: Sequence[int], params: Any = None, request_id: str | None = None) -> str:
        from dataclasses import replace

        from dsakv.engine.request import SamplingParams

        params = params or SamplingParams()
        if params.seed is None:
            params = replace(params, seed=self._rng.getrandbits(63))
        with self._lock:
            rid = self.engine.add_request(prompt_ids, params, request_id=request_id)
            self._log.append(("add", list(prompt_ids), params, rid))
        return str(rid)

    def abort(self, request_id: str) -> Any:
        with self._lock:
            out = self.engine.abort(request_id)
            self._log.append(("abort", request_id))
        return out

    def step(self) -> Any:
        with self._lock:
            if self._closed:
                return []
            log_, self._log = self._log, []
            self.ranks.broadcast(log_)
            return self.engine.step()

    def close(self) -> None:
        """Tell the followers to stop, leave the group, wait for their exit."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.ranks.broadcast(_STOP)
        self.ranks.close()


def follow(engine: Any, ranks: Ranks) -> int:
    """A follower rank of a served TP group: apply rank 0's log, run the step, until rank 0 says stop."""
    while True:
        log_ = ranks.broadcast(None)
        if log_ == _STOP:
            ranks.close()
            return 0
        for entry in log_:
            if entry[0] == "add":
                _, prompt, params, rid = entry
                engine.add_request(prompt, params, request_id=rid)
            else:
                engine.abort(entry[1])
        engine.step()
