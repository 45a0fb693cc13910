"""rank_routes: the sender rule on a handshaken link (parts = decode stage x decode TP rank), for GLM-5.2's
elided decode keys (latent KV + producers' index-K, replicated on every decode rank's pool).

How it maps: prefill TP 1 -> decode TP 2: the one prefill rank writes every key into both pools (cap
ceil(2/1) = 2); prefill TP 2 -> decode TP 1: each key is sent once, by one of the two prefill ranks, the bytes
split between them; prefill TP 2 -> decode TP 2: each prefill rank serves one receiver per key (cap 1).
"""

from __future__ import annotations

import pytest

from dsakv.disagg.transfer import BackendMeta, Manifest, RegionInfo, check_pair
from dsakv.disagg.transfer.bootstrap import DecodeLink, LinkPart
from dsakv.disagg.transfer.plan import PairTable
from dsakv.disagg.transfer.rank_routes import (
    RANK0_ENV,
    link_assignment,
    part_routes,
    rank0_sender,
    request_rotation,
    route_pairs,
)
from dsakv.spec import KVLayout, load_spec
from dsakv.util import ceil_div


def manifest(layout: KVLayout, worker: str, base: int) -> Manifest:
    regions, addr = {}, base
    for b in layout.buffers:
        regions[b.key] = RegionInfo(addr, b.page_bytes, 8)
        addr += b.page_bytes * 8
    return Manifest.from_layout(layout, regions, BackendMeta("local", b""), worker)


@pytest.fixture(scope="module")
def layout() -> KVLayout:
    return KVLayout(load_spec("glm-5.2"), draft_layers=1, elide=True)


def link(layout: KVLayout, ranks: int) -> DecodeLink:
    src = manifest(layout, "prefill", 1 << 32)
    parts = []
    for r in range(ranks):
        dst = manifest(layout, f"decode.tp{r}", (r + 2) << 36)
        pairing = check_pair(src, dst)
        parts.append(LinkPart(0, dst, pairing, PairTable.of(pairing.pairs), None, rank=r, cell=r))  # type: ignore[arg-type]
    return DecodeLink("127.0.0.1:1", "boot", parts[0].manifest, tuple(parts))


def test_tp1_prefill_writes_every_key_into_every_decode_rank(layout) -> None:
    lk = link(layout, 2)
    routes = part_routes(lk, 0, 0, 1, rotate=request_rotation("r1"))
    assert [(p.rank, len(t.pairs)) for p, t in routes] == [(0, len(layout.keys)), (1, len(layout.keys))]
    assert all(t is p.table for p, t in routes)  # the handshake's table, not a copy
    pair_bytes = link_assignment(lk, 0).pair_bytes({b.key: b.page_bytes for b in layout.buffers})
    assert sorted(pair_bytes.values()) == [layout.bytes_per_page] * 2  # == the layout figure per rank pair


@pytest.mark.parametrize("rid", ["a", "b", "req-17"])
def test_tp2_prefill_to_tp1_decode_sends_each_key_once_split_by_bytes(layout, rid) -> None:
    lk = link(layout, 1)
    mine = [part_routes(lk, 0, t, 2, rotate=request_rotation(rid)) for t in (0, 1)]
    keys = [[kp.key for _, tab in m for kp in tab.pairs] for m in mine]
    assert sorted(keys[0] + keys[1]) == sorted(layout.keys)  # each key once, from one of the two
    sent = [sum(kp.page_bytes for _, tab in m for kp in tab.pairs) for m in mine]
    assert sum(sent) == layout.bytes_per_page
    biggest = max(b.page_bytes for b in layout.buffers)
    assert abs(sent[0] - sent[1]) <= biggest  # spread within one key's bytes: no rank-0 hotspot


