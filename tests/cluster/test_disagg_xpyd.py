"""2P2D: one router over two prefill and two decode `dsakv serve` processes, shared by every test of the module
(mooncake; one 2P2D run over nixl on its own cluster first). In order:

- nixl: four prompts spread over both decodes and both prefills; tokens equal a colocated engine.
- mooncake: the same, then a prompt sharing two pages with one of them goes to the prefill that reported those
  pages in its cache events (its cache hits exactly 32 tokens); the router's mirror of each prefill's cache has
  exactly as many pages as the prefill's own cache; after that prefill evicted them (long prompts through a
  second router that reaches only it), the router's mirror no longer has them and the same prompt goes by load.
- the instance table: router /health rows and labelled /metrics per instance.
- a soak: 500 requests at concurrency 16, every one exact; then nothing is in flight anywhere (router ledger,
  decode pages/inbound/running, prefill jobs/request pages) and every ledger balances.
- kill -9 one prefill with requests in flight: only requests dispatched to it fail (fast, naming it), the rest
  are exact, no survivor holds a page, and the restarted process rejoins and serves. Then the same for a decode.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dsakv.disagg.protocol.lifecycle import Phase
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.protocol.page_hashes import page_hashes
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, free_ports, run_requests, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)
SHORT = SamplingParams(max_new_tokens=2, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=128, ignore_eos=True)
MC = ["--mooncake-timeout", "5", "--rpc-timeout", "3"]
PREFILL = ["--prefix-cache", "--num-pages", "48"]
KV_TIMEOUT = 20.0  # generous: the machine may be loaded; a killed peer's requests must fail well before it
FAST = 6.0  # ... within this long of the kill (the decode pings the prefill it waits for every 0.5 s)
PREFILL_PAGES = 48  # a small prefill pool: its prefix cache evicts after a few long prompts


def _rand(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def reference():
    eng = Engine(
        tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    )
    cache: dict[tuple[int, tuple[int, ...]], list[int]] = {}

    def ref(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        missing = list({tuple(p): p for p in prompts if (params.max_new_tokens, tuple(p)) not in cache}.values())
        for p, out in zip(missing, eng.generate(missing, params) if missing else [], strict=True):
            cache[(params.max_new_tokens, tuple(p))] = out
        return [cache[(params.max_new_tokens, tuple(p))] for p in prompts]

    return ref


def _held_by_requests(addr: str) -> tuple[int, int, str]:
    h = fetch_health(addr, timeout=3.0)
    return h.pages_used - (h.cache_pages or 0), h.jobs or 0, h.integrity


def _start_2p2d(cluster: Cluster, backend: str, ports: dict[str, int], extra: list[str]):
    decodes = [cluster.decode(f"d{i}", backend, True, ports[f"d{i}"], extra=extra) for i in range(2)]
    prefills = [
        cluster.prefill(f"p{i}", backend, True, (12,), ports[f"p{i}"], extra=[*extra, *PREFILL])[0] for i in range(2)
    ]
    cluster.wait_healthy([*decodes, *prefills], timeout=180)
    router = cluster.router([p.addr for p in prefills], [d.addr for d in decodes], kv_timeout=KV_TIMEOUT)
    # wait_ready means one pair is handshaken; every prefill pairs with every decode, so wait for all four
    wait_for(lambda: len(router.peers.usable_pairs()) == 4, 90, "all 4 pairs handshaken", [*decodes, *prefills])
    return decodes, prefills, router


def _spread(router, decodes, prefills, prompts, want, tag):
    """The prompts at once: tokens exact, both decodes and both prefills used (from their own counters)."""
    dec0 = [fetch_health(d.addr).counters.get("prealloc", 0) for d in decodes]
    pre0 = [fetch_health(p.addr).counters.get("submitted", 0) for p in prefills]
    got = run_requests(router, prompts, GREEDY, tag)
    assert [t for t, _, _ in got] == want, got
    assert [(r, e) for _, r, e in got] == [("length", None)] * len(prompts)
    # by load: 2 + 2 when all four are dispatched before the first finishes (the usual case); a request that
    # finished early frees its slot, so only "each one used, 4 in all" is certain
    n_dec = [fetch_health(d.addr).counters["prealloc"] - b for d, b in zip(decodes, dec0, strict=True)]
    n_pre = [fetch_health(p.addr).counters["submitted"] - b for p, b in zip(prefills, pre0, strict=True)]
    assert min(n_dec) >= 1 and sum(n_dec) == len(prompts), n_dec
    assert min(n_pre) >= 1 and sum(n_pre) == len(prompts), n_pre
    return n_pre


def _mirror_synced(router, prefills) -> bool:
    """The router's mirror of each prefill's cache holds exactly as many pages as that prefill's cache."""
    rows = {r["addr"]: r for r in router.health()["prefill"]}
    return all(rows[p.addr]["cached_prefix_pages"] == fetch_health(p.addr).cache_pages for p in prefills)


