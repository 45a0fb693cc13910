"""HiSparse swap-in for many requests per step (one vectorised pass per producer group, cache/hisparse.py):
exact rows, slots and bytes against an independent LRU recount, with hot rows that overlap the last step's
(hits), disjoint ones (misses that evict), requests at different newest pages and requests left out of a call.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dsakv.cache.hisparse import HiSparsePool, HiSparseStep
from dsakv.spec import KVLayout, load_spec
from dsakv.testing.engines import INDEX_TOPK, drive, engine, greedy_params, prompts_for

P = 4  # page size
S = 6  # device_buffer_size
KV_BYTES = (64 + 16) * 4  # tiny, fp32
GROUPS = {0: (0,), 1: (1,), 2: (2, 3, 4, 5), 6: (6, 7, 8, 9), 10: (10, 11)}


class RefLRU:
    """The swap-in rule, row by row in Python: per (request, producer) `size` slots; a top-k's positions in the
    newest page are hits, the others hit a slot holding them or take, in ascending position order, the slot with
    the lowest (last used, slot) among those this top-k does not hit (empty slots: last used -1)."""

    def __init__(self, size: int, page: int) -> None:
        self.size, self.page = size, page
        self.slots: dict[tuple[object, int], list[int]] = {}
        self.used: dict[tuple[object, int], list[int]] = {}
        self.clock = 0

    def reset(self, rid: object) -> None:
        for key in [k for k in self.slots if k[0] == rid]:
            del self.slots[key], self.used[key]

    def swap(self, producer: int, wanted: dict[object, tuple[set[int], int]]) -> tuple[int, int, int]:
        """wanted: rid -> (positions, length). Returns (lookups, hits, misses) of the call."""
        self.clock += 1
        lookups = hits = misses = 0
        for rid, (pos, length) in wanted.items():
            slots = self.slots.setdefault((rid, producer), [-1] * self.size)
            used = self.used.setdefault((rid, producer), [-1] * self.size)
            newest = (length - 1) // self.page * self.page
            old = sorted(p for p in pos if p < newest)
            hit = {slots.index(p) for p in old if p in slots}
            miss = [p for p in old if p not in slots]
            free = sorted((s for s in range(self.size) if s not in hit), key=lambda s: (used[s], s))
            for s in hit:
                used[s] = self.clock
            for p, s in zip(miss, free, strict=False):
                slots[s], used[s] = p, self.clock
            lookups += len(pos)
            hits += len(pos) - len(miss)
            misses += len(miss)
        return lookups, hits, misses

    def resident(self, rid: object, producer: int) -> dict[int, int]:
        return {p: s for s, p in enumerate(self.slots.get((rid, producer), [])) if p >= 0}


@pytest.mark.parametrize("lookup", ["broadcast", "searchsorted"])
def test_many_requests_per_step_exact_rows_slots_bytes(monkeypatch: pytest.MonkeyPatch, lookup: str) -> None:
    if lookup == "searchsorted":  # the hit lookup large batches take (sorted slots), forced at this size
        monkeypatch.setattr(HiSparsePool, "BROADCAST_ELEMS", 0)
    layout = KVLayout(load_spec("tiny"), elide=True, kv_format="fp32", index_format="fp32", page_size=P)
    lengths = {"a": 23, "b": 30, "c": 17, "d": 41, "e": 26, "f": 35}  # newest pages at 20, 28, 16, 40, 24, 32
    pages, first = {}, 0
    for rid, n in lengths.items():
        pages[rid] = list(range(first, first + n // P + 2))  # one spare page each, to grow into
        first += len(pages[rid])
    pool = HiSparsePool(layout, first, S, len(lengths))
    g = torch.Generator().manual_seed(11)
    vals = {}
    for rid, n in lengths.items():
        pool.admit(rid, pages[rid], length=n)
        for layer in layout.layers:
            vals[rid, layer] = torch.randn(n + 8, 80, generator=g)
            pool.store_kv(layer, rid, torch.arange(n), vals[rid, layer][:n])
    copies: list[tuple[int, int]] = []
    real_copy = HiSparsePool._copy_in

    def copy_in(self: HiSparsePool, layer: int, dst: torch.Tensor, src: torch.Tensor) -> None:
        copies.append((layer, dst.numel()))
        real_copy(self, layer, dst, src)

    monkeypatch.setattr(HiSparsePool, "_copy_in", copy_in)
    ref = RefLRU(S, P)
    rng = np.random.default_rng(5)
    last: dict[tuple[str, int], list[int]] = {}
    total_rows = 0
    for step in range(8):
        pool.begin_step()
        if step == 4:  # two requests decode a token each: "c" opens a new page (16..19 leave the newest page)
            for rid in ("c", "e"):
                n = lengths[rid]
                for layer in layout.layers:
                    pool.grow(rid, n + 1)
                    pool.store_kv(layer, rid, torch.tensor([n]), vals[rid, layer][n : n + 1])
                lengths[rid] = n + 1
        want_rows = {}
        for producer in GROUPS:
            # rows: all but one request (a different one each step); per request up to S old positions, half of
            # them the last step's (overlapping hot rows, hits), the rest fresh (disjoint: misses that evict),
            # plus some of the newest page
            rids = [r for i, r in enumerate(lengths) if i != step % len(lengths)]
            topk, wanted = {}, {}
            for rid in rids:
                n = lengths[rid]
                newest = (n - 1) // P * P
                keep = [p for p in last.get((rid, producer), []) if rng.random() < 0.5]
                fresh = [int(p) for p in rng.permutation(newest) if p not in keep][: S - len(keep)]
                old = (keep + fresh)[: int(rng.integers(1, S + 1))]
                cur = old + [int(p) for p in range(newest, n) if rng.random() < 0.6]
                last[rid, producer] = old
                padded = cur + [-1] * (S + P - len(cur))
                topk[rid] = torch.tensor(rng.permutation(padded).tolist())  # any order, -1 padding anywhere
                wanted[rid] = (set(cur), n)
            before = len(copies)
            got = pool.swap_in(producer, topk)
            lookups, hits, misses = ref.swap(producer, wanted)
            assert got == {layer: misses for layer in GROUPS[producer]}
            # one copy per layer of the group, all requests together (none when nothing missed)
            assert copies[before:] == ([(layer, misses) for layer in GROUPS[producer]] if misses else [])
            for layer in GROUPS[producer]:
                assert pool.stats.step[layer].lookups == lookups and pool.stats.step[layer].hits == hits
                want_rows[layer] = misses
                for rid in lengths:
                    assert pool.resident(layer, rid) == ref.resident(rid, producer)
                for rid in rids:
                    sel = sorted(wanted[rid][0])
                    assert pool.positions(layer, rid).tolist() == sel
                    assert torch.equal(pool.read_kv(layer, rid), vals[rid, layer][sel])
                    rows = pool.rows_for(layer, rid, torch.tensor(sel))
                    assert torch.equal(pool.kv_codec.read(pool.hot_tensor(layer), rows, 1), vals[rid, layer][sel])
            total_rows += misses * len(GROUPS[producer])
        assert pool.stats.step_rows() == dict(sorted(want_rows.items()))
        assert pool.stats.step_bytes() == {layer: r * KV_BYTES for layer, r in sorted(want_rows.items())}
    assert sum(s.rows_in for s in pool.stats.total.values()) == total_rows
    assert sum(s.bytes_in for s in pool.stats.total.values()) == total_rows * KV_BYTES
    assert 0 < pool.stats.hit_rate < 1
    # a released request's block starts empty for the next one
    pool.release("d")
    pool.admit("g", [pages["d"][0]], length=3)
    assert all(pool.resident(layer, "g") == {} for layer in layout.layers)


def test_engine_batch_stats_equal_an_lru_recount(monkeypatch: pytest.MonkeyPatch) -> None:
    """4 requests decoding together, buffer = top-k (nearly every step evicts): per step and layer the rows and
    bytes swapped in equal the LRU recount from the producers' top-k; the tokens equal a plain engine's."""
    steps: list[tuple[np.ndarray, list[tuple[int, list[str], np.ndarray, torch.Tensor]]]] = []
    stats: list[dict[int, int]] = []
    orig_topk, orig_access, orig_prepare = HiSparseStep.on_topk, HiSparsePool.step_access, HiSparsePool.prepare

    def prepare(self: HiSparsePool, entries, running):  # type: ignore[no-untyped-def]
        if steps:
            stats.append(self.stats.step_rows())  # the step before this one
        return orig_prepare(self, entries, running)

    def access(self: HiSparsePool, extend_lens, positions, device=None):  # type: ignore[no-untyped-def]
        steps.append((positions.numpy().copy(), []))
        return orig_access(self, extend_lens, positions, device)

    def record(self: HiSparseStep, producer: int, topk: torch.Tensor, mla_path: str) -> None:
        if self.hot_rows_of.size and mla_path == "absorbed":
            toks = np.flatnonzero(self.tok_hot)  # one token per decode row, in row order
            steps[-1][1].append((producer, [self.rids[b] for b in self.hot_rows_of], toks, topk[toks].clone()))
        orig_topk(self, producer, topk, mla_path)

    monkeypatch.setattr(HiSparsePool, "prepare", prepare)
    monkeypatch.setattr(HiSparsePool, "step_access", access)
    monkeypatch.setattr(HiSparseStep, "on_topk", record)
    prompts = prompts_for([40, 75, 100, 130], seed=21)
    new = (14, 10, 16, 12)
    kw = dict(page_size=P, max_tokens=1024, max_batch_tokens=512)
    out = {}
    for name, extra in (("plain", {}), ("hs", dict(hisparse=True, hisparse_device_buffer_size=INDEX_TOPK))):
        eng = engine("glm_moe_dsa", **kw, **extra)
        ids = [eng.add_request(p, greedy_params(n)) for p, n in zip(prompts, new, strict=True)]
        final = drive(eng)
        out[name] = [list(final[r].output_ids) for r in ids]
    assert out["hs"] == out["plain"]
    pool = eng.hisparse
    assert pool is not None
    stats.append(pool.stats.step_rows())
    assert len(stats) == len(steps)
    ref = RefLRU(INDEX_TOPK, P)
    rows_in = decode_steps = batched = 0
    for (positions, calls), got in zip(steps, stats, strict=True):
        want: dict[int, int] = {}
        for producer, rids, toks, topk in calls:
            wanted = {
                rid: ({int(p) for p in row if p >= 0}, int(positions[t]) + 1)
                for rid, t, row in zip(rids, toks, topk, strict=True)
            }
            _, _, misses = ref.swap(producer, wanted)
            want.update({layer: misses for layer in GROUPS[producer]})
        assert got == dict(sorted(want.items()))
        decode_steps += bool(calls)
        batched += bool(calls) and len(calls[0][1]) == 4
        rows_in += sum(want.values())
    assert decode_steps >= max(new) - 1 and batched >= min(new) - 1  # 4 requests in one swap-in per group
    assert sum(s.rows_in for s in pool.stats.total.values()) == rows_in > 0
    assert sum(s.bytes_in for s in pool.stats.total.values()) == rows_in * pool.kv_row_bytes


def test_clock_rebase_keeps_the_lru_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past CLOCK_LIMIT swap-ins a group's int32 clocks shift down; the order of the last CLOCK_WINDOW swap-ins'
    rows is kept, so the slots equal a pool that never rebased."""
    layout = KVLayout(load_spec("tiny"), elide=True, kv_format="fp32", index_format="fp32", page_size=P)
    pools = [HiSparsePool(layout, 16, 4, 1) for _ in range(2)]
    monkeypatch.setattr(pools[1], "CLOCK_LIMIT", 5)
    monkeypatch.setattr(pools[1], "CLOCK_WINDOW", 3)
    rng = np.random.default_rng(3)
    keep: list[int] = []
    prev: list[int] = []
    for call in range(30):  # 2 positions kept (hits), 2 fresh (misses): every slot touched each call
        fresh = [int(p) for p in rng.permutation(40) if p not in prev][: 4 - len(keep)]
        topk = torch.tensor(keep + fresh)
        for pool in pools:
            if call == 0:
                pool.admit("a", range(12), length=44)
            assert pool.swap_in(2, {"a": topk}) == {layer: len(fresh) for layer in GROUPS[2]}
        assert pools[1].resident(3, "a") == pools[0].resident(3, "a")
        assert pools[1].positions(3, "a").tolist() == sorted(keep + fresh)
        prev = keep + fresh
        keep = [int(p) for p in rng.permutation(prev)[:2]]
    assert pools[0]._clocks[2] == 30 and pools[1]._clocks[2] <= 5  # noqa: SLF001
    # the shift itself: -1 (never) stays, rows older than the window tie at 0, the rest keep their order
    used = pools[1]._state[2, 0, 1]  # noqa: SLF001
    used[:6] = torch.tensor([-1, 0, 1, 3, 4, 5], dtype=torch.int32)
    pools[1]._clocks[2] = 5  # noqa: SLF001
    pools[1]._rebase_clock(2)  # noqa: SLF001
    assert used[:6].tolist() == [-1, 0, 0, 1, 2, 3] and pools[1]._clocks[2] == 3  # noqa: SLF001
