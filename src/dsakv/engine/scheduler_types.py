"""The scheduler's types: the prefix-cache hook (PrefixCache, PrefixMatch; see engine/scheduler.py's docstring),
a step's ScheduledChunk / SchedulerOutput. Re-exported by engine.scheduler."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import numpy.typing as npt

from dsakv.engine.request import Request
from dsakv.util import ceil_div

if TYPE_CHECKING:
    from dsakv.cache.allocator import PageAllocator

IntArray = npt.NDArray[np.int64]
DEFAULT_MAX_RUNNING = 64


class PrefixMatch(Protocol):
    @property
    def page_ids(self) -> IntArray: ...

    @property
    def num_tokens(self) -> int: ...


class PrefixCache(Protocol):
    """The hook a prefix cache implements; see the module docstring."""

    def match_prefix(self, token_ids: Sequence[int]) -> PrefixMatch: ...

    def insert(self, token_ids: Sequence[int], page_ids: IntArray) -> object: ...

    def release(self, match: Any) -> None: ...  # the object match_prefix returned

    def evict(self, num_pages: int) -> int: ...


@dataclass
class ScheduledChunk:
    """`num_tokens` new tokens of `request`, from token `start` (= num_computed_tokens before the step)."""

    request: Request
    start: int
    num_tokens: int
    num_draft: int = 0  # speculative decoding: draft tokens verified after this (decode) token, pages allocated

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the request's last token: its logits give the next token."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


def _pages_for(tokens: int, page_size: int) -> int:
    return ceil_div(tokens, page_size)


class SchedulerState:
    """The scheduler's books (set by Scheduler.__init__), declared once for the mixins that read them
    (scheduler_kv.SchedulerAwaitingKV, scheduler_leave.SchedulerLeaving) and for Scheduler itself."""

    allocator: PageAllocator
    page_size: int
    max_seq_len: int | None
    prefix_cache: PrefixCache | None
    waiting: deque[Request]
    running: list[Request]
    ready: deque[Request]
    awaiting_kv: dict[str, Request]
    kept: dict[str, Request]
    requests: dict[str, Request]
    unforked: dict[str, Request]
    num_preemptions: int
