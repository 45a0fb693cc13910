"""A prefix match (PrefixMatch: the pages found, the loads still pending) and the observer of host copies."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import numpy.typing as npt

from dsakv.cache.allocator import IntArray
from dsakv.cache.radix import RadixNode

log = logging.getLogger("dsakv.cache.hicache")


_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass
class _Load:
    """One pending load of a match: a host-only node, or a run of storage pages under `node`."""

    kind: str  # "host" | "disk" (the storage tier)
    node: RadixNode
    dev_ids: IntArray
    tokens: npt.NDArray[np.int64] = field(default_factory=lambda: _EMPTY)
    hashes: list[str] = field(default_factory=list)
    above: list[str] = field(default_factory=list)  # disk hashes of the pages before `hashes` (in the tree)
    host_ids: IntArray = field(default_factory=lambda: _EMPTY)  # storage loads through the host tier land here


@dataclass(eq=False)
class PrefixMatch:
    """A locked prefix hit. `page_ids` / `num_tokens` are final once `ready` (match_prefix with load=True)."""

    id: int
    page_size: int
    lookup_tokens: int
    node: RadixNode | None  # deepest locked node (None: nothing matched)
    device_pages: int  # pages that were on the device at match time
    pending: list[_Load] = field(default_factory=list)
    page_ids: IntArray = field(default_factory=lambda: _EMPTY)
    host_pages: int = 0  # loaded from the host tier
    disk_pages: int = 0  # loaded from the storage tier
    released: bool = False
    admitted: bool = False  # admit() counted it

    @property
    def ready(self) -> bool:
        return not self.pending

    @property
    def owner(self) -> tuple[str, int]:
        return ("hicache-load", self.id)

    @property
    def num_tokens(self) -> int:
        return int(self.page_ids.size) * self.page_size


class HostCopyObserver(Protocol):
    """Told every copy between the device pool and the host tier (page ids in copy order)."""

    def on_offload(self, dev_ids: IntArray, host_ids: IntArray) -> None: ...

    def on_load(self, host_ids: IntArray, dev_ids: IntArray) -> None: ...
