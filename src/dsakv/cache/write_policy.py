"""Write policies of the host tier: when a device copy is written to the host, chosen by name (WRITE_POLICIES).

  write_through             back up every newly cached run of pages when it is inserted (and a hit run that
                            lost its host copy), so an eviction never has to wait for a copy
  write_back                copy to the host only when the device copy is evicted (offload on eviction)
  write_through_selective   back up a run once it was hit `threshold` times; cold runs never reach the host

A policy only decides; the copies are made by the HiCache controller (`backup`), vectorised over pages.
Imports dsakv.cache.radix only (for types); must not import torch, model or engine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Protocol

from dsakv.errors import ConfigError
from dsakv.util import Registry

if TYPE_CHECKING:
    from dsakv.cache.radix import RadixNode


class Backup(Protocol):
    def backup(self, nodes: list[RadixNode]) -> int: ...


class WritePolicy:
    name: ClassVar[str] = ""
    offload_on_evict: ClassVar[bool] = False

    def on_insert(self, ctl: Backup, nodes: list[RadixNode]) -> None:
        """`nodes` were just cached on the device (inserted by a request, or loaded from disk)."""

    def on_hit(self, ctl: Backup, path: list[RadixNode]) -> None:
        """`path` (all on the device now) served a prefix hit; hit counts were already incremented."""


class WriteThrough(WritePolicy):
    name = "write_through"

    def on_insert(self, ctl: Backup, nodes: list[RadixNode]) -> None:
        ctl.backup([n for n in nodes if not n.on_host])

    def on_hit(self, ctl: Backup, path: list[RadixNode]) -> None:
        ctl.backup([n for n in path if not n.on_host])


class WriteBack(WritePolicy):
    name = "write_back"
    offload_on_evict = True


class WriteThroughSelective(WritePolicy):
    name = "write_through_selective"

    def __init__(self, threshold: int = 2) -> None:
        if threshold < 1:
            raise ConfigError(f"write_through_selective threshold = {threshold} must be >= 1 (hits before a backup)")
        self.threshold = threshold

    def on_hit(self, ctl: Backup, path: list[RadixNode]) -> None:
        ctl.backup([n for n in path if not n.on_host and n.hit_count >= self.threshold])


WRITE_POLICIES: Registry[type[WritePolicy]] = Registry(
    "write policy", flag="--hicache-write-policy", unknown="write policy {name!r} is unknown: use one of {choices}"
)
for _cls in (WriteThrough, WriteBack, WriteThroughSelective):
    WRITE_POLICIES.add(_cls.name, _cls)


def make_write_policy(name: str, threshold: int = 2) -> WritePolicy:
    """The named write policy; `threshold` is the hit count write_through_selective waits for."""
    cls = WRITE_POLICIES.get(name)
    if cls is WriteThroughSelective:
        return WriteThroughSelective(threshold)
    return cls()
