"""The router's event intake: one long-poll thread per decode worker reads EVENTS (every request's tokens at
once, from a cursor) and hands them to the requests they belong to.

    poller = EventPoller(book, peers, timeouts, lock)
    poller.poll(addr, client, wait)    one long poll of decode `addr`; False if it could not be asked
    poller.loop(addr, stop)            the thread of one decode

After a decode (re)appears its cursor is resynchronised first: the requests the router had there fail ("decode
... restarted"), and if it is the same process (same boot) the attempts failed while it was unreachable are
aborted there. An event of an attempt the router no longer tracks (an old attempt id, another decode) is ignored.
Imports dsakv.disagg.{rpc, messages, router_peers, router_requests}; no torch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dsakv.config import Timeouts
from dsakv.disagg.protocol.messages import ABORT, EVENTS, Abort, EventsQuery
from dsakv.disagg.protocol.rpc import PeerUnavailable, RpcClient, RpcError
from dsakv.disagg.router.peers import PeerTable
from dsakv.disagg.router.requests import RequestBook

log = logging.getLogger(__name__)


class EventPoller:
    def __init__(self, book: RequestBook, peers: PeerTable, t: Timeouts, lock: threading.RLock) -> None:
        self.book, self.peers, self.t, self.lock = book, peers, t, lock

    def loop(self, addr: str, stop: threading.Event, beat: Callable[[], None] = lambda: None) -> None:
        """The thread of decode `addr`: `beat()` once per poll (the router's /health reports a loop that stopped);
        a failed poll is logged and retried, an event that cannot be handed over fails its request alone."""
        client = RpcClient(addr, timeout=self.t.poll_wait + self.t.rpc)
        while not stop.is_set():
            beat()
            try:
                ok = self.poll(addr, client, self.t.poll_wait)
            except (RpcError, OSError) as e:  # the connection failed (the client reconnects on the next poll)
                log.warning("router: events poll of %s failed: %s: %s", addr, type(e).__name__, e)
                ok = False
            except Exception:
                log.exception("router: events poll of %s failed", addr)
                ok = False
            if not ok:
                stop.wait(0.05)

    def poll(self, addr: str, client: RpcClient, wait: float) -> bool:
        dec = self.peers.decodes[addr]
        if not dec.ok and not dec.ready:
            # unreachable (mark_down failed its requests) or not synced yet. A decode that answers but says not
            # ok (a TP rank died, its pipeline broke) is still polled: it fails its requests through its events.
            return False
        try:
            if not dec.ready:
                res = client.request(EVENTS, EventsQuery(since=1 << 62, wait=0))
                with self.lock:
                    self.book.fail_decode(dec, f"decode {addr} restarted: its requests were lost")
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
            return False
        with self.lock:
            if res.boot != dec.boot:
                dec.ready = False
                return True
            for ev in res.events:
                req = self.book.by_wire.get(ev.rid)
                if req is None or req.decode != addr:
                    continue
                try:
                    self.book.decoding(req)
                    self.book.push(req, ev.tokens, ev.finished, ev.reason, ev.error, ev.choice, ev)
                except Exception as e:  # this request's event is unusable: it fails alone
                    log.exception("router: event of %s from %s could not be handed over", ev.rid, addr)
                    self.book.stats.event_errors_total += 1
                    self.book.finish(req, "error", f"request {req.rid}: a bad event from decode {addr}: {e}")
                    self.peers.post((addr, ABORT, Abort(ev.rid, "the router could not use its events")))
            dec.cursor = res.cursor
        return True
