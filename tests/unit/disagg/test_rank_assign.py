"""The sender-assignment rule between any prefill grid (TP a x PP b [x DP]) and any decode grid (TP c, or DP d
with DP attention, x PP e), and the handshake-side grid check. Pure functions, exact figures."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from dsakv.disagg.transfer.rank_assign import (
    MissingSender,
    RankId,
    RoleGrid,
    assign,
    assign_rank0,
    check_announced,
    check_grids,
    elided_index_k,
    grid_keys,
)
from dsakv.errors import ConfigError
from dsakv.spec import KVLayout, load_spec
from dsakv.spec.layout import BufferKey, Kind
from dsakv.util import ceil_div

SPEC = load_spec("tiny")  # 12 layers, producers 0, 1, 2, 6, 10
PAGES = 5  # pages of the request


def stage_keys(grid: RoleGrid, elide: bool = True):
    def keys(stage: int) -> tuple[BufferKey, ...]:
        s, e = grid.stages[stage]
        draft = grid.draft_layers if stage == len(grid.stages) - 1 else 0
        return KVLayout(SPEC, s, e, draft_layers=draft, elide=elide, page_size=4).keys

    return keys


def key_bytes() -> dict[BufferKey, int]:
    lay = KVLayout(SPEC, draft_layers=1, elide=False, page_size=4)
    return {b.key: b.page_bytes * PAGES for b in lay.buffers}


PARTS = {1: (12,), 2: (7, 5), 3: (4, 4, 4), 4: (3, 3, 3, 3)}
PREFILLS = [(a, b, dp) for a in (1, 2, 3, 4, 8) for b in (1, 2, 4) for dp in (1, 2)]
DECODES = [("tp", c, 1, e) for c in (1, 2, 4, 8) for e in (1, 2, 3)] + [
    ("dp", tp, d, e) for d in (2, 4, 8) for tp in (d, 2 * d) for e in (1, 2)
]


@pytest.mark.parametrize(("a", "b", "pdp"), PREFILLS)
def test_every_receiver_gets_each_key_once_spread_over_holders(a, b, pdp) -> None:
    kb = key_bytes()
    biggest = max(kb.values())
    for kind, tp, d, e in DECODES:
        pre = RoleGrid.from_partition("prefill", PARTS[b], dp=pdp, attention_tp=a, draft_layers=1)
        dec = RoleGrid.from_partition("decode", PARTS[e], dp=d, attention_tp=tp // d, draft_layers=1)
        check_announced(pre, pre.ranks, 12)
        check_announced(dec, dec.ranks, 12)
        pdp_r, ddp_r = pdp - 1, d - 1  # the request's DP groups: the last of each side
        senders = grid_keys(pre, stage_keys(pre), pdp_r)
        receivers = grid_keys(dec, stage_keys(dec), ddp_r)
        asg = check_grids(
            pre,
            dec,
            prefill_dp=pdp_r,
            decode_dp=ddp_r,
            prefill_keys=stage_keys(pre),
            decode_keys=stage_keys(dec),
            key_bytes=kb,
        )
        shape = f"prefill tp{a} pp{b} dp{pdp} -> decode {kind}{tp}/{d} pp{e}"
        got = Counter((r, k) for (_, r), keys in asg.routes.items() for k in keys)
        want = Counter((r, k) for r, keys in receivers.items() for k in keys)
        assert got == want, shape  # each (receiver, key) exactly once, nothing extra
        assert all(s.dp == pdp_r and r.dp == ddp_r for s, r in asg.routes), shape
        per_key: dict[BufferKey, Counter[RankId]] = {}
        for (s, _r), keys in asg.routes.items():
            for k in keys:
                assert k in senders[s], (shape, s, k)  # the sender holds the key
                per_key.setdefault(k, Counter())[s] += 1
        for k, c in per_key.items():
            holders = [s for s in senders if k in senders[s]]
            needers = [r for r in receivers if k in receivers[r]]
            assert max(c.values()) <= ceil_div(len(needers), len(holders)), (shape, k)
        # every prefill rank of the request's group sends (no rank-0 hotspot) when its stage has >= a transfers,
        # and the bytes of a stage's ranks differ by at most one key's bytes
        sb = asg.sender_bytes(kb)
        for st in range(b):
            ranks = [RankId(st, pdp_r, t) for t in range(a)]
            n = sum(sum(1 for k in keys if k.layer in pre.stage_layers(st)) for keys in receivers.values())
            if n >= a:
                assert all(sb.get(rk, 0) > 0 for rk in ranks), (shape, st)
                loads = [sb[rk] for rk in ranks]
                assert max(loads) - min(loads) <= biggest, (shape, st, loads)
        # bytes per (sender, receiver) pair sum to each receiver's layout figure
        per_recv: Counter[RankId] = Counter()
        for (_, r), nbytes in asg.pair_bytes(kb).items():
            per_recv[r] += nbytes
        for r, keys in receivers.items():
            assert per_recv[r] == sum(kb[k] for k in keys), (shape, r)


def test_exact_routes_tp2_to_tp4() -> None:
    """One key, prefill TP 2 -> decode TP 4: cap ceil(4/2) = 2 each, alternating."""
    k = BufferKey(0, Kind.KV)
    s = {RankId(0, 0, t): {k} for t in range(2)}
    r = {RankId(0, 0, t): {k} for t in range(4)}
    asg = assign(s, r)
    assert asg.routes == {
        (RankId(0, 0, 0), RankId(0, 0, 0)): (k,),
        (RankId(0, 0, 0), RankId(0, 0, 2)): (k,),
        (RankId(0, 0, 1), RankId(0, 0, 1)): (k,),
        (RankId(0, 0, 1), RankId(0, 0, 3)): (k,),
    }


def test_exact_routes_tp2_to_tp1_by_bytes() -> None:
    """Keys A(10 B), B(1), C(10), D(1) from 2 holders to 1 receiver, least bytes first:
    A -> s0 (tie, lowest rank); B -> s1 (0 < 10); C -> s1 (1 < 10); D -> s0 (10 < 11)."""
    a, b, c, d = (BufferKey(i, Kind.KV) for i in range(4))
    s0, s1, r0 = RankId(0, 0, 0), RankId(0, 0, 1), RankId(0, 0, 0)
    asg = assign({s0: {a, b, c, d}, s1: {a, b, c, d}}, {r0: {a, b, c, d}}, {a: 10, b: 1, c: 10, d: 1})
    assert asg.routes == {(s0, r0): (a, d), (s1, r0): (b, c)}
    assert asg.sender_bytes({a: 10, b: 1, c: 10, d: 1}) == {s0: 11, s1: 11}
    assert asg.keys_from(s1) == {r0: (b, c)}


def test_prefill_tp8_to_decode_dp8_spreads_where_rank0_sends_all() -> None:
    """GLM-5.2 (78 layers, 1 draft layer), prefill TP 8 -> decode DP 8 (DP attention, attention TP 1): each
    request's 101 keys go to one decode rank; the rule spreads them over the 8 prefill ranks, SGLang's rule has
    prefill rank 0 send all of them."""
    glm = load_spec("glm-5.2")
    lay = KVLayout(glm, draft_layers=1, elide=True)
    kb = {b.key: b.page_bytes * 100 for b in lay.buffers}
    pre = RoleGrid("prefill", ((0, 78),), attention_tp=8, draft_layers=1)
    dec = RoleGrid("decode", ((0, 78),), dp=8, attention_tp=1, draft_layers=1)
    keys = lambda _s: lay.keys  # noqa: E731
    totals: Counter[RankId] = Counter()
    zero: Counter[RankId] = Counter()
    for ddp in range(8):
        asg = check_grids(
            pre, dec, prefill_dp=0, decode_dp=ddp, prefill_keys=keys, decode_keys=keys, key_bytes=kb, rotate=ddp
        )
        one = asg.sender_bytes(kb)
        assert max(one.values()) - min(one.values()) <= max(kb.values())
        assert {r for _, r in asg.routes} == {RankId(0, ddp, 0)}
        assert len(asg.senders) == 8
        totals.update(asg.sender_bytes(kb))
        base = assign_rank0(grid_keys(pre, keys, 0), grid_keys(dec, keys, ddp))
        assert base.senders == (RankId(0, 0, 0),)
        zero.update(base.sender_bytes(kb))
    assert len(lay.keys) == 79 + 21 + 1 == 101
    assert zero == {RankId(0, 0, 0): 8 * lay.bytes_per_page * 100}
    assert sum(totals.values()) == 8 * lay.bytes_per_page * 100
    assert set(totals.values()) == {8 * lay.bytes_per_page * 100 // 8}  # rotated per request: exactly even


def test_one_sided_elision_is_skipped_only_when_allowed() -> None:
    """A dense decode (index-K on every layer) fed by an eliding prefill: shared layers' index-K is skipped."""
    pre = RoleGrid("prefill", ((0, 12),), attention_tp=2)
    dec = RoleGrid("decode", ((0, 12),), attention_tp=1)
    kw = dict(prefill_dp=0, decode_dp=0, prefill_keys=stage_keys(pre, True), decode_keys=stage_keys(dec, False))
    asg = check_grids(pre, dec, **kw, optional=elided_index_k(SPEC))
    assert sorted(k.layer for _, k in asg.skipped) == [3, 4, 5, 7, 8, 9, 11]
    with pytest.raises(MissingSender, match=r"no sending rank holds L3/index_k \(layer 3, kind index_k\)"):
        check_grids(pre, dec, **kw)


