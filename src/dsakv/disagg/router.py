"""RouterBackend: the GenerationBackend of disaggregated serving. Pairs a prefill and a decode per request.

    backend = RouterBackend(RouterConfig(prefill=("127.0.0.1:9200",), decode=("127.0.0.1:9100",)))
    backend.start(); backend.wait_ready(60)
    backend.submit("r1", prompt_ids, SamplingParams(max_new_tokens=16))
    for ev in backend.events("r1", timeout=60): ...      # TokenEvent(new_token_ids, finished, reason, error)

Per request (one dispatcher thread):
  1. pick a pair: a healthy decode and a healthy prefill that have handshaken (the health thread asks
     prefill.connect(decode) for every pair, again whenever a decode restarts or a prefill re-forms);
     the least loaded decode, then the prefill paired with it that caches most of the prompt, or the least
     loaded one when that saves under a page (rules: disagg/routing.py).
  2. decode PREALLOC Prealloc(rid#n, prompt, params, prefill, stages, kv_timeout) -> Preallocated(pages)
     (NoFreePages: the request waits in the router's queue, up to queue_timeout);
  3. prefill SUBMIT Submit(rid#n, prompt, decode, pages, kv_timeout); a refused submit (prefill down) aborts the
     decode reservation and tries again (a new attempt id rid#n+1, so late events of the old one are ignored).
  4. tokens come from decode EVENTS (one long-poll thread per decode, every request's events at once).
A decode that stops answering fails all its requests at once with an error naming it; everything else
(prefill stage loss, transfer timeouts, deadlines) is failed by the decode worker and arrives as an event.

Imports dsakv.disagg.{rpc, messages}, dsakv.engine.request and the serving contract dsakv.serve.backend
(TokenEvent; standard library only) -- no torch: a router process is light.
"""

from __future__ import annotations

import functools
import logging
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from dsakv.disagg.errors import IncompatiblePeer, Unavailable
from dsakv.disagg.lifecycle import ROUTER, Ledger, Phase, RouterRequest, attempt_id
from dsakv.disagg.messages import (
    ABORT,
    EVENTS,
    PREALLOC,
    SUBMIT,
    Abort,
    EventsQuery,
    Prealloc,
    Submit,
)
from dsakv.disagg.router_peers import PeerState, PeerTable
from dsakv.disagg.routing import AffinityRule
from dsakv.disagg.rpc import PeerUnavailable, RpcClient, RpcError
from dsakv.disagg.timeouts import Timeouts
from dsakv.engine.backend import TokenEvent
from dsakv.engine.request import SamplingParams
from dsakv.errors import CapacityError, ConfigError, NoFreePages

log = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 4096


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    kv_timeout: float = 30.0  # prefill + KV transfer of one request, from dispatch
    rpc_timeout: float = 5.0
    health_interval: float = 0.5
    queue_timeout: float = 60.0  # how long a request may wait for a free pair / decode pages
    poll_wait: float = 0.5
    connect_retry: float = 2.0  # seconds between handshake attempts of a pair that failed
    max_prompt_tokens: int | None = None
    seed: int | None = None
    affinity_min_gain_pages: int = 1  # prefix affinity only when it saves >= this many pages (disagg/routing.py)
    affinity_max_imbalance: int = 4  # ... and the affine prefill has <= this many more requests in flight

    @functools.cached_property
    def timeouts(self) -> Timeouts:
        return Timeouts(
            rpc=self.rpc_timeout,
            kv=self.kv_timeout,
            queue=self.queue_timeout,
            health_interval=self.health_interval,
            poll_wait=self.poll_wait,
            connect_retry=self.connect_retry,
        )

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ConfigError(
                f"a router needs at least one prefill and one decode worker (got prefill={list(self.prefill)}, "
                f"decode={list(self.decode)}): pass --prefill HOST:PORT and --decode HOST:PORT"
            )
        for v, name in ((self.kv_timeout, "kv_timeout"), (self.rpc_timeout, "rpc_timeout")):
            if v <= 0:
                raise ConfigError(f"{name} = {v} must be > 0 seconds")
        if self.affinity_min_gain_pages < 1:
            raise ConfigError(
                f"affinity_min_gain_pages = {self.affinity_min_gain_pages} must be >= 1 page "
                "(--affinity-min-gain-pages; a large value routes prefill by load only)"
            )
        if self.affinity_max_imbalance < 0:
            raise ConfigError(f"affinity_max_imbalance = {self.affinity_max_imbalance} must be >= 0 requests")


