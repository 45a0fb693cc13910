"""HiSparse counters: hot-buffer lookups and hits, rows and bytes swapped in per layer (this step and in total)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class LayerStats:
    lookups: int = 0
    hits: int = 0
    rows_in: int = 0
    bytes_in: int = 0


@dataclass
class HiSparseStats:
    """Hot-buffer hits and swap-in traffic; `step` is since the last `begin_step()`, `total` since the start."""

    step: dict[int, LayerStats] = field(default_factory=dict)
    total: dict[int, LayerStats] = field(default_factory=dict)
    steps: int = 0
    rank_checked_steps: int = 0  # steps whose counters and residency every TP rank found equal (engine/tp_spec)
    last_checked_step: int = 0  # the last step counted there (an idle engine step runs no HiSparse step)

    def add(self, layer: int, lookups: int, hits: int, rows: int, nbytes: int) -> None:
        for table in (self.step, self.total):
            s = table.setdefault(layer, LayerStats())
            s.lookups += lookups
            s.hits += hits
            s.rows_in += rows
            s.bytes_in += nbytes

    def add_group(self, layers: Iterable[int], lookups: int, hits: int, rows: int, nbytes: int) -> None:
        """The same counts for each layer of a producer group (its layers share one swap-in)."""
        for layer in layers:
            self.add(layer, lookups, hits, rows, nbytes)

    @property
    def hit_rate(self) -> float:
        lookups = sum(s.lookups for s in self.total.values())
        return sum(s.hits for s in self.total.values()) / lookups if lookups else 1.0

    def rank_checked(self) -> None:
        """Every TP rank found this step's rows and residency equal (counted once per HiSparse step)."""
        if self.steps != self.last_checked_step:
            self.last_checked_step = self.steps
            self.rank_checked_steps += 1

    def step_rows(self) -> dict[int, int]:
        return {layer: s.rows_in for layer, s in sorted(self.step.items())}

    def step_bytes(self) -> dict[int, int]:
        return {layer: s.bytes_in for layer, s in sorted(self.step.items())}

    def to_dict(self) -> dict[str, object]:
        return {
            "steps": self.steps,
            "rank_checked_steps": self.rank_checked_steps,
            "hit_rate": round(self.hit_rate, 6),
            "rows_in_total": sum(s.rows_in for s in self.total.values()),
            "bytes_in_total": sum(s.bytes_in for s in self.total.values()),
            "rows_in_last_step": self.step_rows(),
            "bytes_in_last_step": self.step_bytes(),
        }
