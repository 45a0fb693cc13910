"""The router's pick rule (disagg/routing.py, PeerTable.pick), in-process with exact choices: decode by load,
prefill by prefix affinity with the load fallback under the gain threshold / over the imbalance bound, the LRU
affinity table bounded by the prefill's pages and forgotten on a prefill restart, and the /health table row."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from dsakv.disagg.messages import CONNECT, HEALTH, Connected, Health
from dsakv.disagg.router import RouterConfig
from dsakv.disagg.router_peers import PeerTable
from dsakv.disagg.routing import AffinityRule, Load, PrefixAffinity, page_hashes, pick_decode, pick_prefill
from dsakv.disagg.timeouts import Timeouts
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


def test_affinity_table_matches_leading_pages_lru_bounded():
    aff = PrefixAffinity()
    p = list(range(64))  # 4 pages
    h = page_hashes(p, PS)
    aff.record("p0", h[:3], capacity=8)
    assert (aff.matched("p0", h), aff.matched("p1", h), aff.size("p0")) == (3, 0, 3)
    other = page_hashes([5] * 96, PS)  # 6 pages, all different from p's (chained)
    aff.record("p0", other, capacity=8)  # 9 > 8: p's page 0 (least recently sent) goes
    assert (aff.size("p0"), aff.matched("p0", h)) == (8, 0)  # page 0 gone: nothing leads any more
    aff.forget("p0")
    assert (aff.size("p0"), aff.matched("p0", other)) == (0, 0)


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
    return Health(
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
    )


def _table() -> PeerTable:
    t = PeerTable(["p0", "p1"], ["d0", "d1"], Timeouts(), threading.RLock(), on_decode_down=lambda p, w: None)
    for peers in (t.prefills, t.decodes):
        for a, p in peers.items():
            p.ok, p.ready, p.error = True, True, None
            p.health = _health(p.role, a, used=0, epoch="e1" if p.role == "prefill" else None)
            p.boot, p.epoch = p.health.boot, p.health.epoch
    for s in t.pairs.values():
        s.ok = True
    return t


def test_peer_table_pick_sent_and_health_rows():
    t = _table()
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
    # a prompt sharing 2 pages of prompt_a goes to p0 although both prefills are equally loaded
    t.prefills["p1"].inflight = 0
    t.prefills["p0"].inflight = 1
    c = t.pick(prompt_a[:32] + [9] * 20)
    assert c is not None and (c.prefill, c.reason, c.matched_pages) == ("p0", "affinity", 2)
    # decode: equal in flight, d1 has more free pages
    t.decodes["d0"].health = _health("decode", "d0", used=6)
    t.decodes["d1"].health = _health("decode", "d1", used=2)
    c2 = t.pick(prompt_b)
    assert c2 is not None and (c2.decode, c2.prefill, c2.reason, c2.matched_pages) == ("d1", "p1", "affinity", 3)
    rows = {r["addr"]: r for r in (t.view(p) for p in (*t.prefills.values(), *t.decodes.values()))}
    assert (rows["p0"]["cached_prefix_pages"], rows["p0"]["picked"], rows["p0"]["picked_affinity"]) == (3, 1, 0)
    assert (rows["d1"]["pages_free"], rows["d1"]["in_flight"], rows["d1"]["picked"], rows["d1"]["busy"]) == (
        6,
        1,
        1,
        False,
    )
    # p1 restarts (new boot): the health poll makes the router forget what it sent there, and only there
    t.prefills["p1"].health = None
    for p in (*t.prefills.values(), *t.decodes.values()):
        h = _health(p.role, p.addr, used=0, boot="b2" if p.addr == "p1" else "b1")
        p.client = _Scripted(replace(h, epoch="e1") if p.role == "prefill" else h)  # type: ignore[assignment]
    t.poll_health()
    assert (t.affinity.size("p1"), t.affinity.size("p0"), t.prefills["p1"].boot) == (0, 3, "b2")
    assert all(s.ok for s in t.pairs.values())


class _Scripted:
    """Stands in for a worker's RpcClient in this unit test: HEALTH -> a fixed Health, CONNECT -> Connected."""

    def __init__(self, h: Health) -> None:
        self.h = h

    def request(self, rpc, msg, timeout=None):
        if rpc is HEALTH:
            return self.h
        assert rpc is CONNECT
        return Connected(decode=msg.decode, boot=msg.boot or "", epoch=self.h.epoch, stages=[])

    def close(self) -> None:
        pass


def test_router_config_refuses_bad_affinity_settings():
    with pytest.raises(ConfigError, match="affinity_min_gain_pages = 0 must be >= 1"):
        RouterConfig(prefill=("a:1",), decode=("b:2",), affinity_min_gain_pages=0)
    with pytest.raises(ConfigError, match="affinity_max_imbalance = -1"):
        RouterConfig(prefill=("a:1",), decode=("b:2",), affinity_max_imbalance=-1)
