"""The scheduler's awaiting-KV book (a mixin of engine.scheduler.Scheduler), disaggregated serving: a decode
reserves a request's pages (prealloc, WAITING_KV) and starts it when its KV arrived (start_decode); a prefill
keeps a finished request's pages (keep_pages) until release. See engine/scheduler.py's docstring."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from dsakv.engine.request import FinishReason, Request, RequestStatus
from dsakv.engine.sampling import stop_reason
from dsakv.engine.scheduler_types import IntArray, SchedulerState, _pages_for
from dsakv.errors import ConfigError, NoFreePages


class SchedulerAwaitingKV(SchedulerState):
    """Reads the books SchedulerState declares."""

    if TYPE_CHECKING:

        def check_fits(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int) -> None: ...

        def _reserve(self, pages: int) -> bool: ...

        def _fits_running(self, req: Request) -> bool: ...

        def _fork(self, req: Request) -> None: ...

        def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None: ...

        def _leave(self, req: Request, *, keep_in_cache: bool) -> None: ...

    # ---- disaggregation -------------------------------------------------------------------

    def prealloc(self, req: Request, *, keep_room: bool = False) -> IntArray:
        """Decode side: reserve pages for req's prompt and its first generated token (held under its id) and
        return them; its KV is written there by a prefill worker, then start_decode() lets it run.
        Raises CapacityError if it can never fit, NoFreePages if it does not fit now. `keep_room` (a decode
        worker's admission rule): refuse unless, after this request and the pages its other choices (n > 1)
        take at start_decode, every running request still has a free page to grow into."""
        if req.request_id in self.requests or req.request_id in self.kept:
            raise ConfigError(f"request id {req.request_id!r} is already in use: give each request a unique id")
        self.check_fits(req.request_id, req.num_prompt_tokens, req.params.max_new_tokens)
        need = _pages_for(req.num_prompt_tokens + 1, self.page_size)
        if keep_room:
            n, ps = req.num_prompt_tokens, self.page_size
            forks = len(req.forks) * _pages_for(n - (n - 1) // ps * ps + 1, ps)  # each recomputes the last page
            if not self._reserve(need + forks + len(self.running)):
                raise NoFreePages(
                    f"{self.allocator.num_free} free pages, {need + forks} needed + {len(self.running)} kept for "
                    "the running requests: retry when requests finish"
                )
        if not self._reserve(need):
            raise NoFreePages(
                f"request {req.request_id}: its {req.num_prompt_tokens} prompt tokens need {need} pages but only "
                f"{self.allocator.num_free} of {self.allocator.num_pages} are free now: retry when requests finish"
            )
        for f in req.forks:
            if f.request_id in self.requests or f.request_id in self.kept:
                raise ConfigError(f"request id {f.request_id!r} is already in use: give each request a unique id")
        req.page_ids = self.allocator.alloc(need, owner=req.request_id).tolist()
        req.status = RequestStatus.WAITING_KV
        req.kv_from_peer = True
        self.requests[req.request_id] = req
        self.awaiting_kv[req.request_id] = req
        for f in req.forks:  # n > 1: they fork onto its prompt pages at start_decode
            self.requests[f.request_id] = f
            self.unforked[f.request_id] = req
        return np.asarray(req.page_ids, dtype=np.int64)

    def start_decode(self, request_id: str, first_token: int) -> Request:
        """Decode side: req's prompt KV is in its pages and the prefill sampled `first_token`. The request is
        queued to run (or finishes at once if that token stops it)."""
        req = self.awaiting_kv.pop(request_id, None)
        if req is None:
            raise ConfigError(f"request {request_id!r} is not waiting for its KV: prealloc() it first")
        req.num_computed_tokens = req.num_prompt_tokens
        req.output_ids.append(int(first_token))
        reason = stop_reason(req, int(first_token), self.max_seq_len)
        if reason is not None:
            if req.forks:
                self._fork(req)
            self._finish(req, reason)
        else:  # n > 1: its other sequences fork now if all n fit max_running_requests, else when it is admitted
            if req.forks and self._fits_running(req):
                self._fork(req)
            req.status = RequestStatus.WAITING
            self.ready.append(req)
        return req

    def pages_of(self, request_id: str) -> IntArray:
        """The page ids a request holds, in token order (running, ready, WAITING_KV or kept)."""
        req = self.requests.get(request_id) or self.kept.get(request_id)
        if req is None:
            raise ConfigError(f"request {request_id!r} is unknown or finished without keep_pages")
        return np.asarray(req.page_ids, dtype=np.int64)

    def release(self, request_id: str) -> Request | None:
        """Prefill side: free the pages a finished keep_pages request still holds (after transferring them)."""
        req = self.kept.pop(request_id, None)
        if req is not None:
            self._leave(req, keep_in_cache=True)
        return req
