"""An IDLE pipeline step (DP attention x PP, pipeline/dp_stage.py): a later stage runs each of *its* MoE layers once
with 0 rows (the round's expert-parallel collectives of a DP rank with no work) and no other layer, passes the very
message on, and the last stage sends nothing back (stage 0 waits for no logits after an IDLE). Real tiny checkpoint,
every MoE layer an EPMoE of a group of one (no collective, the same calls)."""

from __future__ import annotations

from typing import Any

from dsakv.cache.device_pool import DevicePool
from dsakv.config import LayoutConfig
from dsakv.model.loader import load_model
from dsakv.model.parallel import EPMoE, attach_ep
from dsakv.pipeline.follower import StageFollower
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.pipeline.stage_comm import StageMessage
from dsakv.pipeline.step import IDLE, PipeStep
from dsakv.testing.engines import tiny_path


class Group:
    def __init__(self, rank: int, size: int, inbox: list[StageMessage]) -> None:
        self.rank, self.size, self.inbox = rank, size, list(inbox)
        self.sent: list[tuple[int, StageMessage]] = []

    def recv_prev(self, timeout: float) -> StageMessage:
        return self.inbox.pop(0)

    def send_next(self, msg: StageMessage) -> None:
        self.sent.append((self.rank + 1, msg))

    def send_to(self, rank: int, msg: StageMessage) -> None:
        self.sent.append((rank, msg))


def _calls(model: Any) -> dict[int, int]:
    return {i: layer.mlp.calls for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, EPMoE)}


def test_an_idle_step_runs_the_stages_moe_layers_once_and_is_passed_on() -> None:
    spec, model = load_model(tiny_path("glm_moe_dsa"))
    attach_ep(model.eval(), 0, 1)
    assert sorted(_calls(model)) == list(range(1, 12))  # layer 0 is dense
    for rank, size, (a, b) in ((1, 3, (6, 9)), (2, 3, (9, 12))):
        lay = LayoutConfig(page_size=4).layout(spec, a, b)
        before = _calls(model)
        msg = StageMessage(7, PipeStep(IDLE, None, {"r": [1, 2]}, []).meta())
        group = Group(rank, size, [msg])
        f = StageFollower(group, model, DevicePool(lay, 8), PageMirror(8), 1.0)  # type: ignore[arg-type]
        assert f.iteration() == IDLE
        ran = {i: n - before[i] for i, n in _calls(model).items()}
        assert ran == {i: int(a <= i < b) for i in range(1, 12)}, (rank, ran)
        assert group.sent == ([] if rank == size - 1 else [(rank + 1, msg)])  # the last stage answers nothing
        assert f.mirror.held_by("r") == [1, 2] and f.stats.ticks == 1 and f.stats.steps == 0
