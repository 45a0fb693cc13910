"""RouterBackend: the GenerationBackend of disaggregated serving. Pairs a prefill and a decode per request.

    backend = RouterBackend(RouterConfig(prefill=("127.0.0.1:9200",), decode=("127.0.0.1:9100",)))
    backend.start(); backend.wait_ready(60)
    backend.submit("r1", prompt_ids, SamplingParams(max_new_tokens=16))
    for ev in backend.events("r1", timeout=60): ...      # TokenEvent(new_token_ids, finished, reason, error)

The parts, sharing the router's one lock: PeerTable (router_peers: workers, pairs, side RPCs), RequestBook
(router_requests: records, queue, counters, token streams), Dispatcher (router_dispatch) and one EventPoller
thread per decode (router_events). This class checks requests, runs the threads, and reports health/metrics.

Per request (one dispatcher thread):
  1. pick a pair: a healthy decode and a healthy prefill that have handshaken (the health thread asks
     prefill.connect(decode) for every pair, again whenever a decode restarts or a prefill re-forms);
     the least loaded decode, then the prefill paired with it that caches most of the prompt, or the least
     loaded one when that saves under a page (rules: disagg/router/routing.py).
  2. decode PREALLOC Prealloc(rid#n, prompt, params, prefill, stages, kv_timeout) -> Preallocated(pages)
     (NoFreePages: the request waits in the router's queue, up to queue_timeout);
  3. prefill SUBMIT Submit(rid#n, prompt, decode, pages, kv_timeout); a refused submit (prefill down) aborts the
     decode reservation and tries again (a new attempt id rid#n+1, so late events of the old one are ignored).
  4. tokens come from decode EVENTS (one long-poll thread per decode, every request's events at once).
A decode that stops answering fails all its requests at once with an error naming it; everything else
(prefill stage loss, transfer timeouts, deadlines) is failed by the decode worker and arrives as an event.

Imports dsakv.disagg.{rpc, messages, router_*}, dsakv.config (RouterConfig), dsakv.engine.request and the serving
contract dsakv.engine.backend (TokenEvent; standard library only) -- no torch: a router process is light.
"""

from __future__ import annotations

import functools
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from dsakv.config import RouterConfig
from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.errors import MessageError
from dsakv.disagg.protocol.lifecycle import Phase, RouterRequest
from dsakv.disagg.protocol.messages import ABORT, Abort, Prealloc
from dsakv.disagg.protocol.rpc import RpcClient
from dsakv.disagg.router.dispatch import Dispatcher
from dsakv.disagg.router.events import EventPoller
from dsakv.disagg.router.peers import PeerState, PeerTable
from dsakv.disagg.router.requests import RequestBook
from dsakv.disagg.router.routing import AffinityRule
from dsakv.disagg.router.stage_views import decode_stage_metrics
from dsakv.engine.backend import FEATURES, TokenEvent
from dsakv.engine.request import SamplingParams
from dsakv.errors import CapacityError, ConfigError

log = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 4096


