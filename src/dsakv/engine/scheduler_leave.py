"""The scheduler's leaving and after-step book (a mixin of engine.scheduler.Scheduler): a request leaves
(finish, preemption: pages to the prefix cache, then its references), n > 1 sequences fork or orphan, and the
step's tokens advance (update, update_spec) or its rows fail (fail, fail_rows)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from dsakv.cache.allocator import IntegrityError
from dsakv.engine.request import FinishReason, Request, RequestStatus
from dsakv.engine.sampling import stop_reason
from dsakv.engine.scheduler_types import SchedulerOutput, SchedulerState

log = logging.getLogger("dsakv.engine.scheduler")


class SchedulerLeaving(SchedulerState):
    """Reads the books SchedulerState declares."""

    if TYPE_CHECKING:

        def _trim(self, req: Request) -> None: ...

    # ---- leaving -----------------------------------------------------------------------------

    def _leave(self, req: Request, *, keep_in_cache: bool) -> None:
        """Give back everything `req` holds: computed whole pages to the prefix cache, then its references."""
        if self.prefix_cache is not None:
            full = req.num_computed_tokens // self.page_size
            if keep_in_cache and full:
                self.prefix_cache.insert(
                    req.token_ids(0, full * self.page_size), np.asarray(req.page_ids[:full], dtype=np.int64)
                )
            if req.prefix_match is not None:
                self.prefix_cache.release(req.prefix_match)
        self.allocator.release(req.request_id)
        req.page_ids = []
        req.prefix_match = None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._leave(req, keep_in_cache=True)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.kv_from_peer = False  # it recomputes its own KV from now on
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        log.info("preempted %s: out of KV pages (%d free)", req.request_id, self.allocator.num_free)

    def _fork(self, req: Request) -> None:
        """req (sequence 0 of an n > 1 request) computed its prompt: its other sequences start running on its
        whole prompt pages (a reference each), short of the page that holds the prompt's last token (each
        recomputes that part in its own page, so the last prompt token's logits are its own)."""
        share = (req.num_prompt_tokens - 1) // self.page_size
        pages = np.asarray(req.page_ids[:share], dtype=np.int64)
        for f in req.forks:
            del self.unforked[f.request_id]
            if pages.size:
                self.allocator.incref(pages)
                self.allocator.hold(f.request_id, pages)
            f.page_ids = pages.tolist()
            f.num_computed_tokens = share * self.page_size
            f.status = RequestStatus.RUNNING
            self.running.append(f)
        log.debug("%s: %d sequences share %d prompt pages", req.request_id, len(req.forks) + 1, share)
        req.forks = []

    def _orphan_forks(self, req: Request) -> None:
        """req leaves before its prompt was computed: its other sequences queue as requests of their own."""
        for f in req.forks:
            del self.unforked[f.request_id]
            self.waiting.append(f)
        req.forks = []

    def _finish(self, req: Request, reason: FinishReason, error: str | None = None) -> None:
        if req in self.running:
            self.running.remove(req)
        self._orphan_forks(req)
        del self.requests[req.request_id]
        if req.keep_pages and reason in (FinishReason.STOP, FinishReason.LENGTH):
            self.kept[req.request_id] = req
        else:
            self._leave(req, keep_in_cache=reason is not FinishReason.ERROR)
        req.finish(reason, error)

    # ---- after the model step ------------------------------------------------------------------

    def update(self, out: SchedulerOutput, next_tokens: Sequence[int | None]) -> list[Request]:
        """Advance every scheduled request; next_tokens[i] is the token sampled for chunk i (None if it did not
        sample). Returns the requests that got a new token (finished ones included)."""
        if len(next_tokens) != len(out.chunks):
            raise ValueError(f"update: {len(next_tokens)} tokens for {len(out.chunks)} scheduled chunks")
        got = []
        for chunk, tok in zip(out.chunks, next_tokens, strict=True):
            req = chunk.request
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens != chunk.start:
                raise IntegrityError(f"update: {req!r} changed while its chunk {chunk.start}..{chunk.end} ran")
            req.num_computed_tokens = chunk.end
            if not chunk.samples:
                continue
            if tok is None:
                raise ValueError(f"update: no token for {req.request_id}, whose chunk reached its last token")
            if req.forks:
                self._fork(req)
            req.output_ids.append(int(tok))
            got.append(req)
            reason = stop_reason(req, int(tok), self.max_seq_len)
            if reason is not None:
                self._finish(req, reason)
        return got

    def update_spec(self, out: SchedulerOutput, tokens: Sequence[Sequence[int]]) -> list[Request]:
        """Speculative update: tokens[i] are the tokens chunk i produced (empty if it did not sample; for a decode
        chunk with drafts, its accepted drafts then the target's token). The KV of the chunk's tokens and of the
        accepted drafts stays (num_computed_tokens advances by num_tokens + accepted); rejected drafts' pages are
        freed. A stop in the middle drops the tokens after it. Returns the requests that got tokens."""
        if len(tokens) != len(out.chunks):
            raise ValueError(f"update_spec: {len(tokens)} token lists for {len(out.chunks)} scheduled chunks")
        got = []
        for chunk, toks in zip(out.chunks, tokens, strict=True):
            req = chunk.request
            if req.status is not RequestStatus.RUNNING or req.num_computed_tokens != chunk.start:
                raise IntegrityError(f"update_spec: {req!r} changed while its chunk {chunk.start}..{chunk.end} ran")
            if not chunk.samples:
                if toks:
                    raise ValueError(f"update_spec: tokens for {req.request_id}, whose chunk did not sample")
                req.num_computed_tokens = chunk.end
                continue
            if not 1 <= len(toks) <= chunk.num_draft + 1:
                raise ValueError(
                    f"update_spec: {len(toks)} tokens for {req.request_id}, whose chunk verified "
                    f"{chunk.num_draft} drafts"
                )
            reason = None
            appended = 0
            for tok in toks:
                req.output_ids.append(int(tok))
                appended += 1
                reason = stop_reason(req, int(tok), self.max_seq_len)
                if reason is not None:
                    break
            req.num_computed_tokens = chunk.end + appended - 1
            got.append(req)
            if reason is not None:
                self._finish(req, reason)
            else:
                self._trim(req)
        return got

    def fail(self, out: SchedulerOutput, error: str) -> list[Request]:
        """The model step for `out` failed: finish its requests with reason 'error' and free their pages."""
        failed = []
        for chunk in out.chunks:
            req = chunk.request
            if req.status is RequestStatus.RUNNING:
                self._finish(req, FinishReason.ERROR, error)
                failed.append(req)
        return failed

    def fail_rows(self, out: SchedulerOutput, errors: dict[int, str]) -> tuple[SchedulerOutput, list[Request]]:
        """One row's failure (its logits, penalties, sampling, logprobs, admission) fails that request alone:
        chunk i of `out` with errors[i] finishes with reason 'error' and frees its pages (none go to the prefix
        cache); returns `out` without those chunks (the rest of the step goes on) and the failed requests."""
        failed = []
        for i, error in sorted(errors.items()):
            req = out.chunks[i].request
            if req.status is RequestStatus.RUNNING:
                self._finish(req, FinishReason.ERROR, error)
                failed.append(req)
        kept = [c for i, c in enumerate(out.chunks) if i not in errors]
        return SchedulerOutput(kept, out.preempted), failed
