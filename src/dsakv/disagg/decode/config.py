"""The configuration of a decode worker process: the configuration tree plus where the process runs
(DecodeConfig), and, for a pipelined decode (--pp-size > 1), its pipeline (DecodePipelineConfig).

Used by the decode worker (decode_worker.py), its pipeline stages (decode_stage.py) and cli/disagg_roles.py; one
module so that neither of the first two imports the other for its configuration.
Imports dsakv.disagg.{messages, stage_context, timeouts}, engine.config and errors; no torch.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

from dsakv.disagg.protocol.messages import MAX_KV_TIMEOUT
from dsakv.disagg.protocol.timeouts import Timeouts
from dsakv.engine.config import Config
from dsakv.errors import ConfigError
from dsakv.pipeline.batch import split_layers


@dataclass(frozen=True)
class DecodePipelineConfig:
    """The pipeline of a decode worker: stage k of a worker at --port P listens on P + k."""

    pp_size: int = 1
    pp_rank: int = 0
    partition: tuple[int, ...] | None = None
    stage0_host: str | None = None  # where stage 0 runs (the gloo rendezvous); default --host
    dist_port: int | None = None  # gloo rendezvous on stage 0; default port + pp_size
    stage_timeout: float = 10.0

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"--pp-rank {self.pp_rank} must be in 0..{self.pp_size - 1} (--pp-size {self.pp_size})")
        if self.stage_timeout <= 0:
            raise ConfigError(f"--stage-timeout {self.stage_timeout} must be > 0 seconds")

    def ranges(self, num_layers: int) -> list[tuple[int, int]]:
        return split_layers(num_layers, self.pp_size, self.partition)


@dataclass(frozen=True)
class DecodeConfig:
    """A decode worker: the configuration tree (its engine branch is the Engine's; transfer: backend and rpc
    timeout) and where this process runs."""

    model: str
    config: Config = field(default_factory=Config)
    host: str = "127.0.0.1"
    port: int = 0
    name: str | None = None
    backend_options: dict[str, Any] = field(default_factory=dict, hash=False)
    kv_grace: float = 1.0  # wait this long past a request's prefill deadline before failing it
    liveness_interval: float = 0.5  # ping the prefill stages requests wait for this often
    pipeline: DecodePipelineConfig | None = None  # --pp-size > 1: this process is stage 0 (decode_stage.py)
    max_kv_timeout: float = 120.0  # the longest kv_timeout a prealloc may ask for: bounds how long pages wait for KV

    def __post_init__(self) -> None:
        if not 0 < self.max_kv_timeout <= MAX_KV_TIMEOUT:
            raise ConfigError(
                f"--max-kv-timeout {self.max_kv_timeout} must be in (0, {MAX_KV_TIMEOUT:g}] seconds (the longest a "
                "request's pages wait for their KV), e.g. 120"
            )

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        rpc = self.config.transfer.rpc_timeout
        return Timeouts(
            rpc=rpc,
            connect=min(2.0, rpc),
            kv_grace=self.kv_grace,
            liveness_interval=self.liveness_interval,
            max_kv=self.max_kv_timeout,
        )


__all__ = ["DecodeConfig", "DecodePipelineConfig"]
