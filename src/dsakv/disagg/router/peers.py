"""The router's view of its workers: each prefill and decode worker's health and load, every prefill-decode pair's
handshake, and the best-effort side RPCs (aborts) to them.

    peers = PeerTable(prefill_addrs, decode_addrs, timeouts, lock, on_decode_down=...)
    peers.poll_health()          HEALTH of every worker; CACHE_EVENTS of every prefill with a prefix cache (its
                                 mirror in self.affinity follows the prefill's own cache); CONNECT every healthy
                                 pair not yet paired for this (prefill boot/epoch, decode boot); a peer that does
                                 not answer is marked down
    peers.pick(prompt)           a Choice: the least loaded decode (disagg/router/routing.py), then the prefill paired
                                 with it that caches most of the prompt (prefix affinity) or else the least
                                 loaded; None if no usable pair
    peers.sent(choice)           after a SUBMIT: count the pick
    peers.post((addr, ABORT, Abort(rid)))   sent in order by the side thread (side_loop) or drain_side()

Imports dsakv.disagg.{rpc, messages, routing} and dsakv.config (Timeouts); no torch.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from dsakv.config import Timeouts
from dsakv.disagg.protocol.messages import (
    CACHE_EVENTS,
    CONNECT,
    HEALTH,
    PING,
    CacheEvents,
    CacheEventsQuery,
    Connect,
    DecodeHealth,
    Health,
    HealthQuery,
    Ping,
    PrefillHealth,
)
from dsakv.disagg.protocol.rpc import PeerUnavailable, Rpc, RpcClient, RpcError
from dsakv.disagg.router.routing import (
    AffinityRule,
    CacheDelta,
    Load,
    PrefixAffinity,
    page_hashes,
    pick_decode,
    pick_prefill,
    unpack,
)
from dsakv.disagg.router.stage_views import stage_rows

log = logging.getLogger(__name__)


@dataclass
class PeerState:
    addr: str
    role: str
    client: RpcClient
    ok: bool = False
    boot: str | None = None
    epoch: str | None = None
    num_stages: int = 1
    health: Health | None = None
    error: str | None = "not contacted yet"
    inflight: int = 0
    ready: bool = False  # decode: its event cursor is known for this boot
    cursor: int = 0
    orphans: list[str] = field(default_factory=list)  # decode: attempts failed here while it was unreachable
    busy_until: float = 0.0  # decode: said NoFreePages; not asked again before then
    picked: int = 0  # requests the router sent here
    picked_affinity: int = 0  # prefill: ... of which for prefix affinity
    cache_error: str | None = None  # prefill: why its cache events could not be mirrored (last poll)
    cache_polls: int = 0  # prefill: cache-event replies applied
    slow_since: float | None = None  # HEALTH timed out but PING answered (same process) since then
    slow_health: int = 0  # health polls answered that way (the worker was busy in a step)
    dp_rank: int | None = None  # its DP rank in an instance with DP attention (found from its health)
    dp_size: int | None = None
    instance: str | None = None  # with DP attention: the address of the instance's rank 0

    @property
    def label(self) -> str:
        """'decode 127.0.0.1:9001 (DP rank 1 of 2 of the decode instance at 127.0.0.1:9000)' (a DP rank), or
        'decode 127.0.0.1:9001'."""
        if self.dp_rank is None:
            return f"{self.role} {self.addr}"
        where = f"DP rank {self.dp_rank} of {self.dp_size} of the {self.role} instance at {self.instance}"
        return f"{self.role} {self.addr} ({where})"

    @property
    def prefill_health(self) -> PrefillHealth | None:
        """The last health, where a prefill stage answered it (the role's fields); else None."""
        return self.health if isinstance(self.health, PrefillHealth) else None

    @property
    def decode_health(self) -> DecodeHealth | None:
        """The last health, where a decode worker answered it (the role's fields); else None."""
        return self.health if isinstance(self.health, DecodeHealth) else None


class Choice(NamedTuple):
    prefill: str
    decode: str
    reason: str  # "affinity" | "load" (how the prefill was chosen)
    matched_pages: int  # prompt pages the chosen prefill should have cached
    hashes: list[bytes]  # the prompt's page hashes at that prefill's page size


@dataclass
class PairState:
    ok: bool = False
    key: tuple[str | None, str | None] = (None, None)  # (prefill epoch, decode boot) it was made for
    error: str | None = None
    tried: float = 0.0
    skipped: list[str] = field(default_factory=list)


def _load_of(h: Health | None) -> dict[str, int | None]:
    """A worker's pages and requests as its last health said (None before its first answer): the load columns
    of both the instance table (view) and its labelled gauges (instance_metrics)."""
    fields = ("pages_used", "pages_free", "pages_total", "running", "waiting")
    return {f: (getattr(h, f) if h is not None else None) for f in fields}


def dp_down_reason(lead: PeerState | None, peer: PeerState, why: str, timeout: float, wait: float = 2.0) -> str:
    """`why` DP rank `peer` (> 0) is down, with its instance's rank 0 (`lead`)'s reason when it has one within
    `wait` s (its health row of the rank: the exit status: 'dp rank 1 (pid N) was killed by signal 9 (SIGKILL)')."""
    end = time.monotonic() + wait
    while lead is not None and lead is not peer:
        try:
            h = lead.client.request(HEALTH, HealthQuery(), timeout=timeout)
        except RpcError:
            break
        row = next((r for r in getattr(h, "dp_ranks", None) or [] if r.rank == peer.dp_rank), None)
        if row is not None and not row.up:
            return f"{why}; its instance's rank 0 says: {row.down}"
        if time.monotonic() >= end:
            break
        time.sleep(0.1)
    return why


class PeerTable:
    def __init__(
        self,
        prefill: Sequence[str],
        decode: Sequence[str],
        t: Timeouts,
        lock: threading.RLock,
        on_decode_down: Callable[[PeerState, str], None],
        rule: AffinityRule | None = None,
        on_new_decode: Callable[[str], None] | None = None,
    ) -> None:
        self.t = t
        self.rule = rule or AffinityRule()
        self.affinity = PrefixAffinity()
        self._lock = lock  # the router's: peers and requests change together
        self.on_decode_down = on_decode_down
        self.on_new_decode = on_new_decode  # a DP rank found in a decode's health: start its events loop
        self.decodes = {a: PeerState(a, "decode", RpcClient(a, timeout=t.rpc)) for a in decode}
        self.prefills = {a: PeerState(a, "prefill", RpcClient(a, timeout=t.rpc)) for a in prefill}
        self.pairs: dict[tuple[str, str], PairState] = {(p, d): PairState() for p in prefill for d in decode}
        self._side: queue.Queue[tuple[str, Rpc[Any, Any], Any] | None] = queue.Queue()
        self._side_clients: dict[str, RpcClient] = {}

    def view(self, p: PeerState) -> dict[str, Any]:
        """One row of the router's instance table (its /health): state, load, cached prefixes, health."""
        h = p.health
        row: dict[str, Any] = {
            "addr": p.addr,
            "name": h.name if h is not None else None,
            "ok": p.ok,
            "boot": p.boot,
            "epoch": p.epoch,
            "error": p.error,
            "in_flight": p.inflight,
            "picked": p.picked,
            **_load_of(h),
            "integrity": h.integrity if h is not None else None,
        }
        if p.dp_rank is not None:  # DP attention: the rank, its instance, and the instance's ranks as it sees them
            row.update(dp_rank=p.dp_rank, dp_size=p.dp_size, instance=p.instance)
            row["dp_ranks"] = [vars(r) for r in h.dp_ranks or []] if h is not None else None
        if p.role == "prefill":
            row["num_stages"] = p.num_stages
            row["cached_prefix_pages"] = self.affinity.size(p.addr)  # the router's mirror of its cache events
            row["cache_events"] = {"polls": p.cache_polls, "error": p.cache_error}
            row["picked_affinity"] = p.picked_affinity
            ph = p.prefill_health
            row["prefix_cache"] = ph.prefix_cache if ph is not None else None  # the prefill's own stats
        else:
            row["busy"] = p.busy_until > time.monotonic()
            row["stages"] = stage_rows(p.decode_health)  # a pipelined decode: every stage as it reports itself
        return row

    def instance_metrics(self) -> dict[str, float]:
        """The instance table as labelled gauges for the router's /metrics: `instance_<what>{role, addr, name}`."""
        out: dict[str, float] = {}
        with self._lock:
            for p in (*self.prefills.values(), *self.decodes.values()):
                h = p.health
                name = (h.name if h is not None else "").replace("\\", "\\\\").replace('"', '\\"')
                dp = f',instance="{p.instance}",dp_rank="{p.dp_rank}"' if p.dp_rank is not None else ""
                lab = f'{{role="{p.role}",addr="{p.addr}",name="{name}"{dp}}}'
                vals: dict[str, float | None] = {
                    "up": float(p.ok),
                    "in_flight": p.inflight,
                    "slow_health_total": p.slow_health,
                    "picked_total": p.picked,
                    **_load_of(h),
                    "integrity_ok": float(h.integrity == "ok") if h is not None else None,
                }
                if p.role == "prefill":
                    ph = p.prefill_health
                    stats = (ph.prefix_cache if ph is not None else None) or {}
                    vals["cached_prefix_pages"] = self.affinity.size(p.addr)
                    vals["picked_affinity_total"] = p.picked_affinity
                    vals["prefix_hit_tokens_total"] = stats.get("hit_tokens")
                else:
                    vals["busy"] = float(p.busy_until > time.monotonic())
                for k, v in vals.items():
                    if v is not None:
                        out[f"instance_{k}{lab}"] = float(v)
        return out

    @staticmethod
    def load(p: PeerState) -> Load:
        h = p.health
        if h is None:
            return Load(p.addr, p.inflight)
        return Load(p.addr, p.inflight, h.pages_free, (h.running or 0) + (h.waiting or 0))

    def usable_pairs(self) -> list[tuple[str, str]]:
        with self._lock:
            return [
                (p, d)
                for (p, d), s in self.pairs.items()
                if s.ok and self.prefills[p].ok and self.decodes[d].ok and self.decodes[d].ready
            ]

    def pickable(self) -> list[tuple[str, str]]:
        now = time.monotonic()
        return [(p, d) for p, d in self.usable_pairs() if self.decodes[d].busy_until <= now]

    def pick(self, prompt: Sequence[int] = ()) -> Choice | None:
        """The decode by load, then among the prefills paired with it the one by prefix affinity / load
        (rules in disagg/router/routing.py); None if no pair is usable now."""
        pairs = self.pickable()
        if not pairs:
            return None
        with self._lock:
            dec = pick_decode([self.load(self.decodes[d]) for d in sorted({d for _, d in pairs})])
            pres = [self.prefills[p] for p in sorted({p for p, d in pairs if d == dec.addr})]
            by_size: dict[int, list[bytes]] = {}
            hashes: dict[str, list[bytes]] = {}
            for p in pres:
                size = p.health.page_size if p.health is not None else 0
                if size > 0 and size not in by_size:
                    by_size[size] = page_hashes(prompt, size)
                hashes[p.addr] = by_size.get(size, [])
            matched = {a: self.affinity.matched(a, hs) for a, hs in hashes.items()}
            pre, why = pick_prefill([self.load(p) for p in pres], matched, self.rule)
            return Choice(pre.addr, dec.addr, why, matched[pre.addr], hashes[pre.addr])

    def sent(self, c: Choice) -> None:
        """The prefill of `c` accepted the request: count it (what it caches comes from its cache events)."""
        with self._lock:
            pre, dec = self.prefills[c.prefill], self.decodes[c.decode]
            pre.picked += 1
            dec.picked += 1
            pre.picked_affinity += c.reason == "affinity"

    def why_no_pair(self) -> str:
        bad = [f"{p.role} {p.addr}: {p.error}" for p in list(self.decodes.values()) + list(self.prefills.values())]
        bad += [f"pair {p}->{d}: {s.error}" for (p, d), s in self.pairs.items() if s.error]
        return "; ".join(x for x in bad if not x.endswith(": None")) or "no pair handshaken yet"

    def mark_down(self, peer: PeerState, why: str) -> None:
        """`peer` stopped answering: no pair with it is used; a decode's requests fail (on_decode_down) (a prefill's
        fail on their decode, whose liveness ping finds the prefill gone)."""
        if peer.dp_rank and peer.ok:
            table = self.decodes if peer.role == "decode" else self.prefills
            why = dp_down_reason(table.get(peer.instance or ""), peer, why, self.t.health_rpc)
        with self._lock:
            was = peer.ok
            peer.ok, peer.error = False, why
            if peer.role == "decode":
                peer.ready = False
                self.on_decode_down(peer, why)
            else:
                self.affinity.forget(peer.addr)
            for (p, d), s in self.pairs.items():
                if peer.addr in (p, d):
                    s.ok = False
        if was:
            log.warning("router: %s %s is down: %s", peer.role, peer.addr, why)

    def down_or_busy(self, peer: PeerState, why: str) -> str | None:
        """HEALTH to `peer` failed with `why`: None if it is the same process, alive but busy (a worker answers
        HEALTH between engine steps, PING at once; a long step on a loaded machine outlasts the health call): it
        stays as it was, for at most Timeouts.busy_health. Else why it is down (PING failed too, another process
        answers, or busy too long)."""
        if not peer.ok or peer.health is None:
            return why
        try:
            pong = peer.client.request(PING, Ping(), timeout=self.t.ping)
        except RpcError:
            return why
        now = time.monotonic()
        with self._lock:
            if pong.pid != peer.health.pid:  # another process on that address: the one we knew is gone
                return why
            if peer.slow_since is None:
                peer.slow_since = now
                log.info("router: %s %s answers PING but not HEALTH (busy in a step?): kept up", peer.role, peer.addr)
            peer.slow_health += 1
            if now - peer.slow_since > self.t.busy_health:
                busy = now - peer.slow_since
                why = f"{why} (answering PING only, for {busy:.0f} s: busy longer than {self.t.busy_health:g} s)"
                peer.slow_since = None
                return why
        return None

    def add_dp_ranks(self, peer: PeerState, h: Health) -> None:
        """A prefill or decode with DP attention names its instance's ranks (dp_addrs): each becomes a worker of the
        table (its own pairs; a decode rank its events loop, a prefill rank its prefix-cache mirror), routed to by
        its own load (and a prefill rank by its own prefix affinity); the router so picks the DP rank."""
        if h.dp_rank is None or not h.dp_addrs:
            return
        new = []
        decode = peer.role == "decode"
        table = self.decodes if decode else self.prefills
        with self._lock:
            inst = h.dp_addrs[0]
            for r, a in enumerate(h.dp_addrs):
                if a not in table:
                    table[a] = PeerState(a, peer.role, RpcClient(a, timeout=self.t.rpc))
                    for pair in [(p, a) for p in self.prefills] if decode else [(a, d) for d in self.decodes]:
                        self.pairs[pair] = PairState()
                    new.append(a)
                w = table[a]
                w.dp_rank, w.dp_size, w.instance = r, len(h.dp_addrs), inst
        for a in new:
            log.info("router: %s %s is DP rank %d of the instance at %s", peer.role, a, h.dp_addrs.index(a), inst)
            if decode and self.on_new_decode is not None:
                self.on_new_decode(a)

    def poll_health(self) -> None:
        """Ask every worker's health; pair (CONNECT) every healthy prefill with every healthy decode."""
        with self._lock:
            peers = [*self.decodes.values(), *self.prefills.values()]
        for peer in peers:
            try:
                h = peer.client.request(HEALTH, HealthQuery(), timeout=self.t.health_rpc)
            except PeerUnavailable as e:
                why = self.down_or_busy(peer, str(e))
                if why is not None:
                    self.mark_down(peer, why)
                continue
            except RpcError as e:
                with self._lock:
                    peer.ok, peer.error = False, str(e)
                continue
            with self._lock:
                peer.slow_since = None
                if peer.role == "decode" and peer.boot is not None and h.boot != peer.boot:
                    peer.ready = False  # restarted: the events thread fails its old requests, then resyncs
                if peer.role == "prefill" and (peer.boot, peer.epoch) != (h.boot, h.epoch):
                    self.affinity.forget(peer.addr)  # restarted or re-formed: its cache is gone
                peer.health = h
                peer.epoch = h.epoch
                peer.num_stages = h.num_stages
                if peer.role == "prefill":
                    peer.boot = h.boot
                ok = h.ok
                if ok and not peer.ok:
                    log.info("router: %s %s is up (%s)", peer.role, peer.addr, h.name)
                peer.ok, peer.error = ok, (None if ok else str(h.down or "not ok"))
            if peer.role == "prefill":
                self.poll_cache(peer)
            self.add_dp_ranks(peer, h)
        now = time.monotonic()
        with self._lock:
            pairs = list(self.pairs.items())
        for (p, d), s in pairs:
            pre, dec = self.prefills[p], self.decodes[d]
            key = (f"{pre.boot}/{pre.epoch}", dec.health.boot if dec.health is not None else None)
            if not (pre.ok and dec.ok):
                continue
            if s.ok and s.key == key:
                continue
            if s.key == key and s.error and now - s.tried < self.t.connect_retry:
                continue
            s.tried = now
            try:
                res = pre.client.request(
                    CONNECT,
                    Connect(decode=d, boot=key[1], timeout=self.t.rpc),
                    timeout=self.t.rpc * 2,
                )
            except RpcError as e:
                with self._lock:
                    s.ok, s.key, s.error = False, key, str(e)
                log.warning("router: pairing prefill %s with decode %s failed: %s", p, d, e)
                continue
            with self._lock:
                s.ok, s.key, s.error = True, key, None
                s.skipped = sorted({k for st in res.stages for k in st.skipped})
            log.info("router: prefill %s paired with decode %s (skipped one-sided: %s)", p, d, s.skipped or "none")

    def poll_cache(self, peer: PeerState) -> None:
        """Bring the router's mirror of `peer`'s prefix cache up to date from its cache events (routing.py)."""
        h = peer.prefill_health
        if h is None or not h.prefix_cache_enabled or not peer.ok:
            with self._lock:
                self.affinity.forget(peer.addr)
            return
        with self._lock:
            since = self.affinity.cursor(peer.addr, h.boot, h.epoch)
        try:
            ev: CacheEvents = peer.client.request(CACHE_EVENTS, CacheEventsQuery(since), timeout=self.t.health_rpc)
            delta = CacheDelta(ev.cursor, ev.reset, unpack(ev.stored), unpack(ev.removed), ev.pages)
        except (RpcError, ValueError) as e:
            with self._lock:
                self.affinity.forget(peer.addr)
                peer.cache_error = f"cache events: {e}"
            log.warning("router: prefill %s cache events failed: %s", peer.addr, e)
            return
        with self._lock:
            if ev.page_size != h.page_size:
                why: str | None = f"cache events in pages of {ev.page_size} tokens, health says {h.page_size}"
                self.affinity.forget(peer.addr)
            else:
                why = self.affinity.apply(peer.addr, ev.boot, ev.epoch, delta, ev.capacity)
            peer.cache_error = why
            peer.cache_polls += why is None
        if why is not None:
            log.warning("router: prefill %s cache mirror dropped: %s", peer.addr, why)

    def post(self, item: tuple[str, Rpc[Any, Any], Any]) -> None:
        """Queue a best-effort RPC (an abort) for the side thread."""
        self._side.put(item)

    def stop_side(self) -> None:
        self._side.put(None)

    def close(self) -> None:
        for p in list(self.decodes.values()) + list(self.prefills.values()):
            p.client.close()

    def side_loop(self) -> None:
        while True:
            item = self._side.get()
            if item is None:
                return
            try:
                self._side_call(*item)
            except Exception:  # a best-effort call: log it, the next one goes on
                log.exception("router: side call %s failed", item[1].name)

    def drain_side(self) -> int:
        """Send the best-effort RPCs queued now (aborts), here; returns how many (the side thread does this)."""
        n = 0
        while True:
            try:
                item = self._side.get_nowait()
            except queue.Empty:
                return n
            if item is not None:
                self._side_call(*item)
                n += 1

    def _side_call(self, addr: str, rpc: Rpc[Any, Any], msg: Any) -> None:
        c = self._side_clients.get(addr)
        if c is None:
            c = self._side_clients[addr] = RpcClient(addr, timeout=self.t.side_rpc)
        try:
            c.request(rpc, msg)
        except RpcError as e:
            log.info("router: %s %s(%s) failed: %s", addr, rpc.name, getattr(msg, "rid", ""), e)
