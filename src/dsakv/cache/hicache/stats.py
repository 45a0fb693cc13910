"""HiCache's counters (hits per tier, copies, storage calls and their failures)."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

log = logging.getLogger("dsakv.cache.hicache")


@dataclass
class HiCacheStats:
    """Counters since the cache was built. Tokens are whole pages x page_size."""

    lookups: int = 0  # admitted matches (admit()): one per request admission that used the cache
    lookup_tokens: int = 0  # tokens those matches looked up
    unadmitted_lookups: int = 0  # match_prefix calls released without admit() (admission retries, aborts)
    device_hit_tokens: int = 0  # matched tokens that were already on the device
    host_hit_tokens: int = 0  # matched tokens loaded back from the host tier
    disk_hit_tokens: int = 0  # matched tokens loaded from the storage (L3) tier: file or mooncake
    inserted_tokens: int = 0  # tokens newly cached by insert
    offload_pages: int = 0  # device -> host
    offload_bytes: int = 0
    offload_seconds: float = 0.0
    offload_skipped_pages: int = 0  # backups that found the host tier full of locked pages
    load_pages: int = 0  # host -> device
    load_bytes: int = 0
    load_seconds: float = 0.0
    disk_write_pages: int = 0  # pages written to the storage tier (disk_* = the storage tier, any backend)
    disk_write_bytes: int = 0
    disk_read_pages: int = 0  # storage -> device
    disk_read_bytes: int = 0
    disk_evicted_pages: int = 0  # page files deleted to stay under disk_size (LRU)
    disk_evicted_bytes: int = 0  # their bytes on disk (headers included)
    storage_queries: int = 0  # longest-prefix existence queries sent to the store
    storage_query_seconds: float = 0.0
    storage_read_seconds: float = 0.0  # store -> host (or staging) pages, verification included
    storage_write_seconds: float = 0.0
    storage_failures: int = 0  # store calls that failed (a dead master, an I/O error): computed instead
    storage_timeouts: int = 0  # store calls abandoned at the deadline: computed instead
    storage_skipped: int = 0  # store calls not made while the store was failing or a call was still stuck
    storage_corrupt_pages: int = 0  # pages whose checksum or MAC failed on read (dropped)
    storage_refused_pages: int = 0  # objects of another identity or size (never loaded)
    storage_missing_pages: int = 0  # pages gone between the existence query and the read
    storage_unstaged_pages: int = 0  # pages not written: no host copy to put from (zero-copy backends)
    device_evicted_pages: int = 0  # device copies dropped (offloaded first under write_back)
    host_evicted_pages: int = 0  # host copies dropped

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.disk_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0

    @property
    def offload_gbps(self) -> float:
        return self.offload_bytes / self.offload_seconds / 1e9 if self.offload_seconds else 0.0

    @property
    def load_gbps(self) -> float:
        return self.load_bytes / self.load_seconds / 1e9 if self.load_seconds else 0.0

    @property
    def storage_read_gbps(self) -> float:
        return self.disk_read_bytes / self.storage_read_seconds / 1e9 if self.storage_read_seconds else 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(hit_tokens=self.hit_tokens, hit_rate=round(self.hit_rate, 6))
        d.update(storage_hit_tokens=self.disk_hit_tokens)
        return d
