"""The Engine's books (a mixin of engine.Engine): EngineStats, the integrity check, and the prefix-cache,
HiSparse and pool counters."""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.hisparse import HiSparsePool
from dsakv.engine.scheduler import PrefixCache, Scheduler
from dsakv.spec.layout import KVLayout


@dataclass(frozen=True)
class EngineStats:
    page_size: int
    pages_total: int
    pages_used: int
    pages_free: int
    capacity_tokens: int
    bytes_per_token: int
    pool_bytes: int
    num_running: int
    num_waiting: int
    num_preemptions: int
    steps: int
    prefill_tokens: int  # tokens computed in prefill chunks (prompts, and recomputation after preemption)
    decode_tokens: int  # tokens computed one at a time after the prompt
    generated_tokens: int

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class EngineBooks:
    """Needs (set by Engine.__init__) the attributes below."""

    layout: KVLayout
    pool: Any
    allocator: PageAllocator
    scheduler: Scheduler
    hisparse: HiSparsePool | None
    prefix_cache: PrefixCache | None
    _lock: threading.RLock
    _steps: int
    _prefill_tokens: int
    _decode_tokens: int
    _generated: int

    def hisparse_stats(self) -> dict[str, Any] | None:
        """HiSparse hot-buffer counters and sizes (HiSparsePool.stats_dict()), None without --hisparse."""
        with self._lock:
            return self.hisparse.stats_dict() if self.hisparse is not None else None

    # ---- books ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise IntegrityError unless free + held pages == total and every request holds exactly its pages."""
        with self._lock:
            self.scheduler.check_integrity()

    def cache_stats(self) -> dict[str, Any] | None:
        """Prefix-cache counters (HiCacheStats.to_dict()), or None without a HiCache prefix cache."""
        with self._lock:
            stats = getattr(self.prefix_cache, "stats", None)
            return stats.to_dict() if stats is not None and hasattr(stats, "to_dict") else None

    def stats(self) -> EngineStats:
        with self._lock:
            a = self.allocator
            return EngineStats(
                page_size=self.layout.page_size,
                pages_total=a.num_pages,
                pages_used=a.num_used,
                pages_free=a.num_free,
                capacity_tokens=a.num_pages * self.layout.page_size,
                bytes_per_token=self.layout.bytes_per_token,
                pool_bytes=self.pool.nbytes,
                num_running=self.scheduler.num_running,
                num_waiting=self.scheduler.num_waiting,
                num_preemptions=self.scheduler.num_preemptions,
                steps=self._steps,
                prefill_tokens=self._prefill_tokens,
                decode_tokens=self._decode_tokens,
                generated_tokens=self._generated,
            )
