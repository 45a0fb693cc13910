"""The router's pick rule (disagg/router/routing.py, PeerTable.pick), in-process with exact choices: decode by load,
prefill by prefix affinity with the load fallback under the gain threshold / over the imbalance bound, the LRU
affinity table bounded by the prefill's pages and forgotten on a prefill restart, and the /health table row."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.radix import RadixCache
from dsakv.config import RouterConfig, Timeouts
from dsakv.disagg.prefill.prefix_events import PrefixEvents
from dsakv.disagg.protocol.messages import (
    CACHE_EVENTS,
    CONNECT,
    HEALTH,
    CacheEvents,
    Connected,
    DecodeHealth,
    Health,
    PrefillHealth,
)
from dsakv.disagg.router.peers import PeerTable
from dsakv.disagg.router.routing import (
    AffinityRule,
    CacheDelta,
    CacheEventLog,
    Load,
    PrefixAffinity,
    pack,
    page_hashes,
    pick_decode,
    pick_prefill,
    unpack,
)
from dsakv.errors import ConfigError

PS = 16
RULE = AffinityRule()


def test_page_hashes_are_chained_and_whole_pages_only():
    a = list(range(40))
    b = list(range(32)) + [99] * 8
    c = [7] + list(range(1, 40))
    ha, hb, hc = page_hashes(a, PS), page_hashes(b, PS), page_hashes(c, PS)
    assert (len(ha), len(page_hashes(a[:31], PS)), len(page_hashes(a[:32], PS))) == (2, 1, 2)
    assert ha == hb  # the 8 tokens after page 2 are not a whole page
    assert hc[0] != ha[0] and hc[1] != ha[1]  # page 1 is equal, but its hash chains page 0's
    assert page_hashes(a, 8)[:2] != ha[:2]  # page size is part of the identity
    with pytest.raises(ValueError, match="page_size = 0"):
        page_hashes(a, 0)


def test_cache_event_log_net_changes_reset_and_bounded():
    log = CacheEventLog(max_events=6)
    h = page_hashes(list(range(64)), PS)  # 4 pages
    assert log.update(h[:3]) == (3, 0)
    d = log.since(-1)  # no cursor: the whole set
    assert (d.cursor, d.reset, d.stored, d.removed, d.pages) == (3, True, h[:3], [], 3)
    assert log.update(h[:2] + h[3:]) == (1, 1)  # page 2 evicted, page 3 stored
    d = log.since(3)
    assert (d.cursor, d.reset, d.stored, d.removed, d.pages) == (5, False, [h[3]], [h[2]], 3)
    assert log.since(5) == CacheDelta(5, False, [], [], 3)
    log.update(h[:3])  # 3 out, 2 back: the last event of each page wins (idempotent on a mirror at 3 or at 5)
    assert log.since(3) == log.since(5) == CacheDelta(7, False, [h[2]], [h[3]], 3)
    log.update([])  # 3 more events: 10 in all, the log keeps 6 (seq 5..10)
    assert log.since(3).reset and log.since(3).stored == []  # too old: the whole (now empty) set
    assert log.since(4) == CacheDelta(10, False, [], [h[3], h[2], h[0], h[1]], 0)  # seq 5.. are all still there
    assert log.since(99).reset  # a cursor it never gave (another boot)


def test_router_mirror_follows_deltas_and_refuses_bad_ones():
    aff = PrefixAffinity(max_pages=5)
    log = CacheEventLog()
    h = page_hashes(list(range(64)), PS)
    assert aff.cursor("p0", "b1", "e1") == -1
    log.update(h[:3])
    assert aff.apply("p0", "b1", "e1", log.since(-1), capacity=8) is None
    assert (aff.matched("p0", h), aff.matched("p1", h), aff.size("p0"), aff.cursor("p0", "b1", "e1")) == (3, 0, 3, 3)
    log.update(h[:1])  # the prefill evicted pages 1 and 2: only page 0 still leads
    assert aff.apply("p0", "b1", "e1", log.since(3), capacity=8) is None
    assert (aff.matched("p0", h), aff.size("p0")) == (1, 1)
    assert aff.cursor("p0", "b2", "e1") == -1  # another boot: ask for the whole set
    why = aff.apply("p0", "b2", "e1", log.since(5), capacity=8)  # a delta for a mirror of another boot
    assert why is not None and "without a base" in why and aff.size("p0") == 0
    assert aff.apply("p0", "b1", "e1", log.since(-1), capacity=8) is None
    bad = CacheDelta(6, False, [h[3]], [], pages=1)  # says 1 page, the mirror would hold 2
    assert "the mirror holds 2 pages, the prefill says 1" in (aff.apply("p0", "b1", "e1", bad, 8) or "")
    assert (aff.size("p0"), aff.cursor("p0", "b1", "e1")) == (0, -1)
    big = CacheDelta(1, True, page_hashes(list(range(96)), PS), [], pages=6)  # 6 > router limit 5
    assert "router limit 5" in (aff.apply("p0", "b1", "e1", big, capacity=8) or "")
    assert "capacity 0" in (aff.apply("p0", "b1", "e1", log.since(-1), capacity=0) or "")
    with pytest.raises(ValueError, match="not a multiple of 16"):
        unpack(b"x" * 17)


def test_prefix_events_name_radix_pages_like_the_router_and_report_evictions():
    alloc = PageAllocator(16, "device")
    radix = RadixCache(PS, alloc)
    ev = PrefixEvents(PS)
    a = list(range(100, 164))  # 4 pages
    b = a[:32] + list(range(500, 532))  # shares 2 pages with a
    for toks in (a, b):
        ids = alloc.alloc(len(toks) // PS)
        radix.insert(toks, ids)
        alloc.free(ids)  # the cache holds its own reference
    ha, hb = page_hashes(a, PS), page_hashes(b, PS)
    assert sorted(ev.hashes(radix)) == sorted(set(ha) | set(hb))  # split at page 2: 6 distinct pages
    r = ev.query(radix, -1, capacity=16, boot="b1", epoch=None)
    assert (r.reset, r.pages, r.cursor, sorted(unpack(r.stored))) == (True, 6, 6, sorted(set(ha) | set(hb)))
    leaf = radix.match(b)[-1]
    radix.drop_device(leaf)  # evict b's own two pages
    r = ev.query(radix, 6, capacity=16, boot="b1", epoch=None)
    assert (r.reset, r.pages, unpack(r.stored), sorted(unpack(r.removed))) == (False, 4, [], sorted(hb[2:]))
    gone = ev.query(None, r.cursor, 16, "b1", None)  # cache gone: every page removed
    assert (gone.pages, sorted(unpack(gone.removed))) == (0, sorted(ha))


def test_pick_decode_by_in_flight_then_free_pages_then_running():
    a, b = Load("d0", 2, pages_free=90, queued=0), Load("d1", 1, pages_free=10, queued=5)
    assert pick_decode([a, b]).addr == "d1"  # fewer in flight wins over free pages
    a, b = Load("d0", 1, pages_free=40), Load("d1", 1, pages_free=60)
    assert pick_decode([a, b]).addr == "d1"
    a, b = Load("d0", 1, pages_free=60, queued=3), Load("d1", 1, pages_free=60, queued=2)
    assert pick_decode([a, b]).addr == "d1"
    assert pick_decode([Load("d1", 0), Load("d0", 0)]).addr == "d0"  # full tie: by address
    with pytest.raises(ValueError, match="no candidate"):
        pick_decode([])


def test_pick_prefill_affinity_threshold_and_imbalance():
    p0, p1 = Load("p0", 0, 90), Load("p1", 1, 90)
    assert pick_prefill([p0, p1], {}, RULE) == (p0, "load")
    assert pick_prefill([p0, p1], {"p1": 1}, RULE) == (p1, "affinity")  # 1 page saved >= 1
    assert pick_prefill([p0, p1], {"p0": 2, "p1": 3}, RULE) == (p1, "affinity")
    assert pick_prefill([p0, p1], {"p0": 3}, RULE) == (p0, "affinity")  # least loaded also holds it
    assert pick_prefill([p0, p1], {"p0": 2, "p1": 3}, AffinityRule(min_gain_pages=2)) == (p0, "load")
    assert pick_prefill([p0, p1], {"p0": 1, "p1": 3}, AffinityRule(min_gain_pages=2)) == (p1, "affinity")
    busy = Load("p1", 5, 90)  # 5 more in flight than p0 > max_imbalance 4: load wins
    assert pick_prefill([p0, busy], {"p1": 10}, RULE) == (p0, "load")
    assert pick_prefill([p0, Load("p1", 4, 90)], {"p1": 10}, RULE)[1] == "affinity"  # 4 <= 4
    tie = [Load("p1", 0, 90), Load("p0", 0, 90)]
    assert pick_prefill(tie, {"p0": 2, "p1": 2}, RULE) == (tie[1], "affinity")  # equal match: by load, address
    with pytest.raises(ValueError, match="min_gain_pages = 0"):
        AffinityRule(min_gain_pages=0)


def _health(role: str, name: str, used: int, running: int = 0, boot: str = "b1", epoch: str | None = None):
    extra = {"prefix_cache_enabled": True} if role == "prefill" else {}
    return (PrefillHealth if role == "prefill" else DecodeHealth)(
        ok=True,
        role=role,
        name=name,
        pid=1,
        boot=boot,
        elide=True,
        backend="mooncake",
        page_size=PS,
        pages_total=8,
        pages_used=used,
        pages_free=8 - used,
        capacity_tokens=8 * PS,
        integrity="ok",
        counters={},
        epoch=epoch,
        running=running,
        waiting=0,
        **extra,
    )


class _Scripted:
    """Stands in for a worker's RpcClient in this unit test: HEALTH -> its Health, CONNECT -> Connected,
    CACHE_EVENTS -> from `cached` (the page hashes the test says that prefill's cache holds) via a CacheEventLog."""

    def __init__(self, h: Health) -> None:
        self.h = h
        self.cached: list[bytes] = []
        self.log = CacheEventLog()
        self.asked: list[int] = []

    def request(self, rpc, msg, timeout=None):
        if rpc is HEALTH:
            return self.h
        if rpc is CACHE_EVENTS:
            self.asked.append(msg.since)
            self.log.update(self.cached)
            d = self.log.since(msg.since)
            return CacheEvents(
                self.h.boot, self.h.epoch, PS, d.cursor, d.reset, pack(d.stored), pack(d.removed), d.pages, 8
            )
        assert rpc is CONNECT
        return Connected(decode=msg.decode, boot=msg.boot or "", epoch=self.h.epoch, stages=[])

    def close(self) -> None:
        pass


def _table() -> tuple[PeerTable, dict[str, _Scripted]]:
    t = PeerTable(["p0", "p1"], ["d0", "d1"], Timeouts(), threading.RLock(), on_decode_down=lambda p, w: None)
    clients = {}
    for peers in (t.prefills, t.decodes):
        for a, p in peers.items():
            c = clients[a] = _Scripted(_health(p.role, a, used=0, epoch="e1" if p.role == "prefill" else None))
            p.client = c  # type: ignore[assignment]
            p.ready = True
    t.poll_health()
    return t, clients


def test_peer_table_pick_from_cache_events_and_health_rows():
    t, cl = _table()
    assert all(s.ok for s in t.pairs.values()) and [cl[p].asked for p in ("p0", "p1")] == [[-1], [-1]]
    prompt_a = list(range(100, 150))  # 3 whole pages
    prompt_b = list(range(200, 250))
    c = t.pick(prompt_a)
    assert c is not None and (c.prefill, c.decode, c.reason, c.matched_pages) == ("p0", "d0", "load", 0)
    t.sent(c)
    t.prefills["p0"].inflight += 1
    t.decodes["d0"].inflight += 1
    c = t.pick(prompt_b)  # no prefix anywhere: the idle pair
    assert c is not None and (c.prefill, c.decode, c.reason) == ("p1", "d1", "load")
    t.sent(c)
    t.prefills["p1"].inflight += 1
    t.decodes["d1"].inflight += 1
    # sent is not cached: until the prefills report their caches, a prompt sharing prompt_a's pages goes by load
    t.prefills["p1"].inflight = 0
    t.prefills["p0"].inflight = 1
    follow = prompt_a[:32] + [9] * 20
    assert t.pick(follow) == ("p1", "d0", "load", 0, page_hashes(follow, PS))  # type: ignore[comparison-overlap]
    cl["p0"].cached, cl["p1"].cached = page_hashes(prompt_a, PS), page_hashes(prompt_b, PS)
    t.poll_health()  # the prefills' cache events: now the router knows
    assert [cl[p].asked for p in ("p0", "p1")] == [[-1, 0], [-1, 0]]
    c = t.pick(follow)
    assert c is not None and (c.prefill, c.reason, c.matched_pages) == ("p0", "affinity", 2)
    # decode: equal in flight, d1 has more free pages
    cl["d0"].h = _health("decode", "d0", used=6)
    cl["d1"].h = _health("decode", "d1", used=2)
    t.poll_health()
    c2 = t.pick(prompt_b)
    assert c2 is not None and (c2.decode, c2.prefill, c2.reason, c2.matched_pages) == ("d1", "p1", "affinity", 3)
    rows = {r["addr"]: r for r in (t.view(p) for p in (*t.prefills.values(), *t.decodes.values()))}
    assert (rows["p0"]["cached_prefix_pages"], rows["p0"]["picked"], rows["p0"]["picked_affinity"]) == (3, 1, 0)
    assert rows["p0"]["cache_events"] == {"polls": 3, "error": None}
    assert (rows["d1"]["pages_free"], rows["d1"]["in_flight"], rows["d1"]["picked"], rows["d1"]["busy"]) == (
        6,
        1,
        1,
        False,
    )
    # p0 evicts prompt_a's pages 1 and 2: from the next poll on, only page 0 counts there (gain 1 >= 1 page)
    cl["p0"].cached = page_hashes(prompt_a, PS)[:1]
    t.poll_health()
    assert (t.affinity.size("p0"), cl["p0"].asked[-1]) == (1, 3)
    assert t.pick(follow)[2:4] == ("affinity", 1)  # type: ignore[index]
    cl["p0"].cached = []
    t.poll_health()
    assert t.pick(follow)[2:4] == ("load", 0)  # type: ignore[index]
    # p1 restarts (new boot): the router asks it for its whole set again and drops the old mirror, only there
    cl["p1"].h = replace(cl["p1"].h, boot="b2")
    cl["p1"].cached = page_hashes(prompt_b, PS)[:1]
    t.poll_health()
    assert (t.affinity.size("p1"), t.affinity.size("p0"), t.prefills["p1"].boot, cl["p1"].asked[-1]) == (1, 0, "b2", -1)
    assert all(s.ok for s in t.pairs.values())


def test_router_config_refuses_bad_affinity_settings():
    with pytest.raises(ConfigError, match="affinity_min_gain_pages = 0 must be >= 1"):
        RouterConfig(prefill=("a:1",), decode=("b:2",), affinity_min_gain_pages=0)
    with pytest.raises(ConfigError, match="affinity_max_imbalance = -1"):
        RouterConfig(prefill=("a:1",), decode=("b:2",), affinity_max_imbalance=-1)


def test_a_worker_busy_in_a_step_stays_up_then_goes_down():
    """A worker answers HEALTH between engine steps but PING at once: a HEALTH that times out while PING answers
    (same pid) keeps the worker up, for at most Timeouts.busy_health; a PING that fails marks it down at once.
    A real RPC server on 127.0.0.1 (the decode follower spec: PING, HEALTH, CHECK_INTEGRITY)."""
    import os
    import time

    from dsakv.disagg.protocol.messages import DECODE_FOLLOWER_SERVICE
    from dsakv.disagg.protocol.worker_service import WorkerService

    busy, release = threading.Event(), threading.Event()
    h0 = replace(_health("decode", "d", used=0), pid=os.getpid())

    def health() -> Health:
        if busy.is_set():
            release.wait(10)  # a long step: longer than the router's health call
        return h0

    svc = WorkerService(DECODE_FOLLOWER_SERVICE, {}, "127.0.0.1", 0, "d", health=health, integrity=lambda: "ok")
    svc.start([])
    downs: list[str] = []
    t = PeerTable(
        [],
        [svc.address],
        Timeouts(health_call=0.3, ping=1.0, busy_health=1.0),
        threading.RLock(),
        on_decode_down=lambda p, why: downs.append(why),
    )
    peer = t.decodes[svc.address]
    try:
        t.poll_health()
        assert (peer.ok, peer.slow_health, downs) == (True, 0, [])
        busy.set()
        t.poll_health()  # HEALTH times out, PING answers: kept up, nothing failed
        assert (peer.ok, peer.slow_health, downs) == (True, 1, [])
        assert t.instance_metrics()[f'instance_slow_health_total{{role="decode",addr="{svc.address}",name="d"}}'] == 1
        time.sleep(1.1)  # busy longer than busy_health: down, its requests fail (on_decode_down)
        t.poll_health()
        assert (peer.ok, peer.slow_health, len(downs)) == (False, 2, 1)
        assert "busy longer than 1 s" in downs[0], downs
        release.set()
        busy.clear()
        t.poll_health()  # it answers again: up
        assert (peer.ok, peer.slow_since) == (True, None)
        busy.set()
        release.clear()
        svc.rpc.stop()  # gone: HEALTH and PING fail, down at the first poll
        t.poll_health()
        assert (peer.ok, len(downs)) == (False, 2)
    finally:
        release.set()
        svc.stop(1.0)


def test_dp_ranks_of_a_prefill_and_a_decode_join_the_table_each_with_its_pairs():
    """A prefill and a decode with DP attention name their ranks (dp_addrs) in rank 0's health: each rank becomes a
    worker of the table (a prefill rank its own load and cache mirror), paired with every worker of the other role;
    rows and labels name the rank and its instance."""
    p0, p1, d0, d1 = "127.0.0.1:9240", "127.0.0.1:9241", "127.0.0.1:9100", "127.0.0.1:9101"
    t = PeerTable([p0], [d0], Timeouts(), threading.RLock(), on_decode_down=lambda p, w: None)
    t.add_dp_ranks(t.prefills[p0], replace(_health("prefill", p0, 0), dp_rank=0, dp_size=2, dp_addrs=[p0, p1]))
    assert sorted(t.prefills) == [p0, p1] and sorted(t.pairs) == [(p0, d0), (p1, d0)]
    assert [(p.role, p.dp_rank, p.dp_size, p.instance) for p in t.prefills.values()] == [
        ("prefill", 0, 2, p0),
        ("prefill", 1, 2, p0),
    ]
    assert t.prefills[p1].label == f"prefill {p1} (DP rank 1 of 2 of the prefill instance at {p0})"
    new: list[str] = []
    t.on_new_decode = new.append
    t.add_dp_ranks(t.decodes[d0], replace(_health("decode", d0, 0), dp_rank=0, dp_size=2, dp_addrs=[d0, d1]))
    assert new == [d1] and sorted(t.pairs) == [(p0, d0), (p0, d1), (p1, d0), (p1, d1)]
    t.add_dp_ranks(t.prefills[p1], replace(_health("prefill", p1, 0), dp_rank=1, dp_size=2, dp_addrs=[p0, p1]))
    assert len(t.prefills) == 2 and len(t.pairs) == 4  # rank 1's own health adds nothing new
    row = t.view(t.prefills[p1])
    assert (row["dp_rank"], row["dp_size"], row["instance"], row["dp_ranks"]) == (1, 2, p0, None)  # (not polled yet)
