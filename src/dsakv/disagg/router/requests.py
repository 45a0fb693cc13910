"""The router's requests: one lifecycle record each (a ROUTER Ledger), the dispatch queue, the attempt ids in
flight, the counters, and the token stream the client reads.

    book = RequestBook(peers, lock, clock, queue_timeout)
    req = book.add(rid, prompt, params)       QUEUED, deadline = now + queue_timeout, queued for dispatch
    book.dispatched(req, wire, decode, prefill)  DISPATCHED: the attempt id maps to it, both workers count it
    book.requeue(req)                         back to QUEUED (the prefill refused the submit: tried again)
    book.decoding(req)                        the first decode event: the prefill is done with it
    book.push(req, tokens, finished, reason, error, choice, row)   one choice's tokens (+ the decode's
                                              logprobs); all params.n finished -> DONE, slots released
    book.fail_decode(dec, why)                every request on that decode fails at once
    book.stream(req, timeout)                 the client's TokenEvents (the record goes once it has finished)

Every method is called with `lock` held (it is the router's lock, shared with the PeerTable), except `stream`.
Imports dsakv.disagg.{lifecycle, messages, router_peers} and the serving contract; no torch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from dsakv.disagg.protocol.lifecycle import ROUTER, Ledger, Phase, RouterRequest
from dsakv.disagg.protocol.messages import EventRow, unpack_logprobs
from dsakv.disagg.router.peers import PeerState, PeerTable
from dsakv.engine.backend import TokenEvent
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.util.stats import Stats


@dataclass
class RouterStats(Stats):
    """The router's counters, by these names in its /metrics (dsakv_<name>) and RouterBackend.counters."""

    requests_total: int = 0
    finished_total: int = 0
    failed_total: int = 0
    aborted_total: int = 0
    retries_total: int = 0
    tokens_total: int = 0
    routed_affinity_total: int = 0  # the prefill was chosen for the prompt pages it caches
    routed_load_total: int = 0  # ... for its load
    routed_matched_pages_total: int = 0
    dispatch_errors_total: int = 0
    event_errors_total: int = 0


