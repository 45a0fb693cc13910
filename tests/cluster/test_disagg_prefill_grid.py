"""A prefill with TP 2 x PP 2 (`dsakv serve --role prefill --pp-size 2 --tp-size 2`, each stage started with its
--pp-rank; each stage's rank 0 starts its rank 1) feeding a DP-2 decode (DP attention, EP 2) over Mooncake and a
TP-1 decode over NIXL: the rank grid (stage s, TP rank r), four processes, each with its shard of stage s's
layers, its own pool (every key of stage s) and transfer engine; stage 1's rank 0 relays each step to its rank 1.

Checked, exactly: greedy and seeded tokens equal the single-rank colocated engine; per request (sent one at a
time), the bytes landed per (prefill stage and rank, decode rank) pair equal the sender rule's figure over the
stage's own keys (its rotation: the router's wire id), each decode rank gets every key of the request once (the
pairs sum to the layout figure), every prefill rank of every stage sends, and per key no sender serves more than
ceil(receivers / senders) of its receivers; afterwards no page is held on any rank of either side.
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Sequence

import pytest
import torch

from dsakv.disagg.protocol.lifecycle import attempt_id
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.transfer.rank_assign import RankId, assign
from dsakv.disagg.transfer.rank_routes import request_rotation
from dsakv.engine.argv import engine_argv
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests, wait_for, worker_config
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.testing.listen import child_pids
from dsakv.util import ceil_div
from dsakv.util.procs import dsakv_cmd, free_ports

pytestmark = [pytest.mark.timeout(600)]

ARCH = "glm_moe_dsa"
PARTITION = (7, 5)
SENDERS = 2
LENGTHS = (7, 23, 41)
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)
DP = ["--tp-size", "2", "--dp-size", "2", "--enable-dp-attention", "--ep-size", "2"]

g = torch.Generator().manual_seed(53)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "sampled": eng.generate(PROMPTS[:2], SAMPLED)}


# one backend per decode shape keeps the run short; both backends and both shapes are covered
@pytest.fixture(scope="module", params=(("mooncake", "dp2"), ("nixl", "tp1")), ids=("mooncake-dp2", "nixl-tp1"))
def world(request, tmp_path_factory):
    backend, target = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"prefill-grid-{backend}"))
    try:
        port = free_ports(2)
        if target == "dp2":
            decode = cluster.decode("dg", backend, True, port=port, extra=[*DP, "--worker-name", "dg"])
            ranks = [decode.addr, f"127.0.0.1:{port + 1}"]
        else:
            decode = cluster.decode("dg", backend, True, port=port, extra=["--worker-name", "dg"])
            ranks = [decode.addr]
        prefill = cluster.prefill("pg", backend, True, PARTITION, extra=["--tp-size", str(SENDERS)])
        cluster.wait_healthy([*prefill, decode], timeout=300)
        wait_for(lambda: all(fetch_health(a).ok for a in ranks), 90, "every decode rank healthy", cluster.procs)
        router = cluster.router([prefill[0].addr], [decode.addr])
        wait_for(lambda: len(router.peers.usable_pairs()) == len(ranks), 120, "decode ranks paired", cluster.procs)
        yield backend, target, cluster, ranks, prefill, router
    finally:
        cluster.close()


def stage_layout(spec: ModelSpec, stage: int) -> KVLayout:
    a = sum(PARTITION[:stage])
    return KVLayout(spec, a, a + PARTITION[stage], kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)


def rule_pairs(spec: ModelSpec, wire_id: str, length: int, receiver: str) -> dict[str, int]:
    """The sender rule's bytes per (prefill stage.rank, decode rank) pair for one request whose keys go to one
    decode rank (`receiver`: 'tp0' or 'dpR'); checks the per-key cap on the way."""
    out: dict[str, int] = {}
    for s in range(len(PARTITION)):
        lay = stage_layout(spec, s)
        keys = list(lay.by_key)
        weight = {k: b.page_bytes for k, b in lay.by_key.items()}
        a = assign(
            {RankId(s, 0, t): keys for t in range(SENDERS)},
            {RankId(0, 0, 0): keys},
            weight,
            rotate=request_rotation(wire_id),
        )
        cap = ceil_div(1, SENDERS)  # one receiver per key: each key once, from one sender
        assert all(a.sender_of(RankId(0, 0, 0), k) in a.senders for k in keys)
        assert max(a.transfers(x) for x in a.senders) <= cap * len(keys)
        pages = ceil_div(length, PAGE_SIZE)
        for (x, _), nbytes in a.pair_bytes({k: w * pages for k, w in weight.items()}).items():
            out[f"pg:{s}.tp{x.tp}->{receiver}"] = nbytes
        assert sum(n for key, n in out.items() if key.startswith(f"pg:{s}.")) == pages * lay.bytes_per_page
    return out


def pairs_of(addrs: Sequence[str]) -> list[dict[str, int]]:
    return [dict(fetch_health(a).kv_bytes_pairs or {}) for a in addrs]


def test_prefill_tp2_pp2_tokens_and_bytes_per_rank_pair(world, reference):
    backend, target, cluster, ranks, prefill, router = world
    spec = ModelSpec.from_path(tiny_path(ARCH))
    for k, st in enumerate(prefill):
        h = fetch_health(st.addr)
        assert h.ok and (h.stage, h.num_stages, h.rank_pages) == (k, 2, [0, 0]), h

    tag = f"{backend}-{target}"
    got = run_requests(router, PROMPTS, GREEDY, f"{tag}-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert {(r, e) for _, r, e in got} == {("length", None)}
    got = run_requests(router, PROMPTS[:2], SAMPLED, f"{tag}-s")
    assert [t for t, _, _ in got] == reference["sampled"], got
    assert_clean([*ranks, *(p.addr for p in prefill)], procs=cluster.procs)

    # one request at a time: the decode rank it landed on gained exactly the rule's bytes per pair
    senders_seen: set[str] = set()
    for i, prompt in enumerate(PROMPTS):
        before = pairs_of(ranks)
        rid = f"{tag}-b-{i}"
        (out,) = run_requests(router, [prompt], GREEDY, rid)
        assert out[0] == reference["greedy"][i], out
        after = pairs_of(ranks)
        diff = zip(after, before, strict=True)
        gained = [{k: v - b.get(k, 0) for k, v in a.items() if v != b.get(k, 0)} for a, b in diff]
        hit = [r for r, d in enumerate(gained) if d]
        assert len(hit) == 1, gained  # its keys went to its decode rank only, each once
        r = hit[0]
        receiver = f"dp{r}" if target == "dp2" else "tp0"
        want = rule_pairs(spec, attempt_id(f"{rid}-0", 1), len(prompt), receiver)
        assert gained[r] == want, (gained[r], want)
        senders_seen |= {k.split("->")[0] for k, n in want.items() if n > 0}
    # every rank of the grid sent (no rank-0 hotspot, no dummy)
    assert senders_seen == {f"pg:{s}.tp{t}" for s in range(2) for t in range(SENDERS)}, senders_seen

    assert_clean([*ranks, *(p.addr for p in prefill)], procs=cluster.procs)
    for st in prefill:  # every rank of every stage: no page in use
        clean = lambda a=st.addr: fetch_health(a).rank_pages == [0, 0]  # noqa: E731
        wait_for(clean, 30, "every TP rank's pool clean", cluster.procs)


def test_mismatched_rank_grids_are_refused_naming_both(tmp_path):
    """Prefill stage 0 registered with TP 2 x PP 2; a stage 1 started with --tp-size 1 is refused by the decode's
    handshake naming both grids (startup fails loudly, exit 2)."""
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        decode = cluster.decode("dv", "mooncake", True, extra=["--worker-name", "dv"])
        cluster.wait_healthy([decode], timeout=120)
        port = free_ports(3)
        extra = ["--tp-size", "2", "--decode", decode.addr]
        (s0,) = cluster.prefill("pv", "mooncake", True, PARTITION, port=port, ranks=[0], extra=extra)
        wait_for(lambda: bool(fetch_health(s0.addr).links), 180, "stage 0 handshook the decode", cluster.procs)
        args = ["--role", "prefill", "--port", str(port), "--transfer-backend", "mooncake", "--pp-size", "2"]
        args += ["--pp-partition", ",".join(map(str, PARTITION)), "--worker-name", "pv", "--pp-rank", "1"]
        args += [*engine_argv(worker_config(True)), "--tp-size", "1", "--decode", decode.addr]
        out = subprocess.run(
            dsakv_cmd("serve", "--model", str(tiny_path(ARCH)), *args), capture_output=True, text=True, timeout=180
        )
        assert out.returncode == 2, (out.returncode, out.stderr[-3000:])
        want = (
            "prefill 'pv' stage 1 announces a rank grid of 2 stage(s) x TP 1, but its stage 0 (boot "
            f"{fetch_health(s0.addr).boot} at {s0.addr}) registered 2 stage(s) x TP 2"
        )
        assert want in out.stderr, out.stderr[-3000:]
    finally:
        cluster.close()


@pytest.mark.parametrize("stage", (0, 1))
def test_dead_rank_takes_the_prefill_down_naming_it(tmp_path, stage):
    """kill -9 of stage s's TP rank 1 while two requests' transfers are in flight (--debug-transfer-delay): both
    fail naming (stage s, tp rank 1, pid, SIGKILL); stage s and stage 0 say down with that name (so stage 0
    refuses submissions); no page is held on stage 0 (and on its rank 1 when it lives) or the decode."""
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        decode = cluster.decode("dk", "nixl", True, extra=["--worker-name", "dk"])
        extra = ["--tp-size", "2", "--debug-transfer-delay", "4"]
        prefill = cluster.prefill("pk", "nixl", True, PARTITION, extra=extra)
        cluster.wait_healthy([*prefill, decode], timeout=300)
        router = cluster.router([prefill[0].addr], [decode.addr])
        wait_for(lambda: len(router.peers.usable_pairs()) == 1, 120, "the decode paired", cluster.procs)
        rids = [f"kill{stage}-0", f"kill{stage}-1"]
        for rid, p in zip(rids, PROMPTS[:2], strict=True):
            router.submit(rid, list(p), GREEDY)
        victim = prefill[stage]
        wait_for(lambda: fetch_health(victim.addr).transfers_in_flight == 2, 60, "stage sending", cluster.procs)
        (rank1,) = child_pids(victim.pid)
        os.kill(rank1, signal.SIGKILL)
        dead = f"stage {stage} tp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
        for rid in rids:
            end = None
            for ev in router.events(rid, 90):
                if ev.finished:
                    end = (ev.finish_reason, ev.error or "")
            assert end is not None and end[0] == "error" and dead in end[1], (rid, end)
        hs = fetch_health(victim.addr)
        assert not hs.ok and hs.down is not None and dead in hs.down, hs.down
        wait_for(lambda: dead in (fetch_health(prefill[0].addr).down or ""), 60, "stage 0 names it", cluster.procs)
        h0 = fetch_health(prefill[0].addr)
        assert not h0.ok and h0.pages_used == 0, h0
        if stage == 1:
            clean = lambda: fetch_health(prefill[0].addr).rank_pages == [0, 0]  # noqa: E731
            wait_for(clean, 30, "stage 0's ranks clean", cluster.procs)
        assert_clean([decode.addr], procs=cluster.procs)
    finally:
        cluster.close()


def test_stage0_killed_mid_transfer_then_the_grid_reforms(tmp_path, reference):
    """kill -9 of stage 0 (its rank 1 dies with it) while both stages' transfers are in flight: the requests fail;
    stage 1 finishes its transfers (its rank 1's parts still reach its rank 0 while the pipeline is down) and holds
    nothing on either rank; stage 0 restarted, the grid re-forms and serves the single-rank tokens; clean pools."""
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        decode = cluster.decode("dr", "mooncake", True, extra=["--worker-name", "dr"])
        port = free_ports(3)
        extra = ["--tp-size", "2", "--debug-transfer-delay", "3"]
        prefill = cluster.prefill("pr", "mooncake", True, PARTITION, port=port, extra=extra)
        cluster.wait_healthy([*prefill, decode], timeout=300)
        router = cluster.router([prefill[0].addr], [decode.addr])
        wait_for(lambda: len(router.peers.usable_pairs()) == 1, 120, "the decode paired", cluster.procs)
        rids = ["reform-0", "reform-1"]
        for rid, p in zip(rids, PROMPTS[:2], strict=True):
            router.submit(rid, list(p), GREEDY)
        s1 = prefill[1].addr
        wait_for(lambda: fetch_health(s1).transfers_in_flight == 2, 60, "stage 1 sending", cluster.procs)
        os.kill(prefill[0].pid, signal.SIGKILL)
        for rid in rids:
            end = None
            for ev in router.events(rid, 90):
                if ev.finished:
                    end = ev.finish_reason
            assert end == "error", (rid, end)
        live = [decode, prefill[1]]
        idle = lambda: (lambda h: (h.transfers_in_flight, h.jobs, h.rank_pages))(fetch_health(s1))  # noqa: E731
        wait_for(lambda: idle() == (0, 0, [0, 0]), 60, "stage 1 drained on both ranks", live)
        (s0,) = cluster.prefill("pr", "mooncake", True, PARTITION, port=port, ranks=[0], extra=extra)
        cluster.wait_healthy([s0, prefill[1]], timeout=300)
        wait_for(lambda: router.wait_ready(0.1), 60, "the router pairs the prefill again", cluster.procs)
        got = run_requests(router, PROMPTS, GREEDY, "reform-again")
        assert [t for t, _, _ in got] == reference["greedy"], got
        assert_clean([decode.addr, s0.addr, s1], procs=[decode, s0, prefill[1]])
        for a in (s0.addr, s1):
            clean = lambda a=a: fetch_health(a).rank_pages == [0, 0]  # noqa: E731
            wait_for(clean, 30, "every TP rank's pool clean", [decode, s0, prefill[1]])
    finally:
        cluster.close()