def test_2p2d_over_nixl(tmp_path, reference):
    g = torch.Generator().manual_seed(15)
    prompts = [_rand(g, n) for n in (9, 33, 18, 50)]
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path)
    try:
        ports = {"d0": free_ports(1), "d1": free_ports(1), "p0": free_ports(2), "p1": free_ports(2)}
        decodes, prefills, router = _start_2p2d(cluster, "nixl", ports, ["--rpc-timeout", "3"])
        _spread(router, decodes, prefills, prompts, reference(prompts, GREEDY), "nixl")
        assert_clean([d.addr for d in decodes], procs=cluster.procs)
        for p in prefills:
            wait_for(lambda p=p: _held_by_requests(p.addr) == (0, 0, "ok"), 20, f"{p.name} settled", cluster.procs)
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("xpyd"))
    ports = {"d0": free_ports(1), "d1": free_ports(1), "p0": free_ports(2), "p1": free_ports(2)}
    try:
        decodes, prefills, router = _start_2p2d(cluster, "mooncake", ports, MC)
        yield cluster, ports, decodes, prefills, router
    finally:
        cluster.close()


def test_two_prefill_two_decode_behind_one_router(world, reference):
    cluster, _, decodes, prefills, router = world
    g = torch.Generator().manual_seed(14)
    prompts = [_rand(g, n) for n in (7, 16, 41, 23)]
    follow = prompts[2][:32] + _rand(g, 9)  # 2 pages shared with prompt 2
    n_pre = _spread(router, decodes, prefills, prompts, reference(prompts, GREEDY), "xpyd")
    assert router.counters["routed_load_total"] == 4 and router.counters["routed_affinity_total"] == 0

    # the prefills' cache events reach the router: its mirror has each prefill's pages, 0 + 1 + 2 + 1 in all
    wait_for(lambda: _mirror_synced(router, prefills), 10, "router mirrors both caches", cluster.procs)
    rows = {r["addr"]: r for r in router.health()["prefill"]}
    assert sum(rows[p.addr]["cached_prefix_pages"] for p in prefills) == 4
    holder = [p for p in prefills if router.peers.affinity.has(p.addr, page_hashes(prompts[2], PAGE_SIZE)[1])]
    assert len(holder) == 1, rows

    hits0 = [fetch_health(p.addr).prefix_cache["hit_tokens"] for p in prefills]  # type: ignore[index]
    got = run_requests(router, [follow], GREEDY, "xpyd-follow")
    assert got == [(reference([follow], GREEDY)[0], "length", None)]
    assert (router.counters["routed_affinity_total"], router.counters["routed_matched_pages_total"]) == (1, 2)
    raw = [fetch_health(p.addr).prefix_cache["hit_tokens"] - b for p, b in zip(prefills, hits0, strict=True)]  # type: ignore[index]
    assert raw == [32 if p is holder[0] else 0 for p in prefills], raw

    table = router.health()
    rows = {r["addr"]: r for r in table["prefill"] + table["decode"]}
    picked = [n + (p is holder[0]) for n, p in zip(n_pre, prefills, strict=True)]
    assert [rows[p.addr]["picked"] for p in prefills] == picked
    assert [rows[p.addr]["picked_affinity"] for p in prefills] == [int(p is holder[0]) for p in prefills]
    assert sum(rows[d.addr]["picked"] for d in decodes) == 5
    assert table["routing"]["affinity_min_gain_pages"] == 1
    assert all(rows[p.addr]["cache_events"]["error"] is None for p in prefills), rows

    # the holder evicts them: 3 distinct 20-page prompts through a router that reaches only the holder push
    # 60 pages through its 48-page pool (LRU: the oldest pages, prompt 2's among them, go first)
    side = cluster.router([holder[0].addr], [d.addr for d in decodes], kv_timeout=KV_TIMEOUT)
    try:
        assert side.wait_ready(30)
        for i in range(3):
            got = run_requests(side, [_rand(g, 320)], SHORT, f"evict-{i}")
            assert got[0][1] == "length", got
    finally:
        side.stop()
    shared = page_hashes(follow, PAGE_SIZE)[:2]
    wait_for(
        lambda: _mirror_synced(router, prefills) and not router.peers.affinity.has(holder[0].addr, shared[0]),
        10,
        "the router saw the eviction",
        cluster.procs,
    )
    assert not any(router.peers.affinity.has(p.addr, h) for p in prefills for h in shared)
    hits0 = [fetch_health(p.addr).prefix_cache["hit_tokens"] for p in prefills]  # type: ignore[index]
    got = run_requests(router, [follow], GREEDY, "xpyd-evicted")
    assert got == [(reference([follow], GREEDY)[0], "length", None)]
    assert (router.counters["routed_affinity_total"], router.counters["routed_load_total"]) == (1, 5)
    assert router.counters["routed_matched_pages_total"] == 2
    raw = [fetch_health(p.addr).prefix_cache["hit_tokens"] - b for p, b in zip(prefills, hits0, strict=True)]  # type: ignore[index]
    assert raw == [0, 0], raw  # nothing was cached anywhere: nothing hit

    assert_clean([d.addr for d in decodes], procs=cluster.procs)
    for p in prefills:  # the prefix cache keeps its pages; no request holds one
        wait_for(lambda p=p: _held_by_requests(p.addr) == (0, 0, "ok"), 20, f"{p.name} settled", cluster.procs)