class RouterBackend:
    name = "disaggregated"

    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.t = t = cfg.timeouts
        self._lock = threading.RLock()
        rule = AffinityRule(cfg.affinity_min_gain_pages, cfg.affinity_max_imbalance)
        self.peers = PeerTable(cfg.prefill, cfg.decode, t, self._lock, on_decode_down=self._decode_down, rule=rule)
        self.decodes, self.prefills, self.pairs = self.peers.decodes, self.peers.prefills, self.peers.pairs
        self._reqs: Ledger[RouterRequest] = Ledger(ROUTER, clock, keep_done=True)  # done: until its events are read
        self._by_wire: dict[str, RouterRequest] = {}
        self._queue: deque[str] = deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._rng = random.Random(cfg.seed)
        self.counters = dict.fromkeys(
            (
                "requests_total",
                "finished_total",
                "failed_total",
                "aborted_total",
                "retries_total",
                "tokens_total",
                "routed_affinity_total",
                "routed_load_total",
                "routed_matched_pages_total",
            ),
            0,
        )

    # ---- lifetime ------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self.poll_health()
        targets = [(self._health_loop, "router-health"), (self._dispatch_loop, "router-dispatch")]
        targets += [(self.peers.side_loop, "router-side")]
        for addr in self.decodes:
            targets.append((functools.partial(self._events_loop, addr), f"router-events-{addr}"))
        for fn, name in targets:
            t = threading.Thread(target=fn, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        with self._lock:
            live = self._live()
        for r in live:
            self.abort(r.rid)
        self.peers.stop_side()
        for t in self._threads:
            t.join(timeout=self.t.rpc + 1)
        self.peers.close()

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """True once at least one prefill-decode pair is handshaken (False after `timeout`)."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.peers.usable_pairs():
                return True
            time.sleep(0.05)
        return False

    # ---- GenerationBackend ----------------------------------------------------------------------------

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        if not prompt_ids:
            raise ConfigError(f"request {request_id}: the prompt is empty: give at least one token id")
        bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or t < 0]
        if bad:
            raise ConfigError(f"request {request_id}: prompt token(s) {bad[:8]} are not token ids (integers >= 0)")
        limit = self.max_prompt_tokens()
        if len(prompt_ids) > limit:
            raise CapacityError(
                f"request {request_id}: the prompt has {len(prompt_ids)} tokens but the decode workers take at most "
                f"{limit}: shorten the prompt"
            )
        with self._lock:
            caps = [p.health.capacity_tokens for p in self.decodes.values() if p.health is not None]
        total = len(prompt_ids) + params.max_new_tokens
        if caps and total > max(caps):
            raise CapacityError(
                f"request {request_id}: prompt of {len(prompt_ids)} tokens + max_new_tokens {params.max_new_tokens} "
                f"= {total} tokens can never fit a decode worker's KV pool (largest: {max(caps)} tokens): shorten "
                "the prompt or lower max_new_tokens"
            )
        if params.seed is None and not params.greedy:
            params = replace(params, seed=self._rng.getrandbits(63))  # prefill and decode must draw alike
        with self._lock:
            if request_id in self._reqs:
                raise ConfigError(f"request id {request_id!r} is already in use: give each request a unique id")
            req = self._reqs.add(RouterRequest(rid=request_id, prompt=list(prompt_ids), params=params))
            req.t_submit = req.since
            req.deadline = req.since + self.t.queue
            self._queue.append(request_id)
            self.counters["requests_total"] += 1
        self._wake.set()

    def events(self, request_id: str, timeout: float) -> Iterator[TokenEvent]:
        with self._lock:
            req = self._reqs.get(request_id)
        if req is None:
            raise ConfigError(f"unknown request id {request_id!r}")
        return self._iter_events(req, timeout)

    def _iter_events(self, req: RouterRequest, timeout: float) -> Iterator[TokenEvent]:
        while True:
            try:
                ev = req.q.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(
                    f"request {req.rid}: no token within {timeout:g}s (state {req.phase.value}, decode {req.decode}, "
                    f"prefill {req.prefill})"
                ) from None
            yield ev
            if ev.finished:
                with self._lock:
                    self._reqs.pop(req.rid)
                return

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._reqs.get(request_id)
            if req is None or req.phase is Phase.DONE:
                return
            wire, decode, prefill, phase = req.wire, req.decode, req.prefill, req.phase
            self._finish(req, "abort", None)
            self.counters["aborted_total"] += 1
        if wire is not None and decode is not None:
            self.peers.post((decode, ABORT, Abort(wire, "aborted by the client")))
            if prefill is not None and phase is Phase.DISPATCHED:
                self.peers.post((prefill, ABORT, Abort(wire, "aborted by the client")))

    def record(self, request_id: str) -> RouterRequest | None:
        """The router's lifecycle record of a request (read it, do not change it); None once its events were read."""
        with self._lock:
            return self._reqs.get(request_id)

    def health(self) -> dict[str, Any]:
        with self._lock:
            pairs = self.peers.usable_pairs()
            used = sum(p.health.pages_used for p in self.decodes.values() if p.ok and p.health is not None)
            total = sum(p.health.pages_total for p in self.decodes.values() if p.ok and p.health is not None)
            return {
                "ok": bool(pairs),
                "backend": self.name,
                "pages_used": used,
                "pages_total": total,
                "in_flight": len(self._live()),
                "queued": len(self._queue),
                "routing": {
                    "decode": "fewest in flight, then most free pages, then fewest running + waiting",
                    "prefill": "prefix affinity, else fewest in flight (disagg/routing.py)",
                    "affinity_min_gain_pages": self.peers.rule.min_gain_pages,
                    "affinity_max_imbalance": self.peers.rule.max_imbalance,
                },
                "decode": [self.peers.view(p) for p in self.decodes.values()],
                "prefill": [self.peers.view(p) for p in self.prefills.values()],
                "pairs": [
                    {"prefill": p, "decode": d, "ok": s.ok, "error": s.error, "skipped": s.skipped}
                    for (p, d), s in self.pairs.items()
                ],
            }

    def metrics(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = {k: float(v) for k, v in self.counters.items()}
            out["router_in_flight"] = float(len(self._live()))
            out["router_queued"] = float(len(self._queue))
            out["decode_workers_up"] = float(sum(p.ok for p in self.decodes.values()))
            out["prefill_workers_up"] = float(sum(p.ok for p in self.prefills.values()))
            out["pairs_ready"] = float(len(self.peers.usable_pairs()))
            healths = [p.health for p in self.decodes.values() if p.health is not None]
            out["pool_pages_total"] = float(sum(h.pages_total for h in healths))
            out["pool_pages_used"] = float(sum(h.pages_used for h in healths))
            out["pool_pages_free"] = out["pool_pages_total"] - out["pool_pages_used"]
            return out

    def max_prompt_tokens(self) -> int:
        if self.cfg.max_prompt_tokens is not None:
            return self.cfg.max_prompt_tokens
        with self._lock:
            caps = [
                p.health.max_prompt_tokens
                for p in self.decodes.values()
                if p.health is not None and p.health.max_prompt_tokens is not None
            ]
            caps += [p.health.capacity_tokens - 1 for p in self.prefills.values() if p.health is not None]
        return min(caps) if caps else DEFAULT_MAX_PROMPT_TOKENS

    # ---- bookkeeping -------------------------------------------------------------------------------------

    def _live(self) -> list[RouterRequest]:
        return self._reqs.in_phase(Phase.QUEUED, Phase.DISPATCHED, Phase.DECODING)

    def _push(
        self, req: RouterRequest, tokens: list[int], finished: bool, reason: str | None, error: str | None
    ) -> None:
        if req.phase is Phase.DONE:
            return
        if tokens:
            req.tokens += len(tokens)
            self.counters["tokens_total"] += len(tokens)
            if req.t_first is None:
                req.t_first = time.monotonic()
        if finished:
            self._release_slot(req)
            self._reqs.move(req, Phase.DONE, error)
            if reason == "error":
                self.counters["failed_total"] += 1
            elif reason != "abort":
                self.counters["finished_total"] += 1
        req.q.put(TokenEvent(tuple(tokens), finished, reason, error))

    def _finish(self, req: RouterRequest, reason: str, error: str | None) -> None:
        self._push(req, [], True, reason, error)

    def _release_slot(self, req: RouterRequest) -> None:
        if req.wire is not None:
            self._by_wire.pop(req.wire, None)
        if req.decode is not None and req.decode in self.decodes and req.phase in (Phase.DISPATCHED, Phase.DECODING):
            self.decodes[req.decode].inflight -= 1
        if req.prefill is not None and req.prefill in self.prefills and req.phase is Phase.DISPATCHED:
            self.prefills[req.prefill].inflight -= 1

    # ---- dispatch ----------------------------------------------------------------------------------------

    def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            placed = self.dispatch_next()
            if placed is None:
                self._wake.wait(0.05)
                self._wake.clear()
            elif not placed:
                time.sleep(0.01 if len(self._queue) > 1 else 0.02)

    def dispatch_next(self) -> bool | None:
        """One dispatch attempt for the request at the head of the queue: None if the queue is empty, True if it
        was placed (or finished), False if it went back to the queue (or failed at its queue deadline)."""
        with self._lock:
            rid = self._queue.popleft() if self._queue else None
            req = self._reqs.get(rid) if rid is not None else None
        if rid is None:
            return None
        if req is None or req.phase is not Phase.QUEUED:
            return True
        if self._dispatch(req):
            return True
        with self._lock:
            if req.phase is Phase.QUEUED:
                if self._reqs.now() >= req.deadline:
                    self._finish(
                        req,
                        "error",
                        f"request {req.rid}: no prefill/decode pair could take it within "
                        f"{self.t.queue:g}s ({self.peers.why_no_pair()})",
                    )
                else:
                    self._queue.append(req.rid)
        return False

    def _dispatch(self, req: RouterRequest) -> bool:
        """One attempt to place `req`; True if it was dispatched (or finished), False to retry later."""
        choice = self.peers.pick(req.prompt)
        if choice is None:
            return False
        p_addr, d_addr = choice.prefill, choice.decode
        dec, pre = self.decodes[d_addr], self.prefills[p_addr]
        with self._lock:
            req.attempt += 1
            wire = attempt_id(req.rid, req.attempt)
        try:
            res = dec.client.request(
                PREALLOC,
                Prealloc(
                    rid=wire,
                    prompt_ids=req.prompt,
                    params=req.params,
                    prefill=pre.health.name if pre.health is not None else p_addr,
                    num_stages=pre.num_stages,
                    kv_timeout=self.t.kv,
                ),
            )
        except PeerUnavailable as e:
            self.peers.mark_down(dec, str(e))
            return False
        except NoFreePages:
            dec.busy_until = time.monotonic() + self.t.busy_backoff
            return False
        except IncompatiblePeer:  # the prefill re-formed and has not handshaken again yet
            with self._lock:
                self.pairs[(p_addr, d_addr)].ok = False
            return False
        except RpcError as e:
            with self._lock:
                self._finish(req, "error", f"decode {d_addr} refused request {req.rid}: {e}")
            return True
        with self._lock:
            if req.phase is not Phase.QUEUED:  # aborted meanwhile
                self.peers.post((d_addr, ABORT, Abort(wire, "aborted")))
                return True
            req.wire, req.decode, req.prefill = wire, d_addr, p_addr
            self._reqs.move(req, Phase.DISPATCHED)
            self._by_wire[wire] = req
            dec.inflight += 1
            pre.inflight += 1
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
                ),
            )
        except RpcError as e:
            self.peers.post((d_addr, ABORT, Abort(wire, f"prefill {p_addr} refused it: {e}")))
            with self._lock:
                if req.phase is Phase.DISPATCHED:
                    self._release_slot(req)
                    req.wire, req.decode, req.prefill = None, None, None
                    self._reqs.move(req, Phase.QUEUED)
                retry = isinstance(e, (PeerUnavailable, Unavailable))
                if not retry:
                    self._finish(req, "error", f"prefill {p_addr} refused request {req.rid}: {e}")
                    return True
                self.counters["retries_total"] += 1
            if isinstance(e, PeerUnavailable):
                self.peers.mark_down(pre, str(e))
            else:
                with self._lock:
                    pre.ok, pre.error = False, str(e)
            return False
        self.peers.sent(choice)
        with self._lock:
            self.counters[f"routed_{choice.reason}_total"] += 1
            self.counters["routed_matched_pages_total"] += choice.matched_pages
        return True

    # ---- events ---------------------------------------------------------------------------------------------

    def _events_loop(self, addr: str) -> None:
        client = RpcClient(addr, timeout=self.t.poll_wait + self.t.rpc)
        while not self._stop.is_set():
            if not self.poll_events(addr, client, self.t.poll_wait):
                self._stop.wait(0.05)

    def poll_events(self, addr: str, client: RpcClient, wait: float) -> bool:
        """One long-poll of decode `addr`'s events (resynchronising its cursor first after a restart); the
        events go to their requests. False if nothing could be asked (the decode is down or failed)."""
        dec = self.decodes[addr]
        if not dec.ok:
            return False
        try:
            if not dec.ready:
                res = client.request(EVENTS, EventsQuery(since=1 << 62, wait=0))
                with self._lock:
                    self._fail_decode_requests(dec, f"decode {addr} restarted: its requests were lost")
                    if res.boot == dec.boot:  # the same process came back: free what it still runs
                        for wire in dec.orphans:
                            self.peers.post((addr, ABORT, Abort(wire, "failed by the router")))
                    dec.orphans.clear()
                    dec.boot, dec.cursor, dec.ready = res.boot, res.cursor, True
                return True
            res = client.request(EVENTS, EventsQuery(since=dec.cursor, wait=wait))
        except PeerUnavailable as e:
            self.peers.mark_down(dec, str(e))
            return False
        except RpcError as e:
            log.warning("router: events from %s failed: %s", addr, e)
            self._stop.wait(0.05)
            return False
        with self._lock:
            if res.boot != dec.boot:
                dec.ready = False
                return True
            for ev in res.events:
                req = self._by_wire.get(ev.rid)
                if req is None or req.decode != addr:
                    continue
                if req.phase is Phase.DISPATCHED:
                    pre = self.prefills.get(req.prefill or "")
                    if pre is not None:
                        pre.inflight -= 1
                    self._reqs.move(req, Phase.DECODING)
                self._push(req, ev.tokens, ev.finished, ev.reason, ev.error)
            dec.cursor = res.cursor
        return True

    def _fail_decode_requests(self, dec: PeerState, why: str) -> None:
        for req in list(self._by_wire.values()):
            if req.decode == dec.addr and req.phase in (Phase.DISPATCHED, Phase.DECODING):
                if req.wire is not None:
                    dec.orphans.append(req.wire)
                self._finish(req, "error", f"request {req.rid}: {why}")

    # ---- health -------------------------------------------------------------------------------------------

    def _health_loop(self) -> None:
        while not self._stop.wait(self.t.health_interval):
            try:
                self.peers.poll_health()
            except Exception:
                log.exception("router: health poll failed")

    def poll_health(self) -> None:
        """Ask every worker's health; pair (CONNECT) every healthy prefill with every healthy decode."""
        self.peers.poll_health()

    def _decode_down(self, dec: PeerState, why: str) -> None:
        self._fail_decode_requests(dec, f"decode {dec.addr} is unavailable ({why})")

    def drain_side(self) -> int:
        """Send the best-effort RPCs queued now (aborts), here; returns how many (the side thread does this)."""
        return self.peers.drain_side()

    __all__ = ["RouterBackend", "RouterConfig", "TokenEvent"]