def test_grid_check_names_the_mismatch() -> None:
    dec = RoleGrid.from_partition("decode", (7, 5), dp=2, attention_tp=2)
    ranks = list(dec.ranks)
    with pytest.raises(ConfigError, match=r"has 8 ranks; missing: stage 1 dp 1 tp 1"):
        check_announced(dec, ranks[:-1], 12)
    with pytest.raises(ConfigError, match=r"announced twice: stage 0 dp 0 tp 0; outside the grid: stage 0 dp 2 tp 0"):
        check_announced(dec, [*ranks, ranks[0], RankId(0, 2, 0)], 12)
    with pytest.raises(ConfigError, match=r"cover layers 0..11, the model has layers 0..77"):
        check_announced(dec, ranks, 78)
    pre = RoleGrid("prefill", ((0, 12),), attention_tp=2)
    keys = stage_keys(pre)
    with pytest.raises(ConfigError, match=r"DP rank 2 does not exist on the decode: it has 2 DP group\(s\)"):
        check_grids(pre, dec, prefill_dp=0, decode_dp=2, prefill_keys=keys, decode_keys=stage_keys(dec))
    with pytest.raises(ConfigError, match=r"decode holds 1 draft layer\(s\), the prefill 0"):
        check_grids(
            pre,
            RoleGrid("decode", ((0, 12),), draft_layers=1),
            prefill_dp=0,
            decode_dp=0,
            prefill_keys=keys,
            decode_keys=keys,
        )


def test_shapes_count() -> None:
    """The sweep above covers 30 prefill x 24 decode shapes."""
    assert (len(PREFILLS), len(DECODES)) == (30, 24)
    assert len(list(itertools.product(PREFILLS, DECODES))) == 720
