"""MTP speculative decoding in disaggregated serving: the prefill's last stage computes the draft layer's KV /
INDEX_K for the prompt (engine.speculative.draft_prefill) and sends it with its other keys plus the draft's last
hidden state; the decode speculates on the received KV from its first step (Speculator.seed).

One cluster per transfer backend (mooncake, nixl): a decode with --speculative-num-steps 2 and prefills with PP 1,
2 and 4 stages (9 processes; mooncake also starts one prefill without MTP, refused at its handshake). Greedy
tokens must equal a colocated engine with MTP off, token for token (6 prompts x 3 topologies x 2 backends = 36
prompts, one a two-chunk prefill), and the decode's received bytes must include the draft keys exactly.
"""

from __future__ import annotations

import copy

import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.kv_access import PoolAccess
from dsakv.disagg.protocol.errors import IncompatiblePeer
from dsakv.disagg.protocol.messages import Hello, fetch_health
from dsakv.disagg.transfer.bootstrap import StageRegistry
from dsakv.disagg.transfer.manifest import BackendMeta, Manifest, RegionInfo
from dsakv.engine.engine import Engine
from dsakv.engine.model_runner import build_batch
from dsakv.engine.request import SamplingParams
from dsakv.engine.scheduler import ScheduledChunk
from dsakv.engine.speculative import draft_prefill
from dsakv.model.loader import load_draft, load_model
from dsakv.plan.capacity import Deployment, plan
from dsakv.spec.layout import KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import fitted_mtp_tiny, mtp_prompts
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(400)]

K = 2
BACKENDS = ("mooncake", "nixl")
TOPOLOGIES = {"pp1": (12,), "pp2": (7, 5), "pp4": (5, 3, 2, 2)}
GREEDY = SamplingParams(max_new_tokens=10, ignore_eos=True)
FIRST_STEP = SamplingParams(max_new_tokens=3, ignore_eos=True)  # one decode step verifies exactly one draft
SPEC = ["--speculative-num-steps", str(K)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """The 12-layer tiny model with one MTP layer fitted on fit_prompts (high acceptance there, ~0 elsewhere)."""
    return fitted_mtp_tiny(tmp_path_factory.mktemp("mtp-pd"))


def _prompts() -> list[list[int]]:
    return mtp_prompts(3, (7, 41, 290), seed=7)  # 290: two chunks of <= 256


PROMPTS = _prompts()


@pytest.fixture(scope="module")
def reference(ckpt) -> dict[str, list[list[int]]]:
    """Colocated, MTP off."""
    eng = Engine(load_model(ckpt), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256))
    return {"greedy": eng.generate(PROMPTS, GREEDY), "first": eng.generate(PROMPTS, FIRST_STEP)}