def test_instance_table_in_router_health_and_metrics(world):
    cluster, _, decodes, prefills, router = world
    wait_for(lambda: _mirror_synced(router, prefills), 10, "router mirrors both caches", cluster.procs)
    h = router.health()
    m = router.metrics()
    for row in h["prefill"] + h["decode"]:
        lab = f'{{role="{"prefill" if row in h["prefill"] else "decode"}",addr="{row["addr"]}",name="{row["name"]}"}}'
        assert row["ok"] and m[f"instance_up{lab}"] == 1.0
        assert m[f"instance_in_flight{lab}"] == row["in_flight"] == 0
        assert m[f"instance_picked_total{lab}"] == row["picked"]
        assert m[f"instance_pages_used{lab}"] == row["pages_used"]
        pages = PREFILL_PAGES if row in h["prefill"] else NUM_PAGES
        assert m[f"instance_pages_total{lab}"] == row["pages_total"] == pages
        assert m[f"instance_integrity_ok{lab}"] == 1.0
        if row in h["prefill"]:
            assert m[f"instance_cached_prefix_pages{lab}"] == row["cached_prefix_pages"]
            assert m[f"instance_picked_affinity_total{lab}"] == row["picked_affinity"]
            assert m[f"instance_prefix_hit_tokens_total{lab}"] == row["prefix_cache"]["hit_tokens"]
    assert {r["name"] for r in h["prefill"]} == {"p0", "p1"}
    from dsakv.serve.metrics import ServerMetrics

    text = ServerMetrics().render(m, router.name)
    p0 = h["prefill"][0]
    line = f'dsakv_instance_cached_prefix_pages{{role="prefill",addr="{p0["addr"]}",name="p0"}} '
    assert line + str(p0["cached_prefix_pages"]) in text.splitlines(), text
    assert text.count("# TYPE dsakv_instance_up gauge") == 1


