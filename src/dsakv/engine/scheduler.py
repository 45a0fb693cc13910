"""Scheduler: continuous batching with chunked prefill over a paged, ref-counted pool.

Every step mixes decode tokens and prefill chunks in one batch of at most
`max_batch_tokens` tokens:

1. Running requests, oldest admitted first. A decoding request takes 1 token; a
   request still prefilling takes a chunk of what is left of the budget after one
   token is set aside for every decoding request behind it (decodes never starve).
   Pages are allocated one page at a time as a sequence grows. When a request
   cannot get the page it needs, the prefix cache (if any) evicts first, then the
   NEWEST running request is preempted: its pages are freed and it goes back to the
   front of the waiting queue with its output kept (it recomputes later). A
   prefilling request shrinks its chunk to the pages it can get before preempting.
2. Ready requests (prefilled by another worker, see below), then waiting requests,
   first come first served (preempted ones first), while there is budget and fewer
   than `max_running_requests` run: a request is admitted only when every page its
   next chunk needs is free. No admission in a step that preempted.

A request that can never fit (prompt + max_new_tokens above the pool's capacity or
the model's max positions) is rejected by `add` with CapacityError; nothing is
queued. `abort(request_id)` frees a request's pages at any point.

Page ownership: every page a request holds is recorded with
`allocator.hold(request_id, ids)` (owner = the request id string), so
`check_integrity()` proves free + held == total after every step.

Prefix-cache hook (None by default; dsakv.cache.hicache.HiCache implements it):

    m = match_prefix(token_ids)
        Longest cached prefix of `token_ids` in whole pages: m.page_ids (int64 array of
        device pages) and m.num_tokens == len(m.page_ids) * page_size. The cache locks
        them (never evicts them) until release(m); it may load host/disk hits first.
        The scheduler asks with all tokens but the last (it needs that token's logits).
        On admission it increfs m.page_ids and holds them for the request, whose page
        table then starts with them; if it does not admit, it calls release(m) at once.
    insert(token_ids, page_ids)
        When a request leaves (finishes, is aborted or preempted): its computed tokens
        cut to whole pages, and the pages holding them. The cache takes its own
        reference (allocator.incref + allocator.hold under a non-str owner) of the pages
        it keeps; then the scheduler calls release(m) and releases the request's
        references, so pages the cache already had go back to the free list.
    admit(m)   (optional) called once when the request starts with m (not on a retry), so a
        cache counts lookups and hits per admission, never per match_prefix attempt.
    release(m)
        Ends the lock taken by match_prefix.
    evict(num_pages) -> int
        Drop the cache's reference to up to `num_pages` unlocked pages (LRU); returns how
        many went back to the free list. Called before preempting, and before admitting.
    check_integrity()   (optional) called by Scheduler.check_integrity().

n > 1 (params.n): sequences 1.. of a request wait (`unforked`) while sequence 0 prefills; when its prompt is
computed they join the running set holding references to its whole prompt pages (all but the page of the
prompt's last token) and recompute only that tail in pages of their own. If sequence 0 leaves first (abort,
error) they queue as ordinary requests. A request with prompt_logprobs skips the prefix cache (every prompt
position's logits are computed).

Disaggregated serving:

    decode side   prealloc(req) -> page ids     reserve pages for the prompt + 1 token (status
                                               WAITING_KV) for a prefill worker to write into;
                  start_decode(rid, first)     the KV has arrived: num_computed = prompt, output
                                               = [first]; the request joins the running set at the
                                               next admission (it needs no new page) and decodes;
                                               n > 1: its other sequences fork onto its prompt pages
                                               then if all n fit max_running_requests, else when it is
                                               admitted (they wait in `unforked` from prealloc on).
    prefill side  Request.keep_pages=True      on finishing (stop/length) its pages stay held under
                  release(rid)                 its id (pages_of(rid)) until release(rid), so they can
                                               be transferred first.
    WAITING_KV requests and kept pages are never preempted; abort(rid) frees them at any point.

Imports numpy, dsakv.cache.allocator, dsakv.errors and dsakv.engine.{request,sampling};
must not import torch models, disagg, serve or cli.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

import numpy as np

from dsakv.cache.allocator import IntegrityError, PageAllocator
from dsakv.engine.request import FinishReason, Request, RequestStatus
from dsakv.engine.scheduler_kv import SchedulerAwaitingKV
from dsakv.engine.scheduler_leave import SchedulerLeaving
from dsakv.engine.scheduler_types import (
    DEFAULT_MAX_RUNNING,
    IntArray,
    PrefixCache,
    PrefixMatch,
    ScheduledChunk,
    SchedulerOutput,
    _pages_for,
)
from dsakv.errors import CapacityError, ConfigError, NoFreePages

log = logging.getLogger(__name__)


class Scheduler(SchedulerAwaitingKV, SchedulerLeaving):
    """Admission and growth here; the awaiting-KV book (scheduler_kv.py); leaving, preemption and the
    after-step updates (scheduler_leave.py)."""

    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        *,
        max_batch_tokens: int = 512,
        max_running_requests: int | None = None,
        max_seq_len: int | None = None,
        prefix_cache: PrefixCache | None = None,
    ) -> None:
        if page_size < 1:
            raise ConfigError(f"page_size = {page_size} must be >= 1")
        if max_batch_tokens < 1:
            raise ConfigError(f"max_batch_tokens = {max_batch_tokens} must be >= 1 (tokens computed per step)")
        if max_running_requests is None:
            max_running_requests = min(DEFAULT_MAX_RUNNING, max_batch_tokens)
        if not 1 <= max_running_requests <= max_batch_tokens:
            raise ConfigError(
                f"max_running_requests = {max_running_requests} must be in 1..max_batch_tokens "
                f"({max_batch_tokens}): every running request needs at least one token of a step's budget"
            )
        if max_seq_len is not None and max_seq_len < 2:
            raise ConfigError(f"max_seq_len = {max_seq_len} must be >= 2")
        self.allocator = allocator
        self.page_size = page_size
        self.max_batch_tokens = max_batch_tokens
        self.max_running_requests = max_running_requests
        self.max_seq_len = max_seq_len
        self.prefix_cache = prefix_cache
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last one is the newest
        self.ready: deque[Request] = deque()  # prefilled elsewhere, KV in place: wait for a running slot
        self.awaiting_kv: dict[str, Request] = {}  # pages reserved, KV being transferred in
        self.kept: dict[str, Request] = {}  # finished with keep_pages: pages held until release()
        self.requests: dict[str, Request] = {}  # every unfinished request
        self.unforked: dict[str, Request] = {}  # sequences 1.. of an n > 1 request, by id -> sequence 0
        self.num_preemptions = 0
        # speculative decoding (engine/speculative.py): draft tokens a decoding request may verify this step;
        # their pages are taken only from free pages (never by preempting), fewer or none when short
        self.draft_lookahead: Callable[[Request], int] | None = None

    # ---- capacity ----------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.allocator.num_pages * self.page_size

    def check_fits(self, request_id: str, num_prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise CapacityError if a request of this size could never run, even alone."""
        total = num_prompt_tokens + max_new_tokens
        if total > self.capacity_tokens:
            raise CapacityError(
                f"request {request_id}: prompt of {num_prompt_tokens} tokens + max_new_tokens {max_new_tokens} = "
                f"{total} tokens can never fit in the KV pool of {self.allocator.num_pages} pages x "
                f"{self.page_size} tokens = {self.capacity_tokens} tokens: shorten the prompt, lower "
                "max_new_tokens, or give the engine more pages (num_pages / max_tokens)"
            )
        if self.max_seq_len is not None and total > self.max_seq_len:
            raise CapacityError(
                f"request {request_id}: prompt of {num_prompt_tokens} tokens + max_new_tokens {max_new_tokens} = "
                f"{total} tokens is more than the model's {self.max_seq_len} positions "
                "(max_position_embeddings): shorten the prompt or lower max_new_tokens"
            )

    # ---- queue -------------------------------------------------------------------------

    def add(self, req: Request) -> None:
        if req.request_id in self.requests or req.request_id in self.kept:
            raise ConfigError(f"request id {req.request_id!r} is already in use: give each request a unique id")
        if req.status is not RequestStatus.WAITING or req.page_ids or req.num_computed_tokens:
            raise ConfigError(f"request {req.request_id!r} is not new ({req!r})")
        self.check_fits(req.request_id, req.num_prompt_tokens, req.params.max_new_tokens)
        for f in req.forks:
            if f.request_id in self.requests or f.request_id in self.kept:
                raise ConfigError(f"request id {f.request_id!r} is already in use: give each request a unique id")
        self.requests[req.request_id] = req
        self.waiting.append(req)
        for f in req.forks:
            self.requests[f.request_id] = f
            self.unforked[f.request_id] = req

    def abort(self, request_id: str) -> Request | None:
        """Finish `request_id` with reason 'abort' and free its pages; None if it is unknown or finished.
        A finished request whose pages are kept is released instead (and returned)."""
        if request_id in self.kept:
            return self.release(request_id)
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING_KV:
            del self.awaiting_kv[request_id]
        elif req in self.ready:
            self.ready.remove(req)
        elif request_id in self.unforked:
            self.unforked.pop(request_id).forks.remove(req)
        else:
            self.waiting.remove(req)
        self._leave(req, keep_in_cache=True)  # only computed tokens go to the cache: none while WAITING_KV
        self._orphan_forks(req)
        req.finish(FinishReason.ABORT)
        log.debug("aborted %s", req)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.ready) + len(self.awaiting_kv)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- schedule ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_batch_tokens
        decodes_behind = sum(1 for r in self.running if not r.in_prefill)
        i = 0
        while i < len(self.running):
            req = self.running[i]
            decoding = not req.in_prefill
            if decoding:
                decodes_behind -= 1
            want = min(req.num_pending_tokens, budget - decodes_behind)
            if want <= 0:
                i += 1
                continue
            n = self._grow(req, want, partial=not decoding)
            while n == 0:
                victim = self.running[-1]
                if not victim.in_prefill and victim is not req:
                    decodes_behind -= 1
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
                n = self._grow(req, want, partial=not decoding)
            if n == 0:
                break  # req itself was preempted; it was the newest
            drafts = 0
            if decoding and self.draft_lookahead is not None:
                drafts = self._grow_drafts(req, min(self.draft_lookahead(req), budget - n - decodes_behind))
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, drafts))
            budget -= n + drafts
            i += 1
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _slots_taken(self) -> int:
        """Running sequences, counting the sequences 1.. of running n > 1 requests that join them at their fork."""
        return len(self.running) + sum(len(r.forks) for r in self.running)

    def _fits_running(self, req: Request) -> bool:
        """req (and its n - 1 other sequences) may join the running set: within max_running_requests, or alone
        (an n above the cap runs by itself; an engine with a hard cap, HiSparse, refuses such an n on add)."""
        taken = self._slots_taken()
        return taken + 1 + len(req.forks) <= self.max_running_requests or taken == 0

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.ready and budget > 0 and self._fits_running(self.ready[0]):
            req = self.ready[0]
            if self._grow(req, 1, partial=False) == 0:
                break
            self.ready.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            if req.forks:  # they start on its prompt pages and run from the next step
                self._fork(req)
            drafts = 0  # PD with MTP: the prefill's draft hidden state seeded a draft (Speculator.seed)
            if self.draft_lookahead is not None:
                drafts = self._grow_drafts(req, min(self.draft_lookahead(req), budget - 1))
            out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, 1, drafts))
            budget -= 1 + drafts
        while self.waiting and budget > 0 and self._fits_running(self.waiting[0]):
            req = self.waiting[0]
            cached_pages: IntArray = np.zeros(0, dtype=np.int64)
            cached = 0
            match = None
            if self.prefix_cache is not None and req.params.prompt_logprobs is None:  # prompt logprobs: compute all
                match = self.prefix_cache.match_prefix(req.token_ids(0, req.num_tokens - 1))
                cached_pages, cached = np.asarray(match.page_ids, dtype=np.int64), int(match.num_tokens)
                if cached != cached_pages.size * self.page_size:
                    raise IntegrityError(
                        f"prefix cache matched {cached} tokens on {cached_pages.size} pages of {self.page_size}: "
                        "a match must be whole pages"
                    )
            n = min(req.num_tokens - cached, budget)
            need = _pages_for(cached + n, self.page_size) - cached_pages.size
            if not self._reserve(need):
                if self.prefix_cache is not None and match is not None:
                    self.prefix_cache.release(match)
                break
            self.waiting.popleft()
            admit = getattr(self.prefix_cache, "admit", None)
            if match is not None and admit is not None:
                admit(match)
            if cached_pages.size:
                self.allocator.incref(cached_pages)
                self.allocator.hold(req.request_id, cached_pages)
            req.page_ids = cached_pages.tolist()
            req.prefix_match = match
            req.num_computed_tokens = req.num_cached_tokens = cached
            new = self.allocator.alloc(need, owner=req.request_id)
            req.page_ids.extend(new.tolist())
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, cached, n))
            budget -= n

    def _reserve(self, pages: int) -> bool:
        """True if `pages` pages are free, after asking the prefix cache to evict if needed."""
        short = pages - self.allocator.num_free
        if short > 0 and self.prefix_cache is not None:
            self.prefix_cache.evict(short)
        return pages <= self.allocator.num_free

    def _grow(self, req: Request, want: int, *, partial: bool) -> int:
        """Allocate the pages for `want` more tokens of `req` (fewer if `partial`); tokens granted (0 = none)."""
        have = len(req.page_ids)
        need = _pages_for(req.num_computed_tokens + want, self.page_size) - have
        if not self._reserve(need):
            if not partial:
                return 0
            need = self.allocator.num_free
            want = min(want, (have + need) * self.page_size - req.num_computed_tokens)
            if want <= 0:
                return 0
        if need > 0:
            req.page_ids.extend(self.allocator.alloc(need, owner=req.request_id).tolist())
        return want

    def _grow_drafts(self, req: Request, drafts: int) -> int:
        """Pages for up to `drafts` draft tokens after req's decode token, from free pages only; drafts granted."""
        if drafts <= 0:
            return 0
        have = len(req.page_ids)
        end = req.num_computed_tokens + 1
        need = _pages_for(end + drafts, self.page_size) - have
        if need > 0 and not self._reserve(need):
            need = self.allocator.num_free
            drafts = min(drafts, (have + need) * self.page_size - end)
            if drafts <= 0:
                return 0
        if need > 0:
            req.page_ids.extend(self.allocator.alloc(need, owner=req.request_id).tolist())
        return drafts

    def _trim(self, req: Request) -> None:
        """Speculative rollback: free the pages beyond those of req's computed tokens (rejected drafts' slots)."""
        keep = max(_pages_for(req.num_computed_tokens, self.page_size), 1)
        if len(req.page_ids) > keep:
            extra = np.asarray(req.page_ids[keep:], dtype=np.int64)
            del req.page_ids[keep:]
            self.allocator.drop(req.request_id, extra)

    # ---- integrity --------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Allocator books balance, and each request holds exactly its own pages (running) or none."""
        self.allocator.check_integrity()
        cache_check = getattr(self.prefix_cache, "check_integrity", None)
        if cache_check is not None:
            cache_check()
        holders: dict[str, Request] = {r.request_id: r for r in self.running}
        holders |= {r.request_id: r for r in self.ready} | self.awaiting_kv | self.kept
        for rid, req in holders.items():
            held = np.sort(self.allocator.held_by(rid))
            if not np.array_equal(held, np.sort(np.asarray(req.page_ids, dtype=np.int64))):
                raise IntegrityError(
                    f"{rid}: allocator holds {held.tolist()} for it but it lists {sorted(req.page_ids)}"
                )
            lo = _pages_for(req.num_computed_tokens, self.page_size)
            hi = _pages_for(max(req.num_computed_tokens, req.num_prompt_tokens) + 1, self.page_size)
            if not lo <= len(req.page_ids) <= hi:
                raise IntegrityError(
                    f"{rid}: holds {len(req.page_ids)} pages for {req.num_computed_tokens} computed tokens "
                    f"(expected {lo}..{hi})"
                )
        for req in self.waiting:
            if req.page_ids or self.allocator.held_by(req.request_id).size or req.num_computed_tokens:
                raise IntegrityError(f"waiting request {req!r} holds pages")
        for owner in self.allocator.owners:
            if isinstance(owner, str) and owner not in holders:
                raise IntegrityError(
                    f"pages held by {owner!r}, which is not a running, ready, kept or WAITING_KV request"
                )
        for rid in self.unforked:
            if self.requests[rid].page_ids or self.allocator.held_by(rid).size:
                raise IntegrityError(f"sequence {rid} waiting to fork holds pages")
        queued = len(self.running) + len(self.waiting) + len(self.ready) + len(self.awaiting_kv) + len(self.unforked)
        if len(self.requests) != queued:
            raise IntegrityError(
                f"{len(self.requests)} unfinished requests but {len(self.running)} running + {len(self.waiting)} "
                f"waiting + {len(self.ready)} ready + {len(self.awaiting_kv)} waiting for KV"
            )


__all__ = [
    "DEFAULT_MAX_RUNNING",
    "IntArray",
    "NoFreePages",
    "PrefixCache",
    "PrefixMatch",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
]
