"""A TP prefill's report and handshake, without processes: the decode accepts a STAGE_DONE of several sending
ranks only when every (prefill rank, decode rank) route landed and every decode rank received, recording the
bytes per pair; the handshake's rank-grid check names the mismatch (a missing decode rank, other layers)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from dsakv.disagg.decode.ranks import DecodeTP, check_cells
from dsakv.disagg.protocol.errors import IncompatiblePeer
from dsakv.disagg.protocol.messages import StageDone
from dsakv.disagg.transfer.bootstrap import grid_check
from dsakv.disagg.transfer.rank_assign import RoleGrid
from dsakv.spec.layout import BufferKey, Kind

KEYS = tuple(BufferKey(layer, kind) for layer in range(4) for kind in (Kind.KV, Kind.INDEX_K))


def done(sender_parts, routes, ok=True) -> StageDone:
    ranks: dict[int, int] = {}
    for per in sender_parts.values():
        for r, n in per.items():
            ranks[r] = ranks.get(r, 0) + n
    return StageDone(
        "r#1", "p", 0, ok, None, senders=2, sender_parts=sender_parts, routes=routes, rank_parts=ranks, bytes=1
    )


def test_decode_tp1_accepts_two_senders_when_every_route_landed_and_records_pairs():
    tp = DecodeTP()
    assert tp.check_parts(None, done({0: {0: 96}, 1: {0: 64}}, [[0, 0], [1, 0]])) is None
    assert tp.check_parts(None, done({0: {0: 64}, 1: {0: 96}}, [[0, 0], [1, 0]])) is None
    assert tp.health_fields() == {"kv_bytes_pairs": {"p:0.tp0->tp0": 160, "p:0.tp1->tp0": 160}}


def test_decode_refuses_a_report_missing_a_route_naming_it():
    tp = DecodeTP()
    why = tp.check_parts(None, done({0: {0: 160}}, [[0, 0], [1, 0]]))
    assert why is not None and "(1, 0)" in why and "2 TP ranks" in why, why
    why = tp.check_parts(None, done({0: {0: 160}, 1: {0: 10}}, []))  # no routes named: nothing to check against
    assert why is not None and "did not land" in why, why
    assert tp.check_parts(None, done({0: {0: 160}}, [[0, 0], [1, 0]], ok=False)) is None  # failed already


def test_decode_tp2_needs_every_rank():
    tp = DecodeTP(SimpleNamespace(size=2, down=None))
    routes = [[0, 0], [0, 1], [1, 0], [1, 1]]
    ok = done({0: {0: 80, 1: 80}, 1: {0: 80, 1: 80}}, routes)
    assert tp.check_parts(None, ok) is None
    why = tp.check_parts(None, done({0: {0: 80}, 1: {0: 80}}, [[0, 0], [1, 0]]))
    assert why is not None and "decode rank(s) ['tp0']" in why, why


def _m(start: int, end: int, total: int = 4):
    keys = tuple(k for k in KEYS if start <= k.layer < end)
    return SimpleNamespace(layer_start=start, layer_end=end, num_main_layers=total, draft_layers=(), keys=keys)


def test_grid_check_names_a_missing_decode_rank_and_other_layers():
    prefill = RoleGrid.from_partition("prefill", [4], attention_tp=2)
    check = grid_check(prefill, lambda s: KEYS)
    check("d:1", [(0, _m(0, 4))], [(0, 1)])  # decode TP 2: fine
    with pytest.raises(IncompatiblePeer, match=r"missing: stage 0 dp 0 tp 1") as e:
        check("d:1", [(0, _m(0, 4))], [(0, 2)])
    assert "prefill: pp 1 (4) x dp 1 x attention tp 2" in str(e.value)
    with pytest.raises(IncompatiblePeer, match=r"covers 4 layers, decode: pp 1 \(6\)"):
        check("d:1", [(0, _m(0, 6, 6))], [])


def test_tp_x_pp_decode_cells_need_every_stage_rank_and_route():
    """A decode TP 2 x PP 2 (cells stage x 2 + rank): a TP-2 prefill stage sharing layers with both decode stages
    must land every cell and every route; the pairs are recorded per '<prefill>:<stage>.tp<s>-><j>.tp<r>'."""
    pairs: dict[str, int] = {}
    lock = threading.Lock()
    name = lambda c: f"{c // 2}.tp{c % 2}"  # noqa: E731
    what = "it shares layers with decode stage(s) [0, 1], each of 2 TP ranks with its own pool"
    routes = [[0, 0], [1, 1], [0, 2], [1, 3]]
    ok = done({0: {0: 10, 2: 7}, 1: {1: 10, 3: 7}}, routes)
    assert check_cells(ok, pairs, lock, range(4), name, what) is None
    assert pairs == {"p:0.tp0->0.tp0": 10, "p:0.tp0->1.tp0": 7, "p:0.tp1->0.tp1": 10, "p:0.tp1->1.tp1": 7}
    why = check_cells(done({0: {0: 10, 2: 7}, 1: {1: 10}}, routes), pairs, lock, range(4), name, what)
    assert why is not None and "['0.tp0', '0.tp1', '1.tp0']" in why and what in why, why
    bad = done({0: {0: 10, 2: 7}, 1: {1: 10, 3: 7}}, [[0, 0], [1, 1], [0, 2], [1, 5]])
    why = check_cells(bad, pairs, lock, range(4), name, what)
    assert why is not None and "(1, 5)" in why, why


def test_grid_check_takes_every_stage_rank_of_a_tp_x_pp_decode():
    prefill = RoleGrid.from_partition("prefill", [4], attention_tp=2)
    check = grid_check(prefill, lambda s: KEYS)
    stages = [(0, _m(0, 2)), (1, _m(2, 4))]
    check("d:1", stages, [(0, 1), (1, 1)])  # decode TP 2 x PP 2: fine
    with pytest.raises(IncompatiblePeer, match=r"missing: stage 1 dp 0 tp 1"):
        check("d:1", stages, [(0, 1)])
