"""A decode instance with TP 2 x PP 2 (`dsakv serve --role decode --pp-size 2 --tp-size 2`, each stage started with
its --pp-rank; each stage's rank 0 starts its rank 1): the rank grid (stage s, TP rank r), four processes, each with
its shard of stage s's layers, its own pool of them and its own transfer engine (decode/grid.py), fed by a TP-1
prefill (one stage) over Mooncake and a TP 2 x PP 2 prefill (stages 0-4 and 5-11 against the decode's 0-6 and 7-11:
its stage 1 writes both decode stages) over NIXL.

Checked, exactly: greedy and seeded tokens equal the single-rank colocated engine; per request (sent one at a time),
the bytes landed per (prefill rank, decode (stage, rank)) pair equal the sender rule's figure over the keys the
prefill shares with that decode stage (its rotation: the router's wire id), every decode (stage, rank) pool gets each
of its keys once (the pairs into it sum to the layout figure), every prefill rank sends, and per key no sender serves
more than ceil(receivers / senders) of its receivers; afterwards no page is held on either side. A killed decode
(stage 1, TP rank 1), and in an instance of its own (stage 0, TP rank 1), fails the requests in flight naming it, and
the health says down with its name (stage 0's, and stage 1's for its own rank); nothing is held afterwards. Stage 1
killed whole and started again rejoins with new rank pools (same tokens); the supervised grid stops cleanly.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path
from typing import Any

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
from dsakv.testing.cluster import (
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
from dsakv.util import ceil_div
from dsakv.util.procs import dsakv_cmd, free_ports

pytestmark = [pytest.mark.timeout(600)]

ARCH = "glm_moe_dsa"
PARTITION = (7, 5)  # the decode's stages: layers 0-6 and 7-11
TP = 2
LENGTHS = (7, 23, 41)
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
LONG = SamplingParams(max_new_tokens=600, ignore_eos=True)  # decodes for seconds: the kill lands mid-decode
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)
GRID = ["--tp-size", str(TP)]

g = torch.Generator().manual_seed(61)
PROMPTS = [torch.randint(2, 512, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "sampled": eng.generate(PROMPTS[:2], SAMPLED)}


def start(cluster: Cluster, backend: str, senders: int, stages: tuple[int, ...], name: str) -> tuple[list, list, Any]:
    decode = cluster.decode_pp(name, backend, PARTITION, extra=[*GRID, "--stage-timeout", "20"])
    extra = ["--tp-size", str(senders)] if senders > 1 else []
    prefill = cluster.prefill(f"p{name}", backend, True, stages, extra=extra)
    cluster.wait_healthy([*prefill, *decode], timeout=300)
    router = cluster.router([prefill[0].addr], [decode[0].addr])
    assert router.wait_ready(120), router.health()
    return decode, prefill, router


# one prefill shape per backend keeps the run short: TP 1 (one stage) over mooncake, TP 2 x PP 2 over nixl (its
# stages 0-4 and 5-11 against the decode's 0-6 and 7-11: prefill stage 1 writes both decode stages)
SHAPES = (("mooncake", 1, (12,)), ("nixl", 2, (5, 7)))


@pytest.fixture(scope="module", params=SHAPES, ids=("mooncake-ptp1", "nixl-ptp2xpp2"))
def world(request, tmp_path_factory):
    backend, senders, stages = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"decode-grid-{backend}"))
    try:
        decode, prefill, router = start(cluster, backend, senders, stages, "dg")
        yield backend, (senders, stages), cluster, decode, prefill, router
    finally:
        cluster.close()


def stage_layout(spec: ModelSpec, a: int, b: int) -> KVLayout:
    return KVLayout(spec, a, b, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)


def spans(partition: tuple[int, ...]) -> list[tuple[int, int]]:
    starts = [sum(partition[:i]) for i in range(len(partition))]
    return [(a, a + n) for a, n in zip(starts, partition, strict=True)]


def rule_pairs(spec: ModelSpec, prefill: str, shape: tuple[int, tuple[int, ...]], wire_id: str, length: int) -> dict:
    """The sender rule's bytes per (prefill stage and rank, decode (stage, rank)) pair for one request, as the
    decode's health keys them; checks each key's cap, and that every decode pool received each of its keys once
    (the pairs into it sum to its layout figure), on the way."""
    senders, stages = shape
    pages = ceil_div(length, PAGE_SIZE)
    out: dict[str, int] = {}
    got: dict[RankId, int] = {}
    for i, (pa, pb) in enumerate(spans(stages)):
        src = stage_layout(spec, pa, pb)
        held = list(src.by_key)
        weight = {k: b.page_bytes for k, b in src.by_key.items()}
        needs: dict[RankId, list] = {}
        for j, (a, b) in enumerate(spans(PARTITION)):
            common = sorted(stage_layout(spec, a, b).by_key.keys() & src.by_key.keys())
            if common:
                needs |= {RankId(j, 0, r): common for r in range(TP)}
        a = assign({RankId(i, 0, t): held for t in range(senders)}, needs, weight, rotate=request_rotation(wire_id))
        for k in held:  # per key: no sender serves more than ceil(receivers / senders) of its receivers
            recv = [r for r, keys in needs.items() if k in keys]
            per = [sum(1 for r in recv if a.sender_of(r, k) == RankId(i, 0, t)) for t in range(senders)]
            assert max(per) <= ceil_div(len(recv), senders), (k, per)
        for (s, r), nbytes in a.pair_bytes({k: w * pages for k, w in weight.items()}).items():
            src_name = f"{prefill}:{i}.tp{s.tp}" if senders > 1 else f"{prefill}:{i}"
            out[f"{src_name}->{r.stage}.tp{r.tp}"] = nbytes
            got[r] = got.get(r, 0) + nbytes
    figure = {
        RankId(j, 0, r): pages * stage_layout(spec, a, b).bytes_per_page
        for j, (a, b) in enumerate(spans(PARTITION))
        for r in range(TP)
    }
    assert got == figure, (got, figure)  # each key once into every (stage, rank) pool
    return out


def test_decode_tp2_pp2_tokens_and_bytes_per_rank_pair(world, reference):
    backend, shape, cluster, decode, prefill, router = world
    spec = ModelSpec.from_path(tiny_path(ARCH))
    h = fetch_health(decode[0].addr)
    assert h.ok and h.down is None and (h.stage, h.num_stages) == (0, 2), h
    assert [(row.stage, row.ok) for row in h.pipeline] == [(0, True), (1, True)], h.pipeline

    tag = f"{backend}-grid"
    got = run_requests(router, PROMPTS, GREEDY, f"{tag}-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert {(r, e) for _, r, e in got} == {("length", None)}
    got = run_requests(router, PROMPTS[:2], SAMPLED, f"{tag}-s")
    assert [t for t, _, _ in got] == reference["sampled"], got

    senders_seen: set[str] = set()
    for i, prompt in enumerate(PROMPTS):  # one request at a time: the pairs gained exactly the rule's bytes
        before = dict(fetch_health(decode[0].addr).kv_bytes_pairs or {})
        rid = f"{tag}-b-{i}"
        (out,) = run_requests(router, [prompt], GREEDY, rid)
        assert out[0] == reference["greedy"][i], out
        after = dict(fetch_health(decode[0].addr).kv_bytes_pairs or {})
        gained = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        want = rule_pairs(spec, "pdg", shape, attempt_id(f"{rid}-0", 1), len(prompt))
        assert gained == {k: n for k, n in want.items() if n}, (gained, want)
        senders_seen |= {k.split("->")[0] for k, n in want.items() if n > 0}
    assert len(senders_seen) == shape[0] * len(shape[1]), senders_seen  # every prefill rank sent (no rank-0 hotspot)
    assert_clean([decode[0].addr, *(p.addr for p in prefill)], procs=cluster.procs)
    for st in decode[1:]:  # stage 1's mirror drops them with stage 0's next step or tick
        wait_for(lambda a=st.addr: fetch_health(a).pages_used == 0, 30, "stage 1 holds no page", cluster.procs)


def test_killed_decode_stage1_rank1_is_named(world, reference):
    """kill -9 of decode stage 1's TP rank 1 while two requests decode: both fail naming it (stage, rank, pid,
    SIGKILL); stage 0 and stage 1 say down with that name, stage 0 holds no page, the prefill holds nothing."""
    backend, _, cluster, decode, prefill, router = world
    rids = [f"{backend}-kill-{i}" for i in range(2)]
    for rid, p in zip(rids, PROMPTS[:2], strict=True):
        router.submit(rid, list(p), LONG)
    wait_for(lambda: (fetch_health(decode[0].addr).running or 0) == 2, 60, "both requests decoding", cluster.procs)
    (rank1,) = child_pids(decode[1].pid)
    os.kill(rank1, signal.SIGKILL)
    dead = f"stage 1 tp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
    for rid, want in zip(rids, reference["greedy"][:2], strict=True):
        toks: list[int] = []
        end = None
        for ev in router.events(rid, 90):
            toks += ev.new_token_ids
            if ev.finished:
                end = (ev.finish_reason, ev.error or "")
        assert end is not None and end[0] == "error" and dead in end[1], (rid, end, len(toks))
        assert toks[:5] == want[: len(toks[:5])], (toks[:5], want)  # what streamed before the kill was right
    wait_for(lambda: dead in (fetch_health(decode[0].addr).down or ""), 60, "stage 0 names it", cluster.procs)
    h0 = fetch_health(decode[0].addr)
    assert not h0.ok, h0
    h1 = fetch_health(decode[1].addr)
    assert not h1.ok and dead in (h1.down or ""), h1.down
    assert_clean([decode[0].addr, *(p.addr for p in prefill)], procs=cluster.procs)


def test_killed_decode_stage0_rank1_is_named(tmp_path, reference):
    """kill -9 of decode stage 0's TP rank 1 (rank 0's child, which follows its log) while two requests decode: both
    fail naming it; stage 0 says down with its name and holds no page; the prefill holds nothing."""
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        decode, prefill, router = start(cluster, "mooncake", 1, (12,), "dk")
        rids = ["s0-kill-0", "s0-kill-1"]
        for rid, p in zip(rids, PROMPTS[:2], strict=True):
            router.submit(rid, list(p), LONG)
        wait_for(lambda: (fetch_health(decode[0].addr).running or 0) == 2, 60, "both decoding", cluster.procs)
        (rank1,) = child_pids(decode[0].pid)
        os.kill(rank1, signal.SIGKILL)
        dead = f"stage 0 tp rank 1 (pid {rank1}) was killed by signal 9 (SIGKILL)"
        for rid in rids:
            end = None
            for ev in router.events(rid, 90):
                if ev.finished:
                    end = (ev.finish_reason, ev.error or "")
            assert end is not None and end[0] == "error" and dead in end[1], (rid, end)
        h0 = fetch_health(decode[0].addr)
        assert not h0.ok and dead in (h0.down or ""), h0.down
        assert_clean([decode[0].addr, prefill[0].addr], procs=cluster.procs)
    finally:
        cluster.close()


def test_restarted_stage1_rejoins_with_new_rank_pools(tmp_path, reference):
    """kill -9 of decode stage 1's rank 0 (its rank 1 dies with it): stage 0 says down; stage 1 started again (new
    ranks, new pools and manifests) rejoins, stage 0 re-forms under a new boot, the prefill handshakes again and
    the tokens equal one rank's; nothing is held afterwards."""
    cluster = Cluster(tiny_path(ARCH), tmp_path)
    try:
        decode, prefill, router = start(cluster, "mooncake", 1, (12,), "dr")
        got = run_requests(router, PROMPTS[:1], GREEDY, "rejoin-a")
        assert [t for t, _, _ in got] == reference["greedy"][:1], got
        boot = fetch_health(decode[0].addr).boot
        decode[1].kill()
        wait_for(lambda: not fetch_health(decode[0].addr).ok, 60, "stage 0 down", cluster.procs[:1])
        decode[1].start()
        wait_for(lambda: fetch_health(decode[0].addr).ok, 240, "the grid re-formed", cluster.procs)
        assert fetch_health(decode[0].addr).boot != boot
        assert router.wait_ready(120), router.health()
        got = run_requests(router, PROMPTS, GREEDY, "rejoin-b")
        assert [t for t, _, _ in got] == reference["greedy"], got
        assert_clean([decode[0].addr, prefill[0].addr], procs=cluster.procs)
    finally:
        cluster.close()


