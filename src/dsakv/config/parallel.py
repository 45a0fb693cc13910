"""The parallel branch of the configuration tree (dsakv.config): how a role is cut across processes. Today the
pipeline (PipelineConfig: stages, partition, rendezvous, stage timeout; validated here, once) and the layer range
of each stage (split_layers); the tensor / data-parallel sizes are to join it here. Imports only errors and plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from dsakv.errors import ConfigError
from dsakv.plan.capacity import even_partition


@dataclass(frozen=True)
class PipelineConfig:
    """The one pipeline config of every pipelined role (validated here, once): a prefill or decode worker's stage k
    at --port P listens on P + k; a colocated pipeline (pipeline/colocated.py) uses pp_size, partition and
    stage_timeout only."""

    pp_size: int = 1
    pp_rank: int | None = None  # None: start every stage as a child process
    partition: tuple[int, ...] | None = None  # layers per stage (None: even split, earlier stages larger)
    dist_port: int | None = None  # gloo rendezvous on stage 0 (None: port + pp_size)
    stage0_host: str | None = None
    stage_timeout: float = 10.0

    def __post_init__(self) -> None:
        if self.pp_size < 1:
            raise ConfigError(f"--pp-size {self.pp_size} must be >= 1")
        if self.pp_rank is not None and not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"--pp-rank {self.pp_rank} must be in 0..{self.pp_size - 1} (--pp-size {self.pp_size})")
        if not self.stage_timeout > 0:
            raise ConfigError(f"--stage-timeout {self.stage_timeout} must be > 0 seconds")

    @property
    def rank(self) -> int:
        """This process's stage (0 when pp_rank is None: the supervisor, or stage 0 of a colocated pipeline)."""
        return self.pp_rank or 0


def split_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage: `partition` (layers per stage) or an even split, earlier stages larger."""
    if pp_size < 1:
        raise ConfigError(f"--pp-size {pp_size} must be >= 1")
    if partition is None:
        partition = even_partition(num_layers, pp_size)
    if len(partition) != pp_size:
        raise ConfigError(f"--pp-partition {list(partition)} has {len(partition)} stages but --pp-size is {pp_size}")
    if any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ConfigError(
            f"--pp-partition {','.join(map(str, partition))} must give every stage >= 1 layer and sum to the "
            f"model's {num_layers} layers (sums to {sum(partition)})"
        )
    out, start = [], 0
    for n in partition:
        out.append((start, start + n))
        start += n
    return out