def test_soak_500_requests_concurrency_16(world, reference):
    cluster, _, decodes, prefills, router = world
    g = torch.Generator().manual_seed(16)
    distinct = [_rand(g, int(n)) for n in torch.randint(3, 40, (40,), generator=g)]
    want = reference(distinct, SHORT)
    before = dict(router.counters)
    out: list[tuple[int, list[int], str | None]] = [None] * 500  # type: ignore[list-item]

    def one(i: int) -> None:
        rid = f"soak-{i}"
        router.submit(rid, distinct[i % 40], SHORT)
        toks: list[int] = []
        reason = None
        for ev in router.events(rid, 60.0):
            toks += ev.new_token_ids
            if ev.finished:
                reason = ev.error or ev.finish_reason
        out[i] = (i, toks, reason)

    t0 = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(one, range(500)))
    wall = time.monotonic() - t0
    bad = [(i, t, r) for i, t, r in out if r != "length" or t != want[i % 40]]
    assert not bad, bad[:5]
    c = router.counters
    delta = {k: c[k] - before[k] for k in ("requests_total", "finished_total", "failed_total", "retries_total")}
    assert (delta["requests_total"], delta["finished_total"], delta["failed_total"]) == (500, 500, 0), delta
    print(f"soak: 500 requests at concurrency 16 in {wall:.1f}s, retries {delta['retries_total']}")
    # nothing left in flight: the router's ledger is empty, every decode and prefill back to its baseline
    book = router.book
    assert (len(book.ledger), len(book.queue), len(book.by_wire), router.metrics()["router_in_flight"]) == (0, 0, 0, 0)
    assert all(p.inflight == 0 for p in (*router.prefills.values(), *router.decodes.values()))
    assert_clean([d.addr for d in decodes], procs=cluster.procs)
    for d in decodes:
        h = fetch_health(d.addr)
        assert (h.inbound, h.failed_held, h.running, h.waiting) == (0, 0, 0, 0), h
    for p in prefills:
        wait_for(lambda p=p: _held_by_requests(p.addr) == (0, 0, "ok"), 20, f"{p.name} settled", cluster.procs)
        h = fetch_health(p.addr)
        assert (h.transfers_in_flight, h.running, h.waiting, h.awaiting_release) == (0, 0, 0, 0), h


