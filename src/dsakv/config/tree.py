"""The root of the configuration tree (drawn in dsakv.config's docstring)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dsakv.config.engine import EngineConfig
from dsakv.config.parallel import PipelineConfig
from dsakv.config.transfer import TransferConfig


@dataclass(frozen=True)
class Config:
    """The root of the tree."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    transfer: TransferConfig = field(default_factory=TransferConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