def test_draft_prefill_writes_what_the_colocated_extend_writes(ckpt):
    """The prefill's draft_prefill (a target batch shifted by one token) writes the same draft KV / INDEX_K rows and
    returns the same draft hidden state as a colocated MTP engine's prefill step, bit for bit."""
    spec, model = load_model(ckpt)
    draft = load_draft(ckpt)
    eng = Engine((spec, model), engine_config(page_size=4, num_pages=64), speculative_num_steps=1, draft=draft)
    rids = [eng.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True)) for p in PROMPTS[:2] + PROMPTS[3:5]]
    eng.step()  # every prompt's one prefill chunk, its first token and the draft extend
    reqs = [eng.get_request(r) for r in rids]
    assert all(r is not None and r.num_output_tokens == 1 for r in reqs)
    pool = DevicePool(eng.layout, 64)  # the same layout: main layers + L12
    chunks = []
    for r in reqs:
        fresh = copy.copy(r)
        fresh.output_ids = []
        chunks.append(ScheduledChunk(fresh, 0, r.num_prompt_tokens))
    batch = build_batch(chunks, 4)  # the same page ids as the engine's
    carry = model.stage_forward(batch, pool)
    out = draft_prefill(model, draft, pool, batch, carry.hidden, [r.output_ids[0] for r in reqs])
    ours, theirs = PoolAccess(pool), PoolAccess(eng.pool)
    draft_keys = [k for k in eng.layout.keys if k.layer == spec.num_layers]
    assert [str(k) for k in draft_keys] == ["L12/kv", "L12/index_k"]
    for i, r in enumerate(reqs):
        slots = torch.tensor([r.page_ids[t // 4] * 4 + t % 4 for t in range(r.num_prompt_tokens)])
        for key in draft_keys:
            assert torch.equal(ours.read(key, slots), theirs.read(key, slots)), (r.request_id, key)
        assert torch.equal(out[i], eng.speculator.states[r.request_id].hidden)


def _manifest(spec: ModelSpec, worker: str, start: int, end: int, drafts: int) -> Manifest:
    fmt = {"kv_format": "fp32", "index_format": "fp32", "page_size": PAGE_SIZE}
    lay = KVLayout(spec, layer_start=start, layer_end=end, draft_layers=drafts, **fmt)  # type: ignore[arg-type]
    regions, addr = {}, 1 << 20
    for b in lay.buffers:
        regions[b.key] = RegionInfo(addr, b.page_bytes, 8)
        addr += b.page_bytes * 8
    return Manifest.from_layout(lay, regions, BackendMeta("mooncake", b"x"), worker)


def _hello(m: Manifest, stage: int, n: int) -> Hello:
    return Hello("prefill-a", stage, n, f"127.0.0.1:{9000 + stage}", m.to_bytes(), boot=f"boot{stage}")


def test_handshake_refuses_a_draft_mismatch(ckpt):
    spec = ModelSpec.from_path(ckpt)
    spec_decode = StageRegistry(_manifest(spec, "decode-spec", 0, 12, 1))
    plain_decode = StageRegistry(_manifest(spec, "decode-plain", 0, 12, 0))
    plain_last = _manifest(spec, "prefill-a/stage1", 7, 12, 0)
    with pytest.raises(IncompatiblePeer, match=r"speculates .*draft layer\(s\) \[12\].*start the prefill with "):
        spec_decode.accept(_hello(plain_last, 1, 2))
    mtp_last = _manifest(spec, "prefill-a/stage1", 7, 12, 1)
    with pytest.raises(IncompatiblePeer, match=r"does not speculate: start the decode with --speculative-num-steps"):
        plain_decode.accept(_hello(mtp_last, 1, 2))
    with pytest.raises(IncompatiblePeer, match=r"only the last stage runs the MTP layer"):
        spec_decode.accept(_hello(_manifest(spec, "prefill-a/stage0", 0, 7, 1), 0, 2))
    # accepted: stage 0 holds no draft, the last stage the decode's one; the draft keys pair like any other
    spec_decode.accept(_hello(_manifest(spec, "prefill-a/stage0", 0, 7, 0), 0, 2))
    entry, pairing = spec_decode.accept(_hello(mtp_last, 1, 2))
    assert {str(p.key) for p in pairing.pairs} >= {"L12/kv", "L12/index_k"}
    assert [e.stage for e in spec_decode.stages_of("prefill-a", 2)] == [0, 1]
    plain_decode.accept(_hello(plain_last, 1, 2))  # neither speculates: fine


@pytest.fixture(scope="module", params=BACKENDS)
def world(request, ckpt, tmp_path_factory):
    backend = request.param
    cluster = Cluster(ckpt, tmp_path_factory.mktemp(f"mtp-{backend}"))
    try:
        decode = cluster.decode("decode-mtp", backend, True, extra=SPEC)
        prefills = {t: cluster.prefill(f"{t}-mtp", backend, True, part, extra=SPEC) for t, part in TOPOLOGIES.items()}
        cluster.wait_healthy([decode] + [p for ps in prefills.values() for p in ps], timeout=240)
        yield backend, cluster, decode, prefills
    finally:
        cluster.close()


def _decode_figures(addr: str) -> tuple[int, dict[str, float]]:
    h = fetch_health(addr, timeout=3.0)
    assert h.spec is not None, "the decode speculates: its health carries spec_stats()"
    return h.counters["kv_bytes"], h.spec


def _expected_bytes(ckpt, prompts: list[list[int]]) -> int:
    """Pages moved x the planner's bytes per page with one draft layer (fp32, elided) -- the decode's layout."""
    spec = ModelSpec.from_path(ckpt)
    fmt = {"kv_format": "fp32", "index_format": "fp32", "page_size": PAGE_SIZE, "kv_budget": 2**30}
    st = plan(Deployment(spec, draft_layers=1, **fmt)).stages[0]  # type: ignore[arg-type]
    plain = plan(Deployment(spec, **fmt)).stages[0]  # type: ignore[arg-type]
    assert st.bytes_per_token_elided == 4928 == plain.bytes_per_token_elided + 4 * (64 + 16) + 4 * 32
    return sum(ceil_div(len(p), PAGE_SIZE) for p in prompts) * PAGE_SIZE * st.bytes_per_token_elided


@pytest.mark.parametrize("topo", list(TOPOLOGIES))
def test_mtp_pd_tokens_equal_colocated_without_mtp(world, reference, ckpt, topo):
    backend, cluster, decode, prefills = world
    stages = prefills[topo]
    router = cluster.router([stages[0].addr], [decode.addr], rpc_timeout=10.0)  # health waits for a spec step
    try:
        assert router.wait_ready(60), router.health()
        tag = f"{backend}-{topo}"
        bytes0, spec0 = _decode_figures(decode.addr)
        got = run_requests(router, PROMPTS, GREEDY, tag)
        assert [g[1:] for g in got] == [("length", None)] * len(PROMPTS), got
        assert [g[0] for g in got] == reference["greedy"], f"{tag}: tokens differ from colocated serving without MTP"
        bytes1, spec1 = _decode_figures(decode.addr)
        assert bytes1 - bytes0 == _expected_bytes(ckpt, PROMPTS)  # every stage's keys + the draft's, exactly
        accepted = spec1["spec_accepted_tokens"] - spec0["spec_accepted_tokens"]
        drafted = spec1["spec_draft_tokens"] - spec0["spec_draft_tokens"]
        assert 0 < accepted < drafted, (accepted, drafted)  # fit prompts accept, fresh ones reject
        # the decode drafts from its first step (the prefill's draft hidden state): with 3 tokens, the one decode
        # step after the prefill's token verifies exactly one draft per request (k = min(K, 3 - 1 - 1))
        got = run_requests(router, PROMPTS, FIRST_STEP, tag + "-first")
        assert [g[0] for g in got] == reference["first"]
        _, spec2 = _decode_figures(decode.addr)
        assert spec2["spec_verify_steps"] - spec1["spec_verify_steps"] == len(PROMPTS)
        assert spec2["spec_draft_tokens"] - spec1["spec_draft_tokens"] == len(PROMPTS)
    finally:
        router.stop()
    assert_clean([decode.addr] + [s.addr for s in stages], procs=cluster.procs)


def test_prefill_without_mtp_is_refused_by_a_speculating_decode(world):
    backend, cluster, decode, _ = world
    if backend != "mooncake":
        pytest.skip("one refusal is enough (the handshake is the same over both backends)")
    (p,) = cluster.prefill("plain", backend, True, (12,), extra=["--decode", decode.addr, "--startup-wait", "30"])
    wait_for(lambda: p.poll() is not None, 120, "the prefill without MTP to exit")
    assert p.poll() == 2
    log = p.tail(60)
    assert "speculates" in log and "start the prefill with --speculative-num-steps K" in log, log
