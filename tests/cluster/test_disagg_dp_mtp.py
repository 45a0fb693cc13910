"""A DP-attention decode with MTP (`dsakv serve --role decode --tp-size 2 --dp-size 2 --enable-dp-attention
--ep-size 2 --speculative-num-steps 2`) fed by a TP-1 prefill with MTP (which sends the draft layer's keys and the
draft's last hidden state): each DP rank drafts and verifies its own requests on its own pool (the draft's KV /
index-K received from the prefill with the other keys, like a single-rank MTP decode), with the whole draft layer
(its MoE not expert-parallel: no collective in a draft); the target's MoE runs expert-parallel in lockstep (a rank
that drafts and verifies, or waits for KV, or is idle calls each EPMoE once per round: engine/dp.LockstepEngine).

Checked over a real transfer backend through the router (rank 1 found from rank 0's health): greedy and seeded
tokens == the colocated single-rank engine with MTP (greedy also == MTP off); the accept counts of each DP rank ==
the single-rank engine running that rank's requests alone; requests land on both DP ranks (a long one holds rank
a, the next is placed on the other rank; asserted by rank); each rank receives its own requests' keys, the draft's
included (bytes == pages x the layout figure); 0 pages used on both ranks and on the prefill after. kill -9 of DP
rank 1 while both ranks speculate: only its request fails, rank 0's == the single-rank MTP engine (tokens and
accept counts), 0 pages on rank 0 and the prefill.
"""

from __future__ import annotations

import os
import signal
from dataclasses import replace

import pytest

from dsakv.disagg.protocol.messages import fetch_health
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.model.loader import load_model
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import (
    DP_ARGS,
    NUM_PAGES,
    PAGE_SIZE,
    Cluster,
    assert_clean,
    free_ports,
    wait_for,
)
from dsakv.testing.config import engine_config
from dsakv.testing.engines import fitted_mtp_tiny, mtp_prompts
from dsakv.testing.listen import child_pids
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(400)]

SPEC = ["--speculative-num-steps", "2"]
NEW = 10
KILL_LONG = 600  # tokens of each request decoding when DP rank 1 is killed (the kill lands mid-decode)
LONG_A = 200  # tokens of the request that must still decode on its rank while the next one is placed
GREEDY = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=NEW, ignore_eos=True, temperature=0.9, seed=23)
KEYS = ("spec_verify_steps", "spec_draft_tokens", "spec_accepted_tokens")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The 12-layer tiny model with one MTP layer fitted on fit_prompts (drafts accepted there, rarely elsewhere)."""
    return fitted_mtp_tiny(tmp_path_factory.mktemp("dp-mtp-pd"))


def _prompts() -> list[list[int]]:
    return mtp_prompts(2, (9, 37), seed=3)


PROMPTS = _prompts()


def _engine(ckpt, k: int) -> Engine:
    cfg = engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    return Engine(load_model(ckpt), cfg, speculative_num_steps=k, model_dir=ckpt)


_ALONE: dict[str, tuple[list[int], dict[str, float]]] = {}


def _alone(ckpt, prompt: list[int], params: SamplingParams) -> tuple[list[int], dict[str, float]]:
    """(tokens, spec counters) of the single-rank engine with MTP running `prompt` alone (computed once per module,
    shared by both backends' runs)."""
    key = repr((str(ckpt), prompt, params))
    if key not in _ALONE:
        eng = _engine(ckpt, 2)
        out = eng.generate([prompt], params)
        assert eng.stats().pages_used == 0
        s = eng.spec_stats() or {}
        _ALONE[key] = (out[0], {k: s[k] for k in KEYS})
    return _ALONE[key]


@pytest.fixture(scope="module", params=("mooncake", "nixl"))
def world(request, ckpt, tmp_path_factory):
    backend = request.param
    cluster = Cluster(ckpt, tmp_path_factory.mktemp(f"dp-mtp-{backend}"))
    try:
        port = free_ports(2)  # rank r listens on port + r
        decode = cluster.decode("ddp2-mtp", backend, True, port=port, extra=[*DP_ARGS, "--worker-name", "ddp2m", *SPEC])
        prefill = cluster.prefill("p-mtp", backend, True, (12,), extra=SPEC)
        cluster.wait_healthy([*prefill, decode], timeout=240)
        ranks = cluster.dp_ranks(decode, 2)
        router = cluster.router([prefill[0].addr], [decode.addr], rpc_timeout=10.0)
        wait_for(lambda: len(router.peers.usable_pairs()) == 2, 90, "both DP ranks paired", cluster.procs)
        yield backend, cluster, decode, ranks, prefill, router
    finally:
        cluster.close()


def _snap(ranks: list[str]) -> list[dict[str, float]]:
    """Per DP rank: its spec counters."""
    out = []
    for a in ranks:
        h = fetch_health(a, timeout=3.0)
        assert h.spec is not None, h
        out.append({k: h.spec[k] for k in KEYS})
    return out


def _delta(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: a[k] - b[k] for k in KEYS} for b, a in zip(before, after, strict=True)]


