"""pipeline.StageFollower, the one loop every pipeline's later stages run (prefill, decode, colocated), over a fake
group and model: the books' order (drops a hook allows, the payload's books, then holds), ticks and STOP passed on
unchanged, the round-trip default (the last stage's logits back to stage 0), and a role's hooks (payload decoded,
its last-stage action instead of the logits, `stepped` on every stage)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import StageCarry
from dsakv.pipeline.batch import encode_batch
from dsakv.pipeline.follower import StageFollower, StageHooks
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.stage_comm import StageMessage
from dsakv.pipeline.step import STEP, STOP, TICK, PipeStep


class FakeGroup:
    def __init__(self, rank: int, size: int, inbox: list[StageMessage]) -> None:
        self.rank, self.size, self.inbox = rank, size, list(inbox)
        self.sent: list[tuple[int, StageMessage]] = []

    def recv_prev(self, timeout: float) -> StageMessage:
        return self.inbox.pop(0)

    def send_next(self, msg: StageMessage) -> None:
        self.sent.append((self.rank + 1, msg))

    def send_to(self, rank: int, msg: StageMessage) -> None:
        self.sent.append((rank, msg))


class FakeModel:
    """Adds 1 to the carried hidden states; logits [B, 4] of ones."""

    def stage_forward(self, batch: ForwardBatch, pool: Any, carry: StageCarry) -> StageCarry:
        return StageCarry(carry.hidden + 1, carry.topk, torch.ones(batch.batch_size, 4))


@dataclass(frozen=True)
class Note:
    text: str

    def meta(self) -> Any:
        return {"text": self.text}

    @classmethod
    def of_meta(cls, meta: Any, where: str) -> Note:
        return cls(meta["text"])


class Hooks(StageHooks[Note]):
    def __init__(self, mirror: PageMirror) -> None:
        self.payload = Note.of_meta
        self.mirror = mirror
        self.seen: list[tuple[str, Any]] = []

    def dropped(self, rid: str) -> bool:
        return rid != "keep"  # e.g. a prefill request still transferring keeps its pages

    def booked(self, step: PipeStep[Note]) -> None:
        self.seen.append(("booked", (step.payload, sorted(self.mirror.owners))))

    def last_stage(
        self, f: StageFollower[Note], msg: StageMessage, step: PipeStep[Note], batch: ForwardBatch, carry: StageCarry
    ) -> None:
        self.seen.append(("last", carry.logits.shape if carry.logits is not None else None))

    def stepped(self, step: PipeStep[Note], batch: ForwardBatch, carry: StageCarry) -> None:
        self.seen.append(("stepped", batch.batch_size))


def _batch() -> dict[str, Any]:
    t = torch.tensor
    return encode_batch(
        ForwardBatch(t([5, 6]), t([0, 1]), t([0]), t([2]), t([[0, 1]]), t([0, 1]))  # one sequence of 2 tokens
    )


def _msg(n: int, step: PipeStep[Any], hidden: torch.Tensor | None = None) -> StageMessage:
    return StageMessage(n, step.meta(), hidden)


def test_books_order_and_ticks_passed_on_unchanged() -> None:
    mirror = PageMirror(8)
    hooks = Hooks(mirror)
    first = _msg(1, PipeStep(TICK, None, {"a": [1, 2], "keep": [3]}, [], Note("1")))
    second = _msg(2, PipeStep(TICK, None, {"b": [4]}, ["a", "keep"], Note("2")))
    stop = _msg(3, PipeStep(STOP, payload=Note("3")))
    group = FakeGroup(1, 3, [first, second, stop])
    f = StageFollower(group, FakeModel(), None, mirror, 1.0, hooks)  # type: ignore[arg-type]
    assert [f.iteration() for _ in range(3)] == [TICK, TICK, STOP]
    assert group.sent == [(2, first), (2, second), (2, stop)]  # the very messages, on to stage 2
    assert hooks.seen == [
        ("booked", (Note("1"), [])),
        ("booked", (Note("2"), ["keep"])),  # after the drops ('keep' not freed), before the holds
        ("booked", (Note("3"), ["b", "keep"])),
    ]
    assert mirror.held_by("keep") == [3] and mirror.held_by("b") == [4] and mirror.held_by("a") == []
    assert f.stats.ticks == 2


def test_round_trip_default_sends_the_logits_back_to_stage_0() -> None:
    step = _msg(7, PipeStep(STEP, _batch(), {"r": [0]}), torch.zeros(2, 3))
    group = FakeGroup(2, 3, [step])
    mirror = PageMirror(4)
    f: StageFollower[Any] = StageFollower(group, FakeModel(), None, mirror, 1.0)  # type: ignore[arg-type]
    assert f.iteration() == STEP
    ((to, back),) = group.sent
    assert to == 0 and back.step == 7 and back.meta == {} and back.hidden is not None
    assert back.hidden.dtype == torch.float32 and back.hidden.shape == (1, 4)
    assert mirror.held_by("r") == [0]


def test_a_roles_hooks_replace_the_last_stage_action_and_run_on_every_stage() -> None:
    for rank, size in ((1, 3), (2, 3)):
        mirror = PageMirror(4)
        hooks = Hooks(mirror)
        step = _msg(5, PipeStep(STEP, _batch(), {"r": [0]}, [], Note("s")), torch.zeros(2, 3))
        group = FakeGroup(rank, size, [step])
        f = StageFollower(group, FakeModel(), None, mirror, 1.0, hooks)  # type: ignore[arg-type]
        assert f.iteration() == STEP
        actions = [k for k, _ in hooks.seen]
        if rank == size - 1:  # the last stage: the role's action, nothing sent back
            assert actions == ["booked", "last", "stepped"] and group.sent == []
        else:  # the step on to the next stage with the meta unchanged and this stage's hidden states
            assert actions == ["booked", "stepped"]
            ((to, sent),) = group.sent
            assert to == rank + 1 and sent.meta == step.meta and torch.equal(sent.hidden, torch.ones(2, 3))
