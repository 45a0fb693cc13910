"""The disaggregated-decode calls of the V4Engine (a mixin): a request whose pages and state slot a prefill fills.

    req = eng.accept_request(prompt, first_token, max_new_tokens)   pages + a slot, parked (nothing grows later)
    ... the prefill writes every kind into req.page_ids and req.slot ...
    eng.start_request(req.rid)                                       decode it
    eng.abort_parked(req.rid)                                        or free what it held

Imports numpy, dsakv.cache and dsakv.engine.v4_request; must not import model, disagg, serve or cli.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.v4_pool import SlotAllocator
from dsakv.engine.request import SamplingParams
from dsakv.engine.v4_request import V4Request
from dsakv.errors import CapacityError, ConfigError
from dsakv.util import ceil_div


class V4Handoff:
    """Needs (set by V4Engine.__init__) the attributes below."""

    pages: PageAllocator
    slots: SlotAllocator
    running: list[V4Request]
    finished: dict[int, V4Request]
    parked: dict[int, V4Request]
    _next: int

    if TYPE_CHECKING:  # V4Engine's, declared for the type checker only

        @property
        def page_size(self) -> int: ...

    def accept_request(
        self,
        prompt: list[int],
        first_token: int,
        max_new_tokens: int,
        eos: tuple[int, ...] = (),
        sampling: SamplingParams | None = None,
        seed: int = 0,
    ) -> V4Request:
        """Allocate pages and a slot for a prefilled request (parked until `start_request`); the prefill writes its
        every kind into them. CapacityError (nothing allocated) when there is no room."""
        if not prompt or max_new_tokens < 1:
            raise ConfigError(f"an inbound V4 request needs a prompt and max_new_tokens >= 1, got {max_new_tokens}")
        need = ceil_div(len(prompt) + max_new_tokens, self.page_size)
        if not self.slots.num_free or not self.pages.can_alloc(need):
            raise CapacityError(
                f"the decode has no room for {need} pages and a slot ({self.pages.num_free} pages, "
                f"{self.slots.num_free} slots free): retry later"
            )
        req = V4Request(
            self._next, list(prompt), max_new_tokens, output=[int(first_token)], eos=tuple(eos), sampling=sampling,
            seed=seed,
        )  # fmt: skip
        self._next += 1
        req.page_ids = self.pages.alloc(need, owner=req.rid)
        req.slot = self.slots.alloc()
        req.num_computed = len(prompt)
        self.parked[req.rid] = req
        return req

    def start_request(self, rid: int) -> None:
        """Decode an accepted request once its pages and slot are filled."""
        req = self.parked.pop(rid)
        if req.done:
            self.finished[rid] = req
            self.pages.release(rid)
            self.slots.free(req.slot)
        else:
            self.running.append(req)

    def abort_parked(self, rid: int) -> None:
        req = self.parked.pop(rid)
        self.pages.release(rid)
        self.slots.free(req.slot)