class RequestBook:
    def __init__(
        self, peers: PeerTable, lock: threading.RLock, clock: Callable[[], float], queue_timeout: float
    ) -> None:
        self.peers = peers
        self.lock = lock
        self.queue_timeout = queue_timeout
        self.ledger: Ledger[RouterRequest] = Ledger(ROUTER, clock, keep_done=True)  # done: until its events are read
        self.by_wire: dict[str, RouterRequest] = {}
        self.queue: deque[str] = deque()
        self.stats = RouterStats()

    def add(self, rid: str, prompt: list[int], params: SamplingParams) -> RouterRequest:
        if rid in self.ledger:
            raise ConfigError(f"request id {rid!r} is already in use: give each request a unique id")
        req = self.ledger.add(RouterRequest(rid=rid, prompt=list(prompt), params=params))
        req.t_submit = req.since
        req.deadline = req.since + self.queue_timeout
        self.queue.append(rid)
        self.stats.requests_total += 1
        return req

    def get(self, rid: str) -> RouterRequest | None:
        return self.ledger.get(rid)

    def live(self) -> list[RouterRequest]:
        return self.ledger.in_phase(Phase.QUEUED, Phase.DISPATCHED, Phase.DECODING)

    # ---- transitions --------------------------------------------------------------------------------

    def dispatched(self, req: RouterRequest, wire: str, decode: PeerState, prefill: PeerState) -> None:
        req.wire, req.decode, req.prefill = wire, decode.addr, prefill.addr
        self.ledger.move(req, Phase.DISPATCHED)
        self.by_wire[wire] = req
        decode.inflight += 1
        prefill.inflight += 1

    def requeue(self, req: RouterRequest) -> None:
        """Undo `dispatched` (the prefill refused the submit); the caller puts it back in the queue or fails it."""
        if req.phase is Phase.DISPATCHED:
            self._release_slot(req)
            req.wire, req.decode, req.prefill = None, None, None
            self.ledger.move(req, Phase.QUEUED)

    def decoding(self, req: RouterRequest) -> None:
        if req.phase is Phase.DISPATCHED:
            pre = self.peers.prefills.get(req.prefill or "")
            if pre is not None:
                pre.inflight -= 1
            self.ledger.move(req, Phase.DECODING)

    def push(
        self,
        req: RouterRequest,
        tokens: list[int],
        finished: bool,
        reason: str | None,
        error: str | None,
        choice: int = 0,
        row: EventRow | None = None,
    ) -> None:
        """Hand one choice's event to the client; the request is DONE once all params.n choices finished. `row`:
        the decode's event (its logprobs, prompt logprobs, the prefill's cache hit)."""
        if req.phase is Phase.DONE or choice in req.done or not 0 <= choice < req.params.n:
            return
        if tokens:
            req.tokens += len(tokens)
            self.stats.tokens_total += len(tokens)
            if req.t_first is None:
                req.t_first = time.monotonic()
        if finished:
            req.done.add(choice)
        if len(req.done) == req.params.n:
            if req.phase is Phase.QUEUED and req.rid in self.queue:  # not left for the dispatcher to skip later:
                self.queue.remove(req.rid)  # /health's "queued" counts only requests that still wait
            self._release_slot(req)
            self.ledger.move(req, Phase.DONE, error)
            if reason == "error":
                self.stats.failed_total += 1
            elif reason != "abort":
                self.stats.finished_total += 1
        lps = unpack_logprobs(row.logprobs) if row is not None else None
        plps = unpack_logprobs(row.prompt_logprobs) if row is not None else None
        cached = row.cached_tokens if row is not None else 0
        req.q.put(TokenEvent(tuple(tokens), finished, reason, error, lps or (), plps, choice, cached))

    def finish(self, req: RouterRequest, reason: str, error: str | None) -> None:
        """Every choice not finished yet ends with `reason`."""
        for i in range(req.params.n):
            if i not in req.done:
                self.push(req, [], True, reason, error, i)

    def fail_decode(self, dec: PeerState, why: str) -> None:
        """Fail every request dispatched to `dec`; their attempt ids become its orphans (aborted once it is back)."""
        for req in list(self.by_wire.values()):
            if req.decode == dec.addr and req.phase in (Phase.DISPATCHED, Phase.DECODING):
                if req.wire is not None:
                    dec.orphans.append(req.wire)
                self.finish(req, "error", f"request {req.rid}: {why}")

    def _release_slot(self, req: RouterRequest) -> None:
        if req.wire is not None:
            self.by_wire.pop(req.wire, None)
        decodes, prefills = self.peers.decodes, self.peers.prefills
        if req.decode is not None and req.decode in decodes and req.phase in (Phase.DISPATCHED, Phase.DECODING):
            decodes[req.decode].inflight -= 1
        if req.prefill is not None and req.prefill in prefills and req.phase is Phase.DISPATCHED:
            prefills[req.prefill].inflight -= 1

    # ---- the client's side -------------------------------------------------------------------------

    def stream(self, req: RouterRequest, timeout: float) -> Iterator[TokenEvent]:
        """The request's events; TimeoutError if none comes within `timeout`. Call without the lock."""
        done: set[int] = set()
        while True:
            try:
                ev = req.q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"request {req.rid}: no token within {timeout:g}s (state {req.phase.value}, decode {req.decode}, "
                    f"prefill {req.prefill})"
                ) from None
            if ev.finished:
                done.add(ev.choice)
            last = len(done) >= req.params.n  # every choice finished: the record goes before the reader sees it
            if last:  # (a reader stops at the last event and never resumes this generator)
                with self.lock:
                    self.ledger.pop(req.rid)
            yield ev
            if last:
                return