def _burst(router, prompts, params, tag):
    rids = [f"{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        router.submit(rid, p, params)
    return rids


def _collect(router, rids, timeout=90.0) -> dict[str, tuple]:
    """rid -> (tokens, reason, error, when its last event arrived): one reader thread per request, so a failed
    request's time is its own and not that of the requests read before it."""
    out: dict[str, tuple] = {}

    def read(rid: str) -> None:
        toks, reason, error = [], None, None
        for ev in router.events(rid, timeout):
            toks += ev.new_token_ids
            if ev.finished:
                reason, error = ev.finish_reason, ev.error
        out[rid] = (toks, reason, error, time.monotonic())

    threads = [threading.Thread(target=read, args=(rid,), daemon=True) for rid in rids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 5)
    return out


def _where(router, rids) -> dict[str, tuple[str | None, str | None, Phase]]:
    """rid -> (prefill, decode, phase) as the router has it now."""
    out = {}
    for rid in rids:
        r = router.record(rid)
        if r is not None:
            out[rid] = (r.prefill, r.decode, r.phase)
    return out


def _check_kill(got, at_kill, victim_addr, role, want, t_kill, rids):
    failed = [rid for rid in rids if got[rid][1] != "length"]
    assert failed, f"no request of {victim_addr} was in flight at the kill: {at_kill}"
    for rid in rids:
        toks, reason, error, t_end = got[rid]
        if reason == "length":
            assert toks == want[rid], (rid, toks, want[rid])
            continue
        mine = False
        for snap in at_kill:  # just before and just after the kill (a request may be dispatched in between)
            pre, dec, phase = snap.get(rid, (None, None, Phase.QUEUED))
            if role == "prefill":
                mine |= pre == victim_addr and phase in (Phase.DISPATCHED, Phase.DONE)
            else:
                mine |= dec == victim_addr
        assert mine, (rid, [snap.get(rid) for snap in at_kill], error)  # only the victim's requests fail
        assert reason == "error" and error is not None and victim_addr in error, (rid, error)
        assert t_end - t_kill < FAST, (rid, t_end - t_kill, error)
    return failed


def _taken(victim, router) -> tuple[int, int]:
    """(SUBMITs the prefill `victim` accepted, of those the ones whose reply reached the router), both counted from
    the process's start / the router's."""
    return fetch_health(victim.addr).counters["submitted"], router.peers.prefills[victim.addr].picked


def _wait_computing(victim, cluster: Cluster, router, taken0: tuple[int, int], timeout: float = 30.0) -> None:
    """Until the prefill `victim` holds a job it has not finished computing (`jobs` counts the ones awaiting their
    decode's release too, whose KV is already sent: a kill then fails nobody, the race that made this test flaky)
    and the router has the reply of every SUBMIT it took since `taken0` (_taken before the burst; ci32: the job
    computing was one whose SUBMIT reply the kill cut off, so the router re-queued it and it succeeded elsewhere).
    Polled without a pause; the reply comes between two steps of a prompt longer than one step, so the job still
    has a step, its transfer and its report ahead when the kill lands right after the reply."""
    end = time.monotonic() + timeout
    last = None
    while time.monotonic() < end:
        h = fetch_health(victim.addr, timeout=3.0)
        known = router.peers.prefills[victim.addr].picked - taken0[1]  # read after the health: it covers its jobs
        last = (h.jobs, h.awaiting_release, h.counters["submitted"] - taken0[0], known)
        if (h.jobs or 0) - (h.awaiting_release or 0) >= 1 and known >= h.counters["submitted"] - taken0[0]:
            return
        if not victim.alive():
            raise AssertionError(f"{victim.name} exited before it was busy:\n{victim.tail()}")
    raise AssertionError(
        f"{victim.name} never held a job still computing that the router knew of in {timeout}s "
        f"(jobs, awaiting, accepted, replies: {last})"
    )


def _revive(cluster: Cluster, ports, decodes, prefills, router) -> None:
    """Every peer of the module's 2P2D alive and paired (a kill test that failed before restarting its victim
    must not fail the next test too)."""
    dead = [i for i, p in enumerate(prefills) if not p.alive()], [i for i, d in enumerate(decodes) if not d.alive()]
    for i in dead[0]:
        prefills[i] = cluster.prefill(f"p{i}", "mooncake", True, (12,), ports[f"p{i}"], extra=[*MC, *PREFILL])[0]
    for i in dead[1]:
        decodes[i] = cluster.decode(f"d{i}", "mooncake", True, ports[f"d{i}"], extra=MC)
    if dead[0] or dead[1]:
        cluster.wait_healthy([*(prefills[i] for i in dead[0]), *(decodes[i] for i in dead[1])], timeout=120)
    wait_for(lambda: len(router.peers.usable_pairs()) == 4, 60, "all 4 pairs usable", cluster.procs)


def test_prefill_killed_with_requests_in_flight_then_rejoins(world, reference):
    cluster, ports, decodes, prefills, router = world
    g = torch.Generator().manual_seed(17)
    # 8 x 38 pages: one at a time fills a prefill pool (48 pages), so the victim has queued work; each prompt is
    # three 256-token steps, so between two of its steps the victim holds a job it has not finished computing
    prompts = [_rand(g, 600) for _ in range(8)]
    rids = [f"pkill-{i}" for i in range(len(prompts))]
    want = dict(zip(rids, reference(prompts, GREEDY), strict=True))
    _revive(cluster, ports, decodes, prefills, router)
    victim = prefills[1]
    taken0 = _taken(victim, router)
    _burst(router, prompts, GREEDY, "pkill")
    _wait_computing(victim, cluster, router, taken0)
    before = _where(router, rids)
    t_kill = time.monotonic()
    victim.kill()
    at_kill = [before, _where(router, rids)]
    got = _collect(router, rids)
    assert len(got) == len(rids), got
    failed = _check_kill(got, at_kill, victim.addr, "prefill", want, t_kill, rids)
    print(f"prefill kill: {len(failed)} of {len(rids)} failed:", [got[r][2] for r in failed][:2])
    others = [p for p in prefills if p is not victim]
    assert_clean([d.addr for d in decodes], procs=cluster.procs)
    wait_for(lambda: _held_by_requests(others[0].addr) == (0, 0, "ok"), 20, "surviving prefill settled", cluster.procs)
    assert router.peers.affinity.size(victim.addr) == 0  # its mirror went with it
    # restarted on the same port: the router sees a new boot, pairs it with both decodes, and uses it
    prefills[1] = cluster.prefill("p1", "mooncake", True, (12,), ports["p1"], extra=[*MC, *PREFILL])[0]
    cluster.wait_healthy([prefills[1]], timeout=120)
    wait_for(lambda: len(router.peers.usable_pairs()) == 4, 60, "the restarted prefill paired", cluster.procs)
    again = [_rand(g, 20) for _ in range(4)]
    res = run_requests(router, again, GREEDY, "pkill-again")
    assert [t for t, _, _ in res] == reference(again, GREEDY), res
    assert fetch_health(prefills[1].addr).counters["submitted"] >= 1  # a new process: counted from 0
    assert_clean([d.addr for d in decodes], procs=cluster.procs)


def test_decode_killed_with_requests_in_flight_then_rejoins(world, reference):
    cluster, ports, decodes, prefills, router = world
    g = torch.Generator().manual_seed(18)
    prompts = [_rand(g, 20) for _ in range(8)]
    rids = [f"dkill-{i}" for i in range(len(prompts))]
    want = dict(zip(rids, reference(prompts, LONG), strict=True))
    _revive(cluster, ports, decodes, prefills, router)
    victim = decodes[1]
    _burst(router, prompts, LONG, "dkill")
    wait_for(
        lambda: all((fetch_health(d.addr).running or 0) >= 1 for d in decodes), 20, "both decodes run", cluster.procs
    )
    before = _where(router, rids)
    t_kill = time.monotonic()
    victim.kill()
    at_kill = [before, _where(router, rids)]
    got = _collect(router, rids)
    assert len(got) == len(rids), got
    failed = _check_kill(got, at_kill, victim.addr, "decode", want, t_kill, rids)
    assert all("unavailable" in got[r][2] for r in failed), [got[r][2] for r in failed]
    print(f"decode kill: {len(failed)} of {len(rids)} failed:", [got[r][2] for r in failed][:2])
    survivor = decodes[0]
    assert_clean([survivor.addr], procs=cluster.procs)
    for p in prefills:  # the prefills' transfers to the dead decode fail; then no request holds a page
        wait_for(lambda p=p: _held_by_requests(p.addr) == (0, 0, "ok"), 30, f"{p.name} settled", cluster.procs)
    decodes[1] = cluster.decode("d1", "mooncake", True, ports["d1"], extra=MC)
    cluster.wait_healthy([decodes[1]], timeout=120)
    wait_for(lambda: len(router.peers.usable_pairs()) == 4, 60, "the restarted decode paired", cluster.procs)
    prealloc0 = fetch_health(decodes[1].addr).counters.get("prealloc", 0)
    again = [_rand(g, 20) for _ in range(4)]
    res = run_requests(router, again, GREEDY, "dkill-again")
    assert [t for t, _, _ in res] == reference(again, GREEDY), res
    assert fetch_health(decodes[1].addr).counters["prealloc"] > prealloc0
    assert_clean([d.addr for d in decodes], procs=cluster.procs)
