"""The relay of a tensor-parallel stage s > 0 of a re-forming pipeline (the prefill grid, disagg/prefill/grid.py, and
the decode grid, disagg/decode/grid.py): stage s's rank 0 is in the pipeline's StageGroup, its ranks 1..T-1 are not.

    rank 0 (RelayGroup):    every message it receives from stage s-1 (steps and ticks), a beat per formation try
                            and a break when the pipeline broke is one *round*: broadcast (kind, ops, message) over
                            the stage's TP group, then gather one value from every rank (`gathered`: a prefill's
                            transfer parts; a decode's nothing); `relay(op)` queues an op every other rank applies
                            before the round's message (a prefill's decode links)
    rank r > 0 (RelayMember): receives the rounds (`recv_prev` returns the next message; a break calls `on_break`,
                            a stop raises Stopped), sends nothing (rank 0 sends on: the hidden states are equal on
                            every rank after the stage's all-reduce)

Beats keep the members' receive inside the TP group's collective timeout while the pipeline re-forms. A dead rank
(the round's collective breaks, or the ranks' watcher saw it): rank 0 names it (Ranks.guard -> RankDown), leaves
that text in stage 0's rendezvous store (note_down: stage 0 names it), breaks the pipeline and never rejoins.
The colocated pipeline's TP stages (pipeline/tp_stage.py) never re-form: they broadcast the message alone.
Imports dsakv.engine.ranks and the pipeline's stage_comm.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from dsakv.engine.ranks import RankDown, Ranks
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError, StageMessage

log = logging.getLogger(__name__)

MSG, BEAT, BREAK, STOP = "msg", "beat", "break", "stop"  # what one round broadcasts
GONE_WAIT_S = 0.5  # a stage with a dead rank does not rejoin: its loop waits this long per turn


class RelayGroup(StageGroup):
    """Rank 0 of TP stage s > 0: the pipeline's StageGroup, each message received (and a beat per formation try, a
    break when the pipeline broke) broadcast to the stage's other ranks, one value gathered from each."""

    ranks: Ranks | None = None
    gone: str | None = None  # a rank died: this stage never rejoins

    def bind(self, ranks: Ranks) -> None:
        self.ranks = ranks
        self._ops: list[Any] = []
        self._ops_lock = threading.Lock()

    def relay(self, op: Any) -> None:
        """An op every other rank applies before the next message (RelayMember.apply)."""
        with self._ops_lock:
            self._ops.append(op)

    def gathered(self, got: Sequence[Any]) -> None:
        """What ranks 1..T-1 gave the round (RelayMember.report), in rank order."""

    def left(self, why: str) -> None:
        """A rank died (`why` names it): the stage left the pipeline for good."""

    def _round(self, kind: str, msg: StageMessage | None) -> None:
        ranks = self.ranks
        assert ranks is not None, "RelayGroup.bind names the stage's ranks before the first round"
        with self._ops_lock:
            ops, self._ops = self._ops, []
        try:
            if ranks.down is not None:
                raise RankDown(ranks.down)
            ranks.broadcast((kind, ops, msg))
            got = ranks.gather(None)
        except Exception as e:  # noqa: BLE001 (a dead rank: RankDown naming it; the stage leaves the pipeline)
            err = ranks.guard(e)
            if not isinstance(err, RankDown):
                raise
            self.leave(str(err))
            raise err from e
        self.gathered(got[1:])

    def leave(self, why: str) -> None:
        """A rank died: tell stage 0 why (its rendezvous store) and leave the pipeline for good."""
        if self.gone is not None:
            return
        self.gone = why
        self.left(why)
        self.note_down(why)
        super().break_(why)

    def beat(self) -> None:
        self._round(BEAT, None)

    def recv_prev(self, timeout: float | None = None) -> StageMessage:
        if self.gone is not None:
            raise RankDown(self.gone)
        msg = super().recv_prev(timeout)
        self._round(MSG, msg)
        return msg

    def form(self, info: dict[str, Any]) -> bool:
        if self.gone is not None:
            time.sleep(GONE_WAIT_S)
            return False
        self._round(BEAT, None)
        return super().form(info)

    def break_(self, why: str) -> None:
        super().break_(why)
        if self.gone is None and self.ranks is not None:
            try:
                self._round(BREAK, None)  # the other ranks forget what this stage held
            except Exception as e:  # noqa: BLE001 (RankDown: _round left the pipeline already)
                log.warning("stage %d: telling the TP ranks the pipeline broke: %s", self.rank, e)

    def stop_ranks(self) -> None:
        """Tell the other ranks to stop and wait for them (a rank down: the rest are killed, the dead one named)."""
        if self.ranks is None:
            return
        if self.gone is None and self.ranks.down is None:
            try:
                self.ranks.broadcast((STOP, [], None))
            except Exception as e:  # noqa: BLE001
                log.warning("stage %d: stopping the TP ranks: %s", self.rank, e)
        try:
            self.ranks.close()
        except Exception as e:  # noqa: BLE001 (a stop never raises: the rank's error is logged)
            log.warning("stage %d: closing the TP group: %s", self.rank, e)


class Stopped(Exception):
    """Rank 0 of the stage said stop."""


class RelayMember(StageGroup):
    """Rank r > 0 of TP stage s > 0: receives the rounds rank 0 broadcasts, sends nothing (rank 0 sends on).
    Hooks: apply(ops) before each round's message, report() the value gathered after it, on_break() on a break."""

    def __init__(self, rank: int, size: int, ranks: Ranks, hidden_dtype: torch.dtype) -> None:
        super().__init__(rank, size, "127.0.0.1", 0, hidden_dtype=hidden_dtype)
        self.ranks = ranks

    def apply(self, ops: Sequence[Any]) -> None:
        """Ops rank 0 relayed (RelayGroup.relay)."""

    def report(self) -> Any:
        """This rank's value for the round's gather."""
        return None

    def on_break(self) -> None:
        """The pipeline broke: stage 0 failed what it held."""

    @property
    def formed(self) -> bool:
        return True

    def form(self, info: dict[str, Any]) -> bool:
        return True

    def recv_prev(self, timeout: float | None = None) -> StageMessage:
        while True:
            kind, ops, msg = self.ranks.broadcast(None)
            self.apply(ops)
            if kind == STOP:
                raise Stopped()
            self.ranks.gather(self.report())
            if kind == MSG:
                return msg  # type: ignore[no-any-return]
            if kind == BREAK:
                self.on_break()

    def send_next(self, msg: StageMessage) -> None:
        """Rank 0 of the stage sends the step on."""

    def send_to(self, dst: int, msg: StageMessage) -> None:
        """Rank 0 of the stage sends the step on."""

    def break_(self, why: str) -> None:
        raise StageLinkError(f"stage {self.rank} TP rank {self.ranks.rank}: {why}")

    def close(self) -> None:
        """Nothing to leave: this rank is not in the pipeline's group."""


__all__ = ["BEAT", "BREAK", "GONE_WAIT_S", "MSG", "STOP", "RelayGroup", "RelayMember", "Stopped"]