def test_tp2_prefill_to_tp2_decode_one_receiver_per_sender_per_key(layout) -> None:
    lk = link(layout, 2)
    a = link_assignment(lk, 0, 2, rotate=request_rotation("x"))
    for key in layout.keys:
        senders = [a.sender_of(r, key) for r in sorted({r for _, r in a.routes})]
        assert len(senders) == 2 and len(set(senders)) == 2  # cap ceil(2 / 2) = 1 receiver per sender
    assert max(a.transfers(s) for s in a.senders) <= ceil_div(2, 2) * len(layout.keys)
    mine = part_routes(lk, 0, 1, 2, rotate=request_rotation("x"))
    assert sum(len(t.pairs) for _, t in mine) == a.transfers(a.senders[1])


@pytest.mark.parametrize("receivers", (1, 2))
def test_bench_rank0_sender_switch_routes_every_key_from_rank0(layout, receivers, monkeypatch) -> None:
    """DSAKV_BENCH_RANK0_SENDER=1 (bench/parallel.py's comparison arm): prefill TP rank 0 writes every key into
    every decode rank, rank 1 sends nothing; unset (the default) the rule splits them."""
    lk = link(layout, receivers)
    rid = request_rotation("req-17")
    monkeypatch.setenv(RANK0_ENV, "1")
    assert rank0_sender()
    routes = [part_routes(lk, 0, t, 2, rotate=rid) for t in (0, 1)]
    assert [(p.rank, t is p.table) for p, t in routes[0]] == [(r, True) for r in range(receivers)]
    assert routes[1] == []
    assert route_pairs(lk, 0, 2, rid) == [[0, r] for r in range(receivers)]
    monkeypatch.setenv(RANK0_ENV, "0")
    assert not rank0_sender()
    rule = link_assignment(lk, 0, 2, rotate=rid, rank0=False)
    assert route_pairs(lk, 0, 2, rid) == [list(p) for p in sorted({(s.tp, r.tp) for s, r in rule.routes})]
    assert {s.tp for s, _ in rule.routes} == {0, 1} and part_routes(lk, 0, 1, 2, rotate=rid) != []


def test_tp2_prefill_into_a_tp2_x_pp2_decode_routes_by_cell() -> None:
    """Decode TP 2 x PP 2 (layers split 0-39, 40-end): the parts are (stage, rank) pools, their cells stage x 2 +
    rank; each pool gets each of its stage's keys once, spread over both prefill ranks, and the report's routes
    name cells."""
    spec = load_spec("glm-5.2")
    src = manifest(KVLayout(spec, draft_layers=1, elide=True), "prefill", 1 << 32)
    half = spec.num_layers // 2
    spans = [(0, half), (half, spec.num_layers)]
    parts = []
    for j, (a, b) in enumerate(spans):
        lay = KVLayout(spec, a, b, draft_layers=1 if j == 1 else 0, elide=True)
        for r in range(2):
            dst = manifest(lay, f"decode/stage{j}.tp{r}", (2 * j + r + 2) << 36)
            pairing = check_pair(src, dst)
            table = PairTable.of(pairing.pairs)
            parts.append(LinkPart(j, dst, pairing, table, None, rank=r, cell=2 * j + r))  # type: ignore[arg-type]
    lk = DecodeLink("127.0.0.1:1", "boot", parts[0].manifest, tuple(parts))
    rid = request_rotation("r7")
    routes = route_pairs(lk, 0, 2, rid)
    assert {c for _, c in routes} == {0, 1, 2, 3} and {s for s, _ in routes} == {0, 1}, routes
    got: dict[int, list] = {c: [] for c in range(4)}
    by: dict[tuple, set] = {}  # (decode stage, key) -> the prefill ranks that send it there
    for t in range(2):
        for p, table in part_routes(lk, 0, t, 2, rotate=rid):
            got[p.cell] += [kp.key for kp in table.pairs]
            assert [t, p.cell] in routes
            for kp in table.pairs:
                by.setdefault((p.stage, kp.key), set()).add(t)
    assert all(v == {0, 1} for v in by.values())  # two receivers per key, two senders: cap 1 each
    for p in parts:  # every pool: each of its keys once
        assert sorted(got[p.cell]) == sorted(kp.key for kp in p.table.pairs), p.cell