def _rank_of(world, rid: str) -> int:
    """The DP rank the router dispatched `rid` to (its record names the rank's address until its events are read)."""
    _, cluster, _, ranks, _, router = world

    def decode() -> str | None:
        rec = router.record(rid)
        assert rec is not None, rid
        return rec.decode

    wait_for(decode, 60, f"{rid} dispatched", cluster.procs)
    return ranks.index(decode())


def _tokens(router, rid: str, want: tuple[str, str | None] = ("length", None)) -> list[int]:
    """The tokens of `rid` once it finished with (reason, error) == want (error "*": any error message)."""
    toks: list[int] = []
    end = None
    for ev in router.events(rid, 180):
        toks += ev.new_token_ids
        if ev.finished:
            end = (ev.finish_reason, ev.error)
    assert end is not None and end[0] == want[0], (rid, end)
    if want[1] == "*":
        assert end[1] and "DP rank 1 of 2" in end[1], (rid, end)
    else:
        assert end[1] == want[1], (rid, end)
    return toks


def _run(world, prompts, params: SamplingParams, tag: str) -> list[tuple[list[int], int]]:
    """Submit all at once; (tokens, DP rank) of each."""
    backend, _, _, _, _, router = world
    rids = [f"{backend}-{tag}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts, strict=True):
        router.submit(rid, list(p), params)
    where = [_rank_of(world, rid) for rid in rids]
    return [(_tokens(router, rid), r) for rid, r in zip(rids, where, strict=True)]


def _pages(p: list[int]) -> int:
    return ceil_div(len(p), PAGE_SIZE)


def test_decode_dp2_mtp_tokens_accept_counts_per_rank_and_clean_pools(world, ckpt):
    backend, cluster, decode, ranks, prefill, router = world
    for r, addr in enumerate(ranks):
        h = fetch_health(addr)
        assert h.ok and h.down is None and (h.dp_rank, h.dp_size, h.name) == (r, 2, f"ddp2m.dp{r}"), h
        assert h.spec is not None and [h.spec[k] for k in KEYS] == [0, 0, 0], h.spec
    pages = [0, 0]  # pages of prompt KV each DP rank received
    zero = dict.fromkeys(KEYS, 0)

    # one at a time: each request's accept counts are the single-rank engine's alone, on the rank that held it
    for i, p in enumerate(PROMPTS):
        before = _snap(ranks)
        ((toks, r),) = _run(world, [p], GREEDY, f"g{i}")
        want, spec = _alone(ckpt, p, GREEDY)
        assert toks == want, i
        d = _delta(before, _snap(ranks))
        assert (d[r], d[1 - r]) == (spec, zero), (i, r, d, spec)
        pages[r] += _pages(p)

    # all at once: tokens == the single-rank engine with MTP == MTP off
    got = _run(world, PROMPTS, GREEDY, "all")
    assert (
        [t for t, _ in got] == _engine(ckpt, 2).generate(PROMPTS, GREEDY) == _engine(ckpt, 0).generate(PROMPTS, GREEDY)
    )
    for (_, r), p in zip(got, PROMPTS, strict=True):
        pages[r] += _pages(p)

    # both ranks at once, greedy then seeded: A (long) holds rank a, B is placed on the other while A decodes;
    # each rank's accept counts == the single-rank engine running its request alone
    accepted = 0
    for tag, params in (("pair-g", GREEDY), ("pair-s", SEEDED)):
        long_a = replace(params, max_new_tokens=LONG_A)
        before = _snap(ranks)
        rid_a, rid_b = f"{backend}-{tag}-a", f"{backend}-{tag}-b"
        router.submit(rid_a, list(PROMPTS[0]), long_a)
        a = _rank_of(world, rid_a)
        wait_for(lambda: fetch_health(ranks[a]).running == 1, 60, "A decoding", cluster.procs)  # noqa: B023
        router.submit(rid_b, list(PROMPTS[1]), params)
        b = _rank_of(world, rid_b)
        assert b == 1 - a, f"{tag}: B placed on DP rank {b}, A's rank {a}: A finished before B came (raise LONG_A)"
        toks_b, toks_a = _tokens(router, rid_b), _tokens(router, rid_a)
        want_a, spec_a = _alone(ckpt, PROMPTS[0], long_a)
        want_b, spec_b = _alone(ckpt, PROMPTS[1], params)
        assert (toks_a, toks_b) == (want_a, want_b), tag
        assert_clean(ranks, procs=cluster.procs)
        d = _delta(before, _snap(ranks))
        assert (d[a], d[b]) == (spec_a, spec_b), (tag, a, d, spec_a, spec_b)
        accepted += spec_a["spec_accepted_tokens"] + spec_b["spec_accepted_tokens"]
        pages[a] += _pages(PROMPTS[0])
        pages[b] += _pages(PROMPTS[1])
    assert accepted > 0
    assert _alone(ckpt, PROMPTS[1], SEEDED)[0] != _alone(ckpt, PROMPTS[1], GREEDY)[0]  # seeded draws differ

    # each rank received its own requests' keys only, the draft layer's included: pages x the layout's figure
    assert_clean([*ranks, prefill[0].addr], procs=cluster.procs)
    spec = ModelSpec.from_path(ckpt)
    lay = KVLayout(spec, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE, draft_layers=1)
    assert lay.bytes_per_page == PAGE_SIZE * 4928
    assert min(pages) > 0, pages  # requests landed on both DP ranks
    for r, a in enumerate(ranks):
        h = fetch_health(a)
        assert h.ok and (h.pages_used, h.running, h.waiting) == (0, 0, 0), h
        assert h.kv_bytes_pairs == {f"p-mtp:0->dp{r}": pages[r] * lay.bytes_per_page}, (r, pages, h.kv_bytes_pairs)


def test_dp_rank_killed_while_both_speculate_only_its_request_fails(world, ckpt):
    """kill -9 of DP rank 1 while each rank drafts and verifies one long seeded request: rank 1's fails naming its DP
    rank; the group re-forms over rank 0, whose request goes on to the single-rank MTP engine's tokens and accept
    counts exactly, whichever collective the kill broke (a round's all_gather: the round runs again; a verify's
    all-to-all: the step is held, drafted and verified again, seen in runs here and forced in
    tests/inproc/test_step_retry.py); 0 pages on rank 0 and the prefill after."""
    backend, cluster, decode, ranks, prefill, router = world
    params = replace(SEEDED, max_new_tokens=KILL_LONG)
    before = _snap(ranks)
    rids = [f"{backend}-kill-{i}" for i in range(2)]
    router.submit(rids[0], list(PROMPTS[0]), params)
    first = _rank_of(world, rids[0])
    wait_for(lambda: fetch_health(ranks[first]).running == 1, 60, "the first request decoding", cluster.procs)
    router.submit(rids[1], list(PROMPTS[1]), params)
    where = [first, _rank_of(world, rids[1])]
    assert sorted(where) == [0, 1], where
    wait_for(lambda: [fetch_health(a).running for a in ranks] == [1, 1], 60, "one on each rank", cluster.procs)
    (rank1,) = child_pids(decode.pid)
    os.kill(rank1, signal.SIGKILL)
    kept, lost = where.index(0), where.index(1)
    toks = _tokens(router, rids[kept], ("length", None))
    err = _tokens(router, rids[lost], ("error", "*"))
    assert len(err) < KILL_LONG
    want, spec = _alone(ckpt, PROMPTS[kept], params)
    assert toks == want
    assert_clean([ranks[0], prefill[0].addr], procs=[decode, *prefill])
    h0 = fetch_health(ranks[0])
    assert h0.spec is not None and {k: h0.spec[k] - before[0][k] for k in KEYS} == spec, (h0.spec, before[0], spec)
    rows = [(x.rank, x.up) for x in h0.dp_ranks or []]
    assert rows[0] == (0, True) and h0.ok and h0.down is None, (rows, h0)
