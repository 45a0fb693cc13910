"""A decode instance with DP attention x PP (`dsakv serve --role decode --pp-size 2 --tp-size 2 --dp-size 2
--enable-dp-attention --ep-size 2`, each stage started with its --pp-rank; (0, s) starts (1, s)): four cells (DP rank
d, stage s), each its own pool of stage s's layers for DP rank d's requests, stage s's MoE expert-parallel over
(0, s) and (1, s) (decode/dp_pipe.py), fed by a TP-1 prefill over Mooncake.

Checked, exactly: greedy and seeded tokens equal the single-rank colocated engine; the router finds DP rank 1 from
rank 0's health and serves requests on both ranks (which one: the cells' `started` counters, and per request the
one DP rank whose stage pairs gained bytes); per request the bytes landed per (prefill, decode (d, s)) pair equal
the pages x that stage's layout bytes per page on the serving DP rank, and nothing on the other; afterwards no
page is held on any cell. A PP 2 prefill (layers 0-4, 5-11) likewise: per (prefill stage i, decode stage j) the
bytes of the keys they share, each decode stage's total its layout figure (each key once). kill -9 of cell (1, 1)
while each DP rank decodes a request: only DP rank 1's request fails, naming 'dp rank 1 pipeline stage 1 (pid N) was
killed by signal 9 (SIGKILL)'; DP rank 0's decodes to its end, its EP groups re-formed without DP rank 1; rank 0's
health and the router take DP rank 1 out; new requests' tokens == one rank; no page held. Supervised (no
--pp-rank): SIGTERM stops every process with exit 0.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.engine.argv import engine_argv
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import (
    DP_ARGS,
    NUM_PAGES,
    PAGE_SIZE,
    Cluster,
    Proc,
    assert_clean,
    run_requests,
    wait_for,
    worker_config,
)
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.testing.listen import child_pids
from dsakv.util.procs import dsakv_cmd, free_ports

pytestmark = [pytest.mark.timeout(600)]

ARCH = "glm_moe_dsa"
PARTITION = (7, 5)  # each DP rank's stages: layers 0-6 and 7-11
DP, PP = 2, 2
LENGTHS = (17, 23, 29, 31)  # two pages each
PAGES_EACH = 2
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=600, ignore_eos=True)  # decodes for seconds: the kill lands mid-decode
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)

g = torch.Generator().manual_seed(83)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "sampled": eng.generate(PROMPTS[:2], SAMPLED)}


def cells(port: int) -> dict[tuple[int, int], str]:
    """(DP rank d, stage s) -> its RPC address: --port + d PP + s."""
    return {(d, s): f"127.0.0.1:{port + d * PP + s}" for d in range(DP) for s in range(PP)}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    backend = "mooncake"  # (nixl passed too, 2026-12-07: left out to keep the module near a minute)
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"decode-dp-pp-{backend}"))
    try:
        spec = ModelSpec.from_path(tiny_path(ARCH))
        port = free_ports(DP * PP + DP)  # the cells' RPC ports, then each DP rank's pipeline rendezvous
        decode = cluster.decode_pp("dq", backend, PARTITION, port=port, extra=[*DP_ARGS, "--stage-timeout", "20"])
        prefill = cluster.prefill("p1", backend, True, (spec.num_layers,))
        cluster.wait_healthy([*prefill, *decode], timeout=300)
        addrs = cells(port)
        for a in addrs.values():
            wait_for(lambda a=a: fetch_health(a, timeout=2.0).ok, 120, f"cell {a} healthy", cluster.procs)
        router = cluster.router([prefill[0].addr], [decode[0].addr])  # DP rank 1 comes from rank 0's health
        wait_for(lambda: len(router.peers.usable_pairs()) == DP, 90, "both DP ranks paired", cluster.procs)
        yield cluster, decode, addrs, prefill, router
    finally:
        cluster.close()


def layouts(spec: ModelSpec) -> list[KVLayout]:
    a, b = PARTITION
    return [
        KVLayout(spec, lo, hi, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
        for lo, hi in ((0, a), (a, a + b))
    ]


def pairs(addr: str) -> dict[str, int]:
    return dict(fetch_health(addr).kv_bytes_pairs or {})


def test_dp2_pp2_tokens_routing_and_bytes_per_cell(world, reference):
    cluster, _, addrs, prefill, router = world
    spec = ModelSpec.from_path(tiny_path(ARCH))
    stage0 = [addrs[(d, 0)] for d in range(DP)]
    for d in range(DP):
        h = fetch_health(stage0[d])
        assert h.ok and h.down is None and (h.stage, h.num_stages) == (0, PP), h
        assert (h.dp_rank, h.dp_size, h.dp_addrs) == (d, DP, stage0), h
        assert h.name == f"dq.dp{d}"
        assert [(row.stage, row.rpc, row.ok) for row in h.pipeline] == [(s, addrs[(d, s)], True) for s in range(PP)], (
            h.pipeline
        )
        assert [list(row.layers) for row in h.pipeline] == [[0, 6], [7, 11]]

    got = run_requests(router, PROMPTS, GREEDY, "dq-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert {(r, e) for _, r, e in got} == {("length", None)}
    got = run_requests(router, PROMPTS[:2], SAMPLED, "dq-s")
    assert [t for t, _, _ in got] == reference["sampled"], got

    # the router spreads by load: four long requests at once decode two on each DP rank
    rids = [f"dq-spread-{i}" for i in range(4)]
    for rid, p in zip(rids, PROMPTS, strict=True):
        router.submit(rid, list(p), LONG)
    wait_for(lambda: [fetch_health(a).running for a in stage0] == [2, 2], 90, "two on each DP rank", cluster.procs)
    for rid in rids:
        router.abort(rid)
    assert_clean([*stage0, prefill[0].addr], procs=cluster.procs)

    # each DP rank's cells received its own requests' keys, each key once: pages x the stage's bytes per page
    lays = layouts(spec)
    hs = [fetch_health(a) for a in stage0]
    started = [h.counters["started"] for h in hs]
    assert sum(started) == len(PROMPTS) + 2 + 4 and min(started) >= 2, started
    for d, h in enumerate(hs):
        want = {f"p1:0->{s}": started[d] * PAGES_EACH * lays[s].bytes_per_page for s in range(PP)}
        assert h.kv_bytes_pairs == want, (d, started, h.kv_bytes_pairs)

    # one request at a time: exactly one DP rank's pairs gain, by that request's pages; the other rank's nothing
    served = []
    for i, prompt in enumerate(PROMPTS[:3]):
        was = [pairs(a) for a in stage0]
        (out,) = run_requests(router, [prompt], GREEDY, f"dq-one-{i}")
        assert out[0] == reference["greedy"][i], out
        now = [pairs(a) for a in stage0]
        gained = [{k: v - was[r].get(k, 0) for k, v in now[r].items() if v != was[r].get(k, 0)} for r in range(DP)]
        d = next(r for r in range(DP) if gained[r])
        assert gained[d] == {f"p1:0->{s}": PAGES_EACH * lays[s].bytes_per_page for s in range(PP)}, gained
        assert gained[1 - d] == {}, gained
        served.append(d)
    print(f"one-at-a-time requests served on DP ranks {served}; started per DP rank {started}")
    assert_clean([*stage0, prefill[0].addr], procs=cluster.procs)
    for d, s in ((0, 1), (1, 1)):  # stage 1's mirrors drop them with stage 0's next step or tick
        wait_for(lambda a=addrs[(d, s)]: fetch_health(a).pages_used == 0, 30, f"cell {d},{s} clean", cluster.procs)


PREFILL_PP = (5, 7)  # a PP 2 prefill across the decode's stages: its stage 1 (layers 5-11) writes both decode stages


def test_pp2_prefill_writes_each_key_once_into_its_dp_ranks_stages(world, reference):
    """A PP 2 prefill (layers 0-4, 5-11) -> the DP 2 x PP 2 decode (0-6, 7-11), one request at a time: tokens == one
    rank; exactly one DP rank gains, per (prefill stage i, decode stage j) the pages x the bytes of the keys they
    share, so each decode stage's total is its layout figure (each key once); the other DP rank gains nothing."""
    cluster, decode, addrs, _, _ = world
    spec = ModelSpec.from_path(tiny_path(ARCH))
    prefill = cluster.prefill("pp", "mooncake", True, PREFILL_PP)
    cluster.wait_healthy(prefill, timeout=240)
    router = cluster.router([prefill[0].addr], [decode[0].addr])
    wait_for(lambda: len(router.peers.usable_pairs()) == DP, 90, "both DP ranks paired with pp", cluster.procs)
    lays = layouts(spec)
    cut = PREFILL_PP[0]
    src = [KVLayout(spec, a, b, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
           for a, b in ((0, cut), (cut, spec.num_layers))]  # fmt: skip
    per_page = {
        f"pp:{i}->{j}": sum(b.page_bytes for k, b in src[i].by_key.items() if k in lays[j].by_key)
        for i in range(2)
        for j in range(PP)
    }
    for j in range(PP):  # every key of a decode stage is held by exactly one prefill stage
        assert sum(per_page[f"pp:{i}->{j}"] for i in range(2)) == lays[j].bytes_per_page, per_page
    stage0 = [addrs[(d, 0)] for d in range(DP)]
    for i, prompt in enumerate(PROMPTS[:2]):
        was = [pairs(a) for a in stage0]
        (out,) = run_requests(router, [prompt], GREEDY, f"dq-pp-{i}")
        assert out[0] == reference["greedy"][i], out
        now = [pairs(a) for a in stage0]
        gained = [{k: v - was[r].get(k, 0) for k, v in now[r].items() if v != was[r].get(k, 0)} for r in range(DP)]
        d = next(r for r in range(DP) if gained[r])
        assert gained[d] == {k: PAGES_EACH * n for k, n in per_page.items() if n}, gained
        assert gained[1 - d] == {}, gained
    assert_clean([*stage0, *(p.addr for p in prefill)], procs=cluster.procs)


def test_killed_cell_dp1_stage1_fails_only_dp_rank_1(world, reference):
    """kill -9 of cell (1, 1) while each DP rank decodes one request: DP rank 1's request fails naming the cell and
    the signal (from DP rank 1's failure event, or, a router that missed it, from rank 0's row of DP rank 1, which
    names why it left), DP rank 0's decodes to its end; DP rank 1 leaves (its stage 0 exits 3), both stages' EP groups
    re-form without it; rank 0's health shows it down and the router routes to DP rank 0 only: new requests'
    tokens == one rank; no page held on DP rank 0's cells or the prefill."""
    cluster, decode, addrs, prefill, router = world
    stage0 = [addrs[(d, 0)] for d in range(DP)]
    rids = [f"dq-kill-{i}" for i in range(DP)]
    for rid, p in zip(rids, PROMPTS[:DP], strict=True):
        router.submit(rid, list(p), LONG)
    wait_for(lambda: [fetch_health(a).running for a in stage0] == [1, 1], 90, "one on each DP rank", cluster.procs)
    (cell,) = child_pids(decode[1].pid)  # (0, 1) started (1, 1)
    os.kill(cell, signal.SIGKILL)
    dead = f"dp rank 1 pipeline stage 1 (pid {cell}) was killed by signal 9 (SIGKILL)"
    ends = []
    for rid in rids:
        n, end = 0, None
        for ev in router.events(rid, 240):
            n += len(ev.new_token_ids)
            if ev.finished:
                end = (ev.finish_reason, ev.error or "")
        ends.append((n, end))
    failed = [e for _, e in ends if e is not None and e[0] == "error"]
    assert len(failed) == 1 and dead in failed[0][1], ends
    assert (LONG.max_new_tokens, ("length", "")) in ends, ends  # DP rank 0's request decoded to its end

    def rank1_down() -> bool:
        rows = fetch_health(stage0[0]).dp_ranks or []
        return [(x.rank, x.up) for x in rows] == [(0, True), (1, False)]

    wait_for(rank1_down, 90, "rank 0's health shows DP rank 1 down", cluster.procs)
    h = fetch_health(stage0[0])
    assert h.ok and h.down is None, h
    # stage 0's exit and why it left (the kill of stage 1, noted in the EP group's store before it exited): a router
    # that missed DP rank 1's failure events fails the request with this row, so it names the kill too
    # (by its rank: between a re-form and the next lockstep round rank 0's own row is not in its health)
    row = next(x.down for x in h.dp_ranks if x.rank == 1) or ""
    assert "dp rank 1 pipeline stage 0" in row and "exited with status 3: it left: " in row and dead in row, row
    wait_for(lambda: len(router.peers.usable_pairs()) == 1, 60, "the router routes to DP rank 0 only", cluster.procs)
    was = fetch_health(stage0[0]).counters["started"]
    got = run_requests(router, PROMPTS, GREEDY, "dq-after")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert fetch_health(stage0[0]).counters["started"] == was + len(PROMPTS)
    print(f"DP rank 1's request failed with: {failed[0][1]}; DP rank 1: {row}")
    assert_clean([stage0[0], prefill[0].addr], procs=cluster.procs)
    wait_for(lambda: fetch_health(addrs[(0, 1)]).pages_used == 0, 30, "cell 0,1 clean", cluster.procs)


def test_supervised_dp_pp_stops_cleanly(tmp_path):
    """`--pp-size 2` + DP 2 without --pp-rank (the supervisor starts (0, 0) and (0, 1); each starts its DP rank 1):
    healthy, then SIGTERM: exit 0, every cell exited 0 (each stage's EP group stopped), none left."""
    port = free_ports(DP * PP + DP)
    args = ["--role", "decode", "--port", str(port), "--transfer-backend", "mooncake", "--pp-size", str(PP)]
    args += [*DP_ARGS, "--worker-name", "dstop", *engine_argv(worker_config(True))]
    p = Proc("dstop", dsakv_cmd("serve", "--model", str(tiny_path(ARCH)), *args), tmp_path / "dstop.log",
             f"127.0.0.1:{port}").start()  # fmt: skip
    try:
        for a in cells(port).values():
            wait_for(lambda a=a: _ok(a), 300, f"cell {a} healthy", [p])
        assert len(_group_pids(p.pid)) == 1 + DP * PP  # the supervisor and the four cells
        p.signal(signal.SIGTERM)
        assert p.wait(120) == 0
    finally:
        p.kill()
    log = (tmp_path / "dstop.log").read_text()
    for s in range(PP):
        assert f"DP group stopped: dp rank 1 pipeline stage {s} exited 0" in log, log[-3000:]
    wait_for(lambda: _group_pids(p.pid) == [], 30, "no process of the instance left", [])


def _ok(addr: str) -> bool:
    try:
        return bool(fetch_health(addr, timeout=2.0).ok)
    except Exception:  # noqa: BLE001 (not listening yet)
        return False


def _group_pids(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and os.getpgid(int(d.name)) == pgid:
                out.append(int(d.name))
        except (ProcessLookupError, PermissionError):
            continue
    return out
