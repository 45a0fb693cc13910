"""TP stages of the colocated pipeline (`dsakv generate` / `serve --pp-size P --tp-size T`): the rank grid (stage s,
TP rank r), the design of the prefill's grid (disagg/prefill/grid.py) without its transfer parts.

Each stage process is rank 0 of its stage's TP group and starts ranks 1..T-1 (engine/ranks.start_ranks: the
stage's own torch.distributed group on its own port); every rank loads its shard (model/parallel.load_tp_model),
its own pool of the stage's layers (the full keys), and runs the stage's code:

    stage 0:      every rank runs the same Engine over the same requests (PipelinedEngine); rank 0 alone sends the
                  step to stage 1 (the all-reduce made the hidden states equal on every rank) and receives the last
                  stage's logits, which it broadcasts over the stage's group, so every rank samples the same tokens
                  (serve: rank 0's RankedEngine wraps it, ranks 1..T-1 `follow` its log, engine/ranks.py)
    stage s > 0:  rank 0 receives each message from stage s-1 (steps, ticks, STOP) and relays it over the stage's
                  group (pipeline/relay.py, the prefill and decode grids' relay: a beat per formation try too);
                  every rank runs the same StageFollower on it; rank 0 alone sends on (the last stage: the logits
                  back to stage 0)

Rank 0 + broadcast, not a pipeline per TP rank: one copy of the hidden states crosses between stages, and the
pipeline's formation and group are the PP-only code (its TP ranks are not in it). A member (rank r > 0) of a stage
has no pipeline link: stage 0's `MemberGroup` (a stage s > 0's RelayMember) receives the broadcast and sends
nothing. A dead rank breaks its stage's collectives: its stage's rank 0 names it (Ranks.guard), leaves that in
stage 0's rendezvous store (note_down) and exits 1; stage 0 fails what it holds naming both. The decode pipeline's
stage 0 uses LeadGroup / MemberGroup too (disagg/decode/grid.py).
Imports torch, dsakv.engine.ranks, dsakv.model and the pipeline's stage_comm and relay.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from dsakv.engine.ranks import Ranks
from dsakv.pipeline.relay import RelayGroup, RelayMember
from dsakv.pipeline.stage_comm import StageGroup, StageLinkError, StageMessage

log = logging.getLogger(__name__)


def load_stage_model(model_dir: Path, dtype: torch.dtype, ranks: Ranks) -> tuple[Any, Any]:
    """(the checkpoint's spec, this rank's shard of the model); the pool's layout is the whole model's."""
    from dsakv.model.parallel import load_tp_model

    spec, model = load_tp_model(model_dir, ranks.group, dtype=dtype)
    model.eval()
    return spec, model


class LeadGroup(StageGroup):
    """Rank 0 of a TP stage: the pipeline's StageGroup, each message it receives broadcast to the stage's other
    ranks (a dead rank: StageLinkError naming it; the pipeline breaks)."""

    ranks: Ranks | None = None
    relayed = True  # the last message received was broadcast (False from a send until the answer is relayed)

    def send_to(self, dst: int, msg: StageMessage) -> None:
        self.relayed = False
        super().send_to(dst, msg)

    def recv_from(self, src: int, timeout: float | None = None, dtype: torch.dtype | None = None) -> StageMessage:
        msg = super().recv_from(src, timeout, dtype)
        ranks = self.ranks
        assert ranks is not None, "the stage's ranks are bound before the first receive"
        self.relayed = True
        try:
            ranks.broadcast(msg)
        except Exception as e:  # noqa: BLE001 (a dead rank: its name, not gloo's)
            why = f"broadcasting step {msg.step} to its TP ranks failed: {ranks.guard(e)}"
            self.note_down(why)  # stage 0 names it (PipelinedEngine._set_down)
            self.break_(why)
            raise StageLinkError(why) from e
        return msg

    def fail_members(self, why: str) -> None:
        """A round trip failed before its answer was relayed (a decode pipeline's stage 0, which re-forms): the
        other ranks, waiting for the answer, get `why` instead (MemberGroup.recv_from raises it), so every rank
        fails the same step."""
        ranks = self.ranks
        if self.relayed or ranks is None or ranks.down is not None:
            return
        self.relayed = True
        try:
            ranks.broadcast(why)
        except Exception as e:  # noqa: BLE001 (a dead rank: the ranks' watcher names it)
            log.warning("stage %d: telling the TP ranks the round trip failed: %s", self.rank, e)


class MemberGroup(StageGroup):
    """TP rank r > 0 of stage `rank`: receives what the stage's rank 0 broadcasts, sends nothing (rank 0 sends on)."""

    def __init__(self, rank: int, size: int, ranks: Ranks, hidden_dtype: torch.dtype, timeout_s: float) -> None:
        # size 1 for stage 0: no rendezvous store of its own (the pipeline's is rank 0's)
        super().__init__(rank, size if rank else 1, "127.0.0.1", 0, timeout_s, hidden_dtype=hidden_dtype)
        self.size = size
        self.ranks = ranks
        self.epoch = f"tp member of stage {rank}"

    @property
    def formed(self) -> bool:
        return True

    def form(self, info: dict[str, Any]) -> bool:
        return True

    def recv_from(self, src: int, timeout: float | None = None, dtype: torch.dtype | None = None) -> StageMessage:
        try:
            msg = self.ranks.broadcast(None)
        except Exception as e:  # noqa: BLE001 (rank 0 of the stage or a peer rank died)
            raise StageLinkError(f"stage {self.rank} TP rank {self.ranks.rank}: {e}") from e
        if isinstance(msg, str):  # rank 0's round trip failed (LeadGroup.fail_members)
            raise StageLinkError(msg)
        assert isinstance(msg, StageMessage), f"rank 0 of stage {self.rank} broadcast {type(msg).__name__}"
        return msg

    def send_to(self, dst: int, msg: StageMessage) -> None:
        """Rank 0 of the stage sends the step on."""

    def break_(self, why: str) -> None:
        log.warning("stage %d TP rank %d: %s", self.rank, self.ranks.rank, why)

    def close(self) -> None:
        """Nothing to leave: this rank is not in the pipeline's group."""


def make_group(
    rank: int, size: int, port: int, timeout: float, dtype: torch.dtype, hidden_size: int, ranks: Ranks | None
) -> StageGroup:
    """Stage `rank`'s group for this process: a StageGroup (no TP); on stage 0 a LeadGroup (TP rank 0) or a
    MemberGroup; on a later stage the relay (pipeline/relay.py): a RelayGroup (TP rank 0) or a RelayMember."""
    if ranks is None or ranks.size == 1:
        return StageGroup(rank, size, "127.0.0.1", port, timeout, dtype, hidden_size)
    if rank > 0 and not ranks.lead:
        return RelayMember(rank, size, ranks, dtype)
    if rank > 0:
        relay = RelayGroup(rank, size, "127.0.0.1", port, timeout, dtype, hidden_size)
        relay.bind(ranks)
        return relay
    if not ranks.lead:
        return MemberGroup(rank, size, ranks, dtype, timeout)
    group = LeadGroup(rank, size, "127.0.0.1", port, timeout, dtype, hidden_size)
    group.ranks = ranks
    return group


__all__ = ["LeadGroup", "MemberGroup", "load_stage_model", "make_group"]
