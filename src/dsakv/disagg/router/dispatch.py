"""The router's dispatch: place the request at the head of the queue on a prefill-decode pair.

    dispatcher = Dispatcher(book, peers, timeouts, lock)
    dispatcher.next()     one attempt for the head of the queue: None (queue empty), True (placed or finished),
                          False (back in the queue, or failed at its queue deadline)
    dispatcher.loop(stop, wake, beat)   the router's dispatch thread (beat() each turn: /health sees it stop)

A request whose placing raises (a value no worker takes, a bug) fails alone with an error naming it, and what
its attempt holds on the workers is aborted; the thread goes on with the next request.

One attempt (`place`), attempt id `rid#n` (lifecycle.attempt_id):
  1. `PeerTable.pick(prompt)`: a usable pair (none: try later);
  2. decode PREALLOC Prealloc -> Preallocated(pages, boot). NoFreePages: that decode is skipped for
     `busy_backoff`; a decode that does not answer is marked down; IncompatiblePeer: the pair is re-handshaken;
     any other refusal fails the request;
  3. the record goes DISPATCHED; prefill stage 0 SUBMIT Submit(pages, decode boot). A refusal aborts the decode's
     reservation; Unavailable / PeerUnavailable put the request back in the queue (a new attempt next time),
     anything else fails it.

Decode-first dispatch (the router asks the decode only and the decode submits to the prefill) is not built:
docs/architecture.md ("Dispatch") says why.
Imports dsakv.disagg.{rpc, messages, router_peers, router_requests}; no torch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from dsakv.config import Timeouts
from dsakv.disagg.protocol.errors import IncompatiblePeer, Unavailable
from dsakv.disagg.protocol.lifecycle import Phase, RouterRequest, attempt_id
from dsakv.disagg.protocol.messages import ABORT, PREALLOC, SUBMIT, Abort, Prealloc, Preallocated, Submit
from dsakv.disagg.protocol.rpc import PeerUnavailable, RpcError
from dsakv.disagg.router.peers import Choice, PeerTable
from dsakv.disagg.router.requests import RequestBook
from dsakv.errors import NoFreePages

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(self, book: RequestBook, peers: PeerTable, t: Timeouts, lock: threading.RLock) -> None:
        self.book, self.peers, self.t, self.lock = book, peers, t, lock

    def loop(self, stop: threading.Event, wake: threading.Event, beat: Callable[[], None] = lambda: None) -> None:
        """The dispatch thread: `beat()` once per turn (the router's /health reports a loop that stopped beating).
        A failure of one request fails that request alone (`next`); the loop goes on."""
        while not stop.is_set():
            beat()
            try:
                placed = self.next()
            except Exception:  # not one request's fault (next() fails those): log it, keep dispatching
                log.exception("router: dispatch turn failed")
                placed = False
            if placed is None:
                wake.wait(0.05)
                wake.clear()
            elif not placed:
                time.sleep(0.01 if len(self.book.queue) > 1 else 0.02)

    def next(self) -> bool | None:
        with self.lock:
            rid = self.book.queue.popleft() if self.book.queue else None
            req = self.book.get(rid) if rid is not None else None
        if rid is None:
            return None
        if req is None or req.phase is not Phase.QUEUED:
            return True
        try:
            placed = self.place(req)
        except Exception as e:  # one request's failure (a value no worker takes, a bug): it fails alone
            log.exception("router: placing request %s failed", req.rid)
            self._fail(req, f"request {req.rid}: the router could not dispatch it ({type(e).__name__}: {e})")
            return True
        if placed:
            return True
        with self.lock:
            if req.phase is Phase.QUEUED:
                if self.book.ledger.now() >= req.deadline:
                    self.book.finish(
                        req,
                        "error",
                        f"request {req.rid}: no prefill/decode pair could take it within "
                        f"{self.t.queue:g}s ({req.refusal or self.peers.why_no_pair()})",
                    )
                else:
                    self.book.queue.append(req.rid)
        return False

    def place(self, req: RouterRequest) -> bool:
        """One attempt to place `req`; True if it was dispatched (or finished), False to retry later."""
        choice = self.peers.pick(req.prompt)
        if choice is None:
            return False
        with self.lock:
            req.attempt += 1
            wire = attempt_id(req.rid, req.attempt)
        res = self._prealloc(req, choice, wire)
        if not isinstance(res, Preallocated):
            return res
        dec, pre = self.peers.decodes[choice.decode], self.peers.prefills[choice.prefill]
        try:
            with self.lock:
                if req.phase is not Phase.QUEUED:  # aborted meanwhile
                    self.peers.post((dec.addr, ABORT, Abort(wire, "aborted")))
                    return True
                self.book.dispatched(req, wire, dec, pre)
            refused = self._submit(req, choice, wire, res)
        except Exception:  # the decode holds pages for this attempt: free them before the request fails
            self.peers.post((dec.addr, ABORT, Abort(wire, "the router failed to dispatch it")))
            raise
        if refused is not None:
            return refused
        self.peers.sent(choice)
        with self.lock:
            if choice.reason == "affinity":
                self.book.stats.routed_affinity_total += 1
            else:
                self.book.stats.routed_load_total += 1
            self.book.stats.routed_matched_pages_total += choice.matched_pages
        return True

    def _fail(self, req: RouterRequest, why: str) -> None:
        """Fail `req` (every choice not finished yet) and free what an attempt of it holds on its workers."""
        with self.lock:
            if req.phase is Phase.DONE:
                return
            wire, decode, prefill, phase = req.wire, req.decode, req.prefill, req.phase
            self.book.finish(req, "error", why)
            self.book.stats.dispatch_errors_total += 1
        if wire is not None and decode is not None:
            self.peers.post((decode, ABORT, Abort(wire, why)))
            if prefill is not None and phase is Phase.DISPATCHED:
                self.peers.post((prefill, ABORT, Abort(wire, why)))

    def _prealloc(self, req: RouterRequest, choice: Choice, wire: str) -> Preallocated | bool:
        """The decode's reservation, or what `place` returns when there is none."""
        dec, pre = self.peers.decodes[choice.decode], self.peers.prefills[choice.prefill]
        try:
            return dec.client.request(
                PREALLOC,
                Prealloc(
                    rid=wire,
                    prompt_ids=req.prompt,
                    params=req.params,
                    prefill=pre.health.name if pre.health is not None else pre.addr,
                    num_stages=pre.num_stages,
                    kv_timeout=self.t.kv,
                ),
            )
        except PeerUnavailable as e:
            self.peers.mark_down(dec, str(e))
        except NoFreePages as e:
            dec.busy_until = time.monotonic() + self.t.busy_backoff
            req.refusal = str(e)
        except IncompatiblePeer:  # the prefill re-formed and has not handshaken again yet
            with self.lock:
                self.peers.pairs[(pre.addr, dec.addr)].ok = False
        except RpcError as e:
            with self.lock:
                self.book.finish(req, "error", f"decode {dec.addr} refused request {req.rid}: {e}")
            return True
        return False

    def _submit(self, req: RouterRequest, choice: Choice, wire: str, res: Preallocated) -> bool | None:
        """Prefill stage 0 SUBMIT: None once it took the request; if it refused, what `place` returns (True: the
        request failed, False: it goes back to the queue)."""
        d_addr, p_addr = choice.decode, choice.prefill
        pre = self.peers.prefills[p_addr]
        try:
            pre.client.request(
                SUBMIT,
                Submit(
                    rid=wire,
                    prompt_ids=req.prompt,
                    params=req.params,
                    seed=int(req.params.seed or 0),
                    decode=d_addr,
                    decode_boot=res.boot,
                    dst_pages=res.pages,
                    kv_timeout=self.t.kv,
                    grant=res.grant,
                ),
            )
            return None
        except RpcError as e:
            self.peers.post((d_addr, ABORT, Abort(wire, f"prefill {p_addr} refused it: {e}")))
            with self.lock:
                self.book.requeue(req)
                if not isinstance(e, (PeerUnavailable, Unavailable)):
                    self.book.finish(req, "error", f"prefill {p_addr} refused request {req.rid}: {e}")
                    return True
                self.book.stats.retries_total += 1
            if isinstance(e, PeerUnavailable):
                self.peers.mark_down(pre, str(e))
            else:
                with self.lock:
                    pre.ok, pre.error = False, str(e)
            return False
