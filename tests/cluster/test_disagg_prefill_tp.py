"""A prefill with TP 2 (`dsakv serve --role prefill --tp-size 2`) feeding a TP-1 and a TP-2 decode, over each real
transfer backend: prefill rank 1 is a process of its own with its own shard, pool and transfer engine; both
prefill ranks hold every key and each sends the share the sender rule gives it (rank_routes.part_routes with
the request's rotation); rank 0 reports the request once both ranks' parts landed.

Checked, exactly: tokens equal the single-rank engine (greedy and seeded); the bytes landed per (prefill rank,
decode rank) pair equal the rule's own figure summed over the requests (each request's rotation: the router's
wire id), each decode rank's total equals the layout figure x pages (every key once), both prefill ranks send
(no rank-0 hotspot) and per key no sender serves more than ceil(receivers / senders) of its receivers; nothing
is held afterwards on either side. A bad --tp-size is refused naming the value.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

import pytest
import torch

from dsakv.disagg.protocol.lifecycle import attempt_id
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.transfer.rank_assign import RankId, assign
from dsakv.disagg.transfer.rank_routes import request_rotation
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path
from dsakv.util import ceil_div
from dsakv.util.procs import dsakv_cmd

pytestmark = [pytest.mark.timeout(420)]

ARCH = "glm_moe_dsa"
LENGTHS = (7, 23, 41)
GREEDY = SamplingParams(max_new_tokens=5, ignore_eos=True)
SAMPLED = SamplingParams(max_new_tokens=5, ignore_eos=True, temperature=0.9, top_k=40, seed=77)
SENDERS = 2


def _prompts(lengths: Sequence[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts(LENGTHS, 37)


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[int]]]:
    eng = Engine(tiny_model(ARCH), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "sampled": eng.generate(PROMPTS[:2], SAMPLED)}


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, tmp_path_factory):
    backend = request.param
    cluster = Cluster(tiny_path(ARCH), tmp_path_factory.mktemp(f"prefill-tp-{backend}"))
    try:
        spec = ModelSpec.from_path(tiny_path(ARCH))
        d1 = cluster.decode("d1", backend, True, extra=["--worker-name", "d1"])
        d2 = cluster.decode("d2", backend, True, extra=["--tp-size", "2", "--worker-name", "d2"])
        prefill = cluster.prefill("ptp", backend, True, (spec.num_layers,), extra=["--tp-size", str(SENDERS)])
        cluster.wait_healthy([*prefill, d1, d2], timeout=240)
        routers = {}
        for tp, d in ((1, d1), (2, d2)):
            routers[tp] = cluster.router([prefill[0].addr], [d.addr])
            assert routers[tp].wait_ready(90), routers[tp].health()
        yield backend, cluster, {1: d1, 2: d2}, prefill, routers
    finally:
        cluster.close()


def _rule(layout: KVLayout, wire_ids: Sequence[str], lengths: Sequence[int], receivers: int) -> dict[str, int]:
    """The sender rule's bytes per (prefill rank, decode rank) pair over the requests (each with its rotation),
    as the decode's health names them; checks its per-key cap on the way."""
    keys = list(layout.by_key)
    weight = {k: b.page_bytes for k, b in layout.by_key.items()}
    out: dict[str, int] = {}
    for wid, n in zip(wire_ids, lengths, strict=True):
        a = assign(
            {RankId(0, 0, t): keys for t in range(SENDERS)},
            {RankId(0, 0, r): keys for r in range(receivers)},
            weight,
            rotate=request_rotation(wid),
        )
        cap = ceil_div(receivers, SENDERS)
        for k in keys:  # each receiver gets each key once, no sender serves more than cap of them
            senders = [a.sender_of(RankId(0, 0, r), k) for r in range(receivers)]
            assert max(senders.count(s) for s in set(senders)) <= cap, (k, senders)
        assert max(a.transfers(s) for s in a.senders) <= cap * len(keys)
        pages = ceil_div(n, PAGE_SIZE)
        for (s, r), nbytes in a.pair_bytes({k: w * pages for k, w in weight.items()}).items():
            key = f"ptp:0.tp{s.tp}->tp{r.tp}"
            out[key] = out.get(key, 0) + nbytes
    return out


@pytest.mark.parametrize("receivers", (1, 2))
def test_prefill_tp2_tokens_and_bytes_per_rank_pair(world, reference, receivers):
    backend, cluster, decodes, prefill, routers = world
    decode, router = decodes[receivers], routers[receivers]
    spec = ModelSpec.from_path(tiny_path(ARCH))
    before = fetch_health(decode.addr).kv_bytes_pairs or {}
    assert before == {}, before

    tag = f"{backend}-p2d{receivers}"
    got = run_requests(router, PROMPTS, GREEDY, f"{tag}-g")
    assert [t for t, _, _ in got] == reference["greedy"], got
    assert {(r, e) for _, r, e in got} == {("length", None)}
    got = run_requests(router, PROMPTS[:2], SAMPLED, f"{tag}-s")
    assert [t for t, _, _ in got] == reference["sampled"], got

    lay = KVLayout(spec, 0, spec.num_layers, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE)
    wire = [attempt_id(f"{tag}-g-{i}", 1) for i in range(len(LENGTHS))]
    wire += [attempt_id(f"{tag}-s-{i}", 1) for i in range(2)]
    lengths = [*LENGTHS, *LENGTHS[:2]]
    want = _rule(lay, wire, lengths, receivers)
    h = fetch_health(decode.addr)
    assert h.kv_bytes_pairs == want, (h.kv_bytes_pairs, want)
    figure = sum(ceil_div(n, PAGE_SIZE) for n in lengths) * lay.bytes_per_page  # every key once, per decode rank
    for r in range(receivers):
        assert sum(n for k, n in want.items() if k.endswith(f"->tp{r}")) == figure
    for s in range(SENDERS):  # both prefill ranks send: no rank-0 hotspot
        assert sum(n for k, n in want.items() if k.startswith(f"ptp:0.tp{s}->")) > 0
    assert h.counters["kv_bytes"] == receivers * figure and h.counters["started"] == len(lengths)
    p = fetch_health(prefill[0].addr)
    assert p.ok and p.counters["transferred"] >= len(lengths), p
    assert_clean([decode.addr, prefill[0].addr], procs=cluster.procs)


def test_prefill_tp_bad_size_is_refused_by_name(tmp_path):
    model = str(tiny_path(ARCH))
    for tp, pp, want in (("0", "1", "--tp-size 0"),):
        out = subprocess.run(
            dsakv_cmd(
                "serve", "--role", "prefill", "--model", model, "--port", "19000", "--tp-size", tp, "--pp-size", pp
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode != 0 and want in out.stderr, (out.returncode, out.stderr[-2000:])