def test_supervised_grid_stops_cleanly(tmp_path):
    """`--pp-size 2 --tp-size 2` without --pp-rank (the supervisor starts both stages; each stage's rank 0 its rank
    1): healthy, then SIGTERM to the group: exit 0, each stage's rank 0 stopped its rank 1 (exit 0), and no process
    of the instance is left."""
    port = free_ports(3)
    args = ["--role", "decode", "--port", str(port), "--transfer-backend", "mooncake", "--pp-size", "2", *GRID]
    p = Proc("dstop", dsakv_cmd("serve", "--model", str(tiny_path(ARCH)), *args, *engine_argv(worker_config(True))),
             tmp_path / "dstop.log", f"127.0.0.1:{port}").start()  # fmt: skip
    try:
        wait_for(lambda: _ok(p.addr), 300, "the supervised grid healthy", [p])
        assert len(_group_pids(p.pid)) == 5  # supervisor, 2 stages, a TP rank each
        p.signal(signal.SIGTERM)
        assert p.wait(120) == 0
    finally:
        p.kill()
    log = (tmp_path / "dstop.log").read_text()
    for k in (0, 1):
        assert f"stage {k} TP group stopped: stage {k} tp rank 1 exited 0" in log, log[-3000:]
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


def test_refusals_name_what_is_not_built():
    """A TP x PP decode with MTP (with DP attention too) is refused by name before anything starts (exit 2)."""
    base = ["serve", "--role", "decode", "--model", str(tiny_path(ARCH)), "--port", str(free_ports(3))]
    base += ["--pp-size", "2", "--tp-size", "2"]
    cases = [
        (["--speculative-num-steps", "2"], "--speculative-num-steps with --role decode --pp-size 2"),
        (  # DP attention x PP is built (decode/dp_pipe.py), with MTP it is not
            ["--dp-size", "2", "--enable-dp-attention", "--ep-size", "2", "--speculative-num-steps", "2"],
            "--speculative-num-steps with --role decode --pp-size 2",
        ),
    ]
    for extra, want in cases:
        out = subprocess.run(dsakv_cmd(*base, *extra), capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and want in out.stderr, (extra, out.returncode, out.stderr[-2000:])
