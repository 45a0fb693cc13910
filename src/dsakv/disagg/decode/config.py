"""The configuration of a decode worker process: the configuration tree plus where the process runs
(DecodeConfig), and, for a pipelined decode (--pp-size > 1), its pipeline (the tree's one PipelineConfig).

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
from dsakv.engine.config import Config, PipelineConfig
from dsakv.errors import ConfigError


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
    pipeline: PipelineConfig | None = None  # --pp-size > 1: stage `pipeline.rank` (decode/stage*.py)
    max_kv_timeout: float = 120.0  # the longest kv_timeout a prealloc may ask for: bounds how long pages wait for KV
    tp_size: int = 1  # --tp-size T > 1: this process is TP rank 0 (decode/ranks.py) and starts ranks 1..T-1
    rank_argv: tuple[str, ...] = ()  # the `dsakv` arguments the rank processes re-run (this process's argv)

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


__all__ = ["DecodeConfig"]