class RouterBackend:
    """The router process's backend: a PeerTable (workers, pairs, side RPCs), a RequestBook (the requests and
    their token streams), a Dispatcher (queue -> pair) and an EventPoller per decode (decode events -> tokens),
    sharing one lock. This class checks what a client sends, runs the threads and reports health/metrics."""

    name = "disaggregated"

    def __init__(self, cfg: RouterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.t = t = cfg.timeouts
        self._lock = threading.RLock()
        rule = AffinityRule(cfg.affinity_min_gain_pages, cfg.affinity_max_imbalance)
        self.peers = PeerTable(
            cfg.prefill, cfg.decode, t, self._lock, on_decode_down=self._decode_down, rule=rule,
            on_new_decode=self._new_decode,
        )  # fmt: skip
        self.decodes, self.prefills, self.pairs = self.peers.decodes, self.peers.prefills, self.peers.pairs
        self.book = RequestBook(self.peers, self._lock, clock, t.queue)
        self.stats = self.book.stats
        self.dispatcher = Dispatcher(self.book, self.peers, t, self._lock)
        self.poller = EventPoller(self.book, self.peers, t, self._lock)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._events_started: set[str] = set()  # decodes with an events loop
        self._rng = random.Random(cfg.seed)
        self._clock = clock
        self._beats: dict[str, float] = {}  # serving loop (thread name) -> clock() at its last turn
        # a loop that has not turned for this long is stuck: its longest turn is two control RPCs (dispatch) or
        # one long poll (events), each bounded by the RPC timeout
        self.stuck_after = 3 * t.rpc + t.poll_wait + 5.0

    @property
    def counters(self) -> dict[str, int]:
        """The router's counters by name (RouterStats.as_dict(): what /metrics shows as dsakv_<name>)."""
        with self._lock:
            return self.stats.as_dict()

    # ---- lifetime ------------------------------------------------------------------------------

    def start(self) -> None:
        with self._lock:
            if self._started:
                return
            self._started = True
        self.poll_health()
        targets: list[tuple[Callable[[], None], str]] = [
            (self._health_loop, "router-health"),
            (
                functools.partial(self.dispatcher.loop, self._stop, self._wake, self._beater("router-dispatch")),
                "router-dispatch",
            ),
            (self.peers.side_loop, "router-side"),
        ]
        with self._lock:
            addrs = [a for a in self.decodes if a not in self._events_started]  # (a DP rank found above: started)
            self._events_started.update(addrs)
        for addr in addrs:
            name = f"router-events-{addr}"
            targets.append((functools.partial(self.poller.loop, addr, self._stop, self._beater(name)), name))
        for fn, name in targets:
            self._thread(fn, name)

    def _thread(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def _new_decode(self, addr: str) -> None:
        """A decode found in another's health (a DP rank): its events loop, once the router runs."""
        with self._lock:
            if not self._started or addr in self._events_started:
                return
            self._events_started.add(addr)
        name = f"router-events-{addr}"
        self._thread(functools.partial(self.poller.loop, addr, self._stop, self._beater(name)), name)

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        with self._lock:
            live = self.book.live()
        for r in live:
            self.abort(r.rid)
        self.peers.stop_side()
        for t in self._threads:
            t.join(timeout=self.t.rpc + 1)
        self.peers.close()

    def _beater(self, name: str) -> Callable[[], None]:
        self._beats[name] = self._clock()

        def beat() -> None:
            self._beats[name] = self._clock()

        return beat

    def loops(self) -> dict[str, dict[str, Any]]:
        """Every serving thread: alive, seconds since its last turn (dispatch and events loops), and why it is
        not serving ("dead": the thread ended; "stuck": no turn within stuck_after s); {} before start()."""
        now = self._clock()
        out: dict[str, dict[str, Any]] = {}
        for t in self._threads:
            alive = t.is_alive() or self._stop.is_set()
            since = self._beats.get(t.name)
            age = None if since is None else max(0.0, now - since)
            error = None
            if not alive:
                error = "dead"
            elif age is not None and age > self.stuck_after and not self._stop.is_set():
                error = "stuck"
            out[t.name] = {"alive": alive, "last_turn_s": age, "error": error}
        return out

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
        self._check_wire(request_id, prompt_ids, params)
        with self._lock:
            self.book.add(request_id, prompt_ids, params)
        self._wake.set()

    def _check_wire(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """ConfigError unless the request's PREALLOC passes the control plane's codec (every int within 64 bits
        and its field's bounds: token ids <= MAX_ID) and its token ids are in the vocabulary: a value no worker
        could take is refused here, before it is queued, never in the dispatch thread."""
        try:
            from_wire(Prealloc, to_wire(Prealloc(request_id, prompt_ids, params, "-", 1, self.t.kv)))
        except MessageError as e:
            raise ConfigError(f"request {request_id}: {e}") from None
        vocab = self.vocab_size()
        if vocab is not None:
            for what, ids in (
                ("prompt token id(s)", prompt_ids),
                ("stop_token_ids", params.stop_token_ids),
                ("logit_bias token id(s)", [t for t, _ in params.logit_bias]),
            ):
                out = [t for t in ids if not 0 <= t < vocab]
                if out:
                    raise ConfigError(
                        f"request {request_id}: {what} {out[:8]} are outside the vocabulary 0..{vocab - 1}"
                    )

    @property
    def features(self) -> frozenset[str]:
        """What every decode serves (the HTTP layer answers 400 for the rest): logprobs + echo (the last prefill
        stage), n (forked on decode), penalties; a decode whose health lists fewer (DeepSeek-V4: none) narrows it."""
        have = frozenset(FEATURES)
        with self._lock:
            for p in self.decodes.values():
                h = p.decode_health
                if h is not None and h.features is not None:
                    have &= frozenset(h.features)
        return have

    def vocab_size(self) -> int | None:
        """The model's vocabulary: RouterConfig.vocab_size (--model), else the smallest a decode reports."""
        if self.cfg.vocab_size is not None:
            return self.cfg.vocab_size
        with self._lock:
            hs = [p.decode_health for p in self.decodes.values()]
            vs = [h.vocab_size for h in hs if h is not None and h.vocab_size]
        return min(vs) if vs else None

    def events(self, request_id: str, timeout: float) -> Iterator[TokenEvent]:
        with self._lock:
            req = self.book.get(request_id)
        if req is None:
            raise ConfigError(f"unknown request id {request_id!r}")
        return self.book.stream(req, timeout)

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self.book.get(request_id)
            if req is None or req.phase is Phase.DONE:
                return
            wire, decode, prefill, phase = req.wire, req.decode, req.prefill, req.phase
            self.book.finish(req, "abort", None)
            self.stats.aborted_total += 1
        if wire is not None and decode is not None:
            self.peers.post((decode, ABORT, Abort(wire, "aborted by the client")))
            if prefill is not None and phase is Phase.DISPATCHED:
                self.peers.post((prefill, ABORT, Abort(wire, "aborted by the client")))

    def release(self, request_id: str) -> None:
        """The reader of `request_id` is gone (the client left, maybe before reading any event): abort it and drop
        its record now (events() drops it only once its last event was read)."""
        self.abort(request_id)
        with self._lock:
            req = self.book.get(request_id)
            if req is not None and req.phase is Phase.DONE:
                self.book.ledger.pop(request_id)

    def abort_choice(self, request_id: str, index: int) -> None:
        """Abort choice `index` of an n > 1 request only (its stop string matched); the others go on."""
        with self._lock:
            req = self.book.get(request_id)
            if req is None or req.phase is Phase.DONE or index in req.done or not 0 <= index < req.params.n:
                return
            wire, decode = req.wire, req.decode
            if req.phase is Phase.QUEUED or wire is None or decode is None:
                self.book.push(req, [], True, "abort", None, index)
                return
        self.peers.post((decode, ABORT, Abort(wire, "choice aborted by the client", choice=index)))

    def record(self, request_id: str) -> RouterRequest | None:
        """The router's lifecycle record of a request (read it, do not change it); None once its events were read."""
        with self._lock:
            return self.book.get(request_id)

    def health(self) -> dict[str, Any]:
        loops = self.loops()
        broken = sorted(f"{name} {v['error']}" for name, v in loops.items() if v["error"])
        with self._lock:
            pairs = self.peers.usable_pairs()
            used = sum(p.health.pages_used for p in self.decodes.values() if p.ok and p.health is not None)
            total = sum(p.health.pages_total for p in self.decodes.values() if p.ok and p.health is not None)
            return {
                "ok": bool(pairs) and not broken,
                "error": f"serving loop(s) not running: {', '.join(broken)}" if broken else None,
                "loops": loops,
                "backend": self.name,
                "pages_used": used,
                "pages_total": total,
                "in_flight": len(self.book.live()),
                "queued": len(self.book.queue),
                "routing": {
                    "decode": "fewest in flight, then most free pages, then fewest running + waiting",
                    "prefill": "prefix affinity, else fewest in flight (disagg/router/routing.py)",
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
            out: dict[str, float] = {k: float(v) for k, v in self.stats.as_dict().items()}
            out["router_in_flight"] = float(len(self.book.live()))
            out["router_queued"] = float(len(self.book.queue))
            out["decode_workers_up"] = float(sum(p.ok for p in self.decodes.values()))
            out["prefill_workers_up"] = float(sum(p.ok for p in self.prefills.values()))
            out["pairs_ready"] = float(len(self.peers.usable_pairs()))
            healths = [p.health for p in self.decodes.values() if p.health is not None]
            out["pool_pages_total"] = float(sum(h.pages_total for h in healths))
            out["pool_pages_used"] = float(sum(h.pages_used for h in healths))
            out["pool_pages_free"] = out["pool_pages_total"] - out["pool_pages_used"]
            out.update(self.peers.instance_metrics())  # per prefill / decode instance, labelled
            out.update(decode_stage_metrics((a, p.decode_health) for a, p in self.decodes.items()))
            return out

    def max_prompt_tokens(self) -> int:
        if self.cfg.max_prompt_tokens is not None:
            return self.cfg.max_prompt_tokens
        with self._lock:
            hs = [p.decode_health for p in self.decodes.values()]
            caps = [h.max_prompt_tokens for h in hs if h is not None and h.max_prompt_tokens is not None]
            caps += [p.health.capacity_tokens - 1 for p in self.prefills.values() if p.health is not None]
        return min(caps) if caps else DEFAULT_MAX_PROMPT_TOKENS

    # ---- one step of each thread (tests drive these directly) ----------------------------------------------

    def dispatch_next(self) -> bool | None:
        """One dispatch attempt for the request at the head of the queue: None if the queue is empty, True if it
        was placed (or finished), False if it went back to the queue (or failed at its queue deadline)."""
        return self.dispatcher.next()

    def poll_events(self, addr: str, client: RpcClient, wait: float) -> bool:
        """One long-poll of decode `addr`'s events (resynchronising its cursor first after a restart); the
        events go to their requests. False if nothing could be asked (the decode is down or failed)."""
        return self.poller.poll(addr, client, wait)

    def poll_health(self) -> None:
        """Ask every worker's health; pair (CONNECT) every healthy prefill with every healthy decode."""
        self.peers.poll_health()

    def drain_side(self) -> int:
        """Send the best-effort RPCs queued now (aborts), here; returns how many (the side thread does this)."""
        return self.peers.drain_side()

    def _health_loop(self) -> None:
        while not self._stop.wait(self.t.health_interval):
            try:
                self.peers.poll_health()
            except Exception:
                log.exception("router: health poll failed")

    def _decode_down(self, dec: PeerState, why: str) -> None:
        self.book.fail_decode(dec, f"{dec.label} is unavailable ({why})")


__all__ = ["RouterBackend", "TokenEvent"]
