"""Disaggregated serving pieces in one process (local transfer backend, workers as threads): layer partitions,
the event log, stage page books, the handshake refusing incompatible peers, KV deadlines and aborts freeing
pages, the router's queue deadline, and a PP=2 round trip equal to colocated serving."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from dsakv.cache.allocator import IntegrityError
from dsakv.cache.device_pool import DevicePool
from dsakv.config import DecodeConfig, PrefillConfig, RouterConfig, split_layers
from dsakv.disagg.decode.events import EventLog
from dsakv.disagg.decode.worker import DecodeWorker
from dsakv.disagg.prefill.worker import PrefillStage
from dsakv.disagg.protocol.errors import IncompatiblePeer
from dsakv.disagg.protocol.messages import (
    CONNECT,
    EVENTS,
    HEALTH,
    Connect,
    EventRow,
    Events,
    EventsQuery,
    HealthQuery,
    fetch_health,
)
from dsakv.disagg.protocol.rpc import RpcClient, RpcError
from dsakv.disagg.protocol.wire import params_from_dict, params_to_dict
from dsakv.disagg.router.backend import RouterBackend
from dsakv.engine.request import SamplingParams
from dsakv.errors import CapacityError, ConfigError
from dsakv.model.batch import ForwardBatch
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.testing.cluster import free_ports, role_config
from dsakv.testing.engines import flat_engine, tiny_model

pytestmark = [pytest.mark.timeout(120)]

ENGINE = dict(kv_format="fp32", index_format="fp32", page_size=16, num_pages=64)


def test_split_layers_even_and_given():
    assert split_layers(12, 1) == [(0, 12)]
    assert split_layers(12, 5) == [(0, 3), (3, 6), (6, 8), (8, 10), (10, 12)]
    assert split_layers(12, 4, (5, 3, 2, 2)) == [(0, 5), (5, 8), (8, 10), (10, 12)]
    with pytest.raises(ConfigError, match="sum to the model's 12 layers"):
        split_layers(12, 2, (7, 4))
    with pytest.raises(ConfigError, match="has 3 stages but --pp-size is 2"):
        split_layers(12, 2, (4, 4, 4))


def test_event_log_cursor_wait_and_trim():
    log = EventLog(keep=3)
    assert log.since(0, 0.05) == Events(cursor=0, events=[], lost=False)
    log.append("a", [5], False)
    log.append("a", [6], True, "length")
    got = log.since(0)
    assert got.cursor == 2 and [e.tokens for e in got.events] == [[5], [6]] and not got.lost
    assert got.events[1] == EventRow(2, "a", [6], True, "length", None)
    assert log.since(2).events == []
    for i in range(3):
        log.append("b", [i], False)
    got = log.since(1)
    assert got.lost and [e.seq for e in got.events] == [3, 4, 5]
    t0 = time.monotonic()
    assert log.since(5, 0.2).events == [] and time.monotonic() - t0 >= 0.19


def test_event_log_wait_read_until_a_reader_asked_past_the_last_event():
    """A leaving DP rank waits until the router read its last event: a read is a since() after it; a router syncing
    (since 1 << 62) read nothing."""
    log = EventLog()
    assert log.wait_read(0.0)  # nothing to read
    log.append("a", [5], False)
    log.append("a", [6], True, "error", "gone")
    assert log.since(1 << 62).events == [] and not log.wait_read(0.05)
    assert [e.seq for e in log.since(0).events] == [1, 2] and not log.wait_read(0.05)  # got them, not yet done
    threading.Timer(0.1, lambda: log.since(2, 1.0)).start()  # the reader's next poll, after it handled them
    assert log.wait_read(30.0)


def test_page_mirror_books():
    m = PageMirror(8, "stage 1 pool")
    m.hold("r1", [0, 1])
    m.hold("r1", [0, 1, 2])  # the page list as of a later chunk
    m.hold("r2", [3])
    assert (m.num_used, m.num_free) == (4, 4)
    m.check_integrity()
    m.hold("r3", [3])
    with pytest.raises(IntegrityError, match=r"page\(s\) \[3\] are held twice"):
        m.check_integrity()
    assert m.release("r3") == [3] and m.release("nope") == []
    with pytest.raises(IntegrityError, match="outside 0..7"):
        m.hold("r4", [8])


def test_params_round_trip():
    p = SamplingParams(max_new_tokens=3, temperature=0.5, top_k=4, seed=9, stop_token_ids=(1, 2))
    assert params_from_dict(params_to_dict(p)) == p
    with pytest.raises(ConfigError, match="unknown sampling parameter"):
        params_from_dict({"max_new_tokens": 2, "beams": 4})


def _decode(**kw) -> DecodeWorker:
    cfg = role_config({**ENGINE, **kw.pop("engine", {})})
    return DecodeWorker(DecodeConfig(model="", config=cfg, **kw), model=tiny_model("glm_moe_dsa"))


def _prefill(engine: dict | None = None, pipeline: dict | None = None, **kw) -> PrefillStage:
    cfg = role_config({**ENGINE, **(engine or {})}, pipeline=pipeline)
    return PrefillStage(PrefillConfig(model="", config=cfg, **kw), model=tiny_model("glm_moe_dsa"))


@pytest.mark.parametrize(
    ("prefill_kw", "match"),
    [
        ({"engine": {"page_size": 32}}, "page size differs: sender 32 tokens/page, receiver 16 tokens/page"),
        ({"engine": {"index_format": "bf16"}}, r"L0/index_k \(layer 0, kind index_k\): format differs, sender bf16"),
    ],
)
def test_handshake_refuses_incompatible_peer(prefill_kw, match):
    dec = _decode().start()
    stage = _prefill(**prefill_kw)
    try:
        with pytest.raises(IncompatiblePeer, match=match):
            stage.links.get(dec.address)
        stage.service.rpc.start()
        with pytest.raises(IncompatiblePeer, match=match) as remote:  # the router's connect: the same error
            RpcClient(stage.address).request(CONNECT, Connect(decode=dec.address))
        assert isinstance(remote.value, RpcError) and remote.value.kind == "IncompatiblePeer"
    finally:
        stage.service.rpc.stop()
        stage.backend.close()
        dec.stop()


def test_kv_deadline_fails_request_and_frees_pages():
    dec = _decode(kv_grace=0.2, liveness_interval=0.1).start()
    stage = _prefill().start()
    try:
        c = RpcClient(dec.address)
        RpcClient(stage.address).request(CONNECT, Connect(decode=dec.address))
        # the raw wire (a msgpack map per message) is what the typed messages encode to
        params = params_to_dict(SamplingParams(max_new_tokens=4))
        res = c.call(
            "prealloc",
            {
                "rid": "late",
                "prompt_ids": list(range(2, 40)),
                "params": params,
                "prefill": stage.name,
                "num_stages": 1,
                "kv_timeout": 0.3,
            },
        )
        assert res["pages"] == [0, 1, 2] and c.request(HEALTH, HealthQuery()).pages_used == 3
        # the event ends the 3 s wait (an empty answer after 3 s fails below: no wall-clock bound, load-proof)
        ev = c.request(EVENTS, EventsQuery(since=0, wait=3.0)).events
        assert (ev[0].rid, ev[0].tokens, ev[0].finished, ev[0].reason) == ("late", [], True, "error")
        assert ev[0].error is not None
        assert "did not arrive within 0.3s (+0.2s grace): stage(s) [0] of 1 never reported" in ev[0].error
        # no stage can still write (the only stage answers pings and never got the request): pages are freed
        deadline = time.monotonic() + 3
        while fetch_health(dec.address).pages_used and time.monotonic() < deadline:
            time.sleep(0.05)
        h = fetch_health(dec.address)
        assert (h.pages_used, h.integrity, h.inbound) == (0, "ok", 0)
    finally:
        stage.stop()
        dec.stop()


def test_router_queue_deadline_names_the_reason():
    dec = _decode().start()
    try:
        r = RouterBackend(
            RouterConfig(
                prefill=(f"127.0.0.1:{free_ports(1)}",), decode=(dec.address,), queue_timeout=0.5, health_interval=0.1
            )
        )
        r.start()
        r.submit("q1", [3, 4, 5], SamplingParams(max_new_tokens=2))
        evs = list(r.events("q1", 5.0))
        assert evs[-1].finished and evs[-1].finish_reason == "error"
        assert "no prefill/decode pair could take it within 0.5s" in evs[-1].error
        assert "unavailable" in evs[-1].error
        assert r.metrics()["router_in_flight"] == 0
        r.submit("q2", [1], SamplingParams())
        with pytest.raises(ConfigError, match="already in use"):
            r.submit("q2", [1], SamplingParams())
        assert r.max_prompt_tokens() == 64 * 16 - 1
        with pytest.raises(CapacityError, match="1000 tokens \\+ max_new_tokens 100 = 1100 tokens can never fit"):
            r.submit("q3", [2] * 1000, SamplingParams(max_new_tokens=100))
        with pytest.raises(CapacityError, match="the prompt has 1100 tokens but the decode workers take at most 1023"):
            r.submit("q4", [2] * 1100, SamplingParams())
        r.stop()
    finally:
        dec.stop()


@pytest.mark.parametrize("other", ["stage 0", "whole model"])
def test_stages_sharing_one_model_each_step_their_own_pool(monkeypatch, other):
    """The in-process roles below share one model object (tiny_model is cached): stage 1's step must run on stage
    1's pool even when another thread's step (stage 0's, or a decode's on a whole-model pool) checks its own pool
    in the middle of it. CI saw the PP-2 round trip's r0..r2 fail with no token: stage 1 wrote layer 4 through
    stage 0's pool access ('layer 4 is outside this layout's layers 0-3'), the pipeline broke, the batch failed."""
    model = tiny_model("glm_moe_dsa")[1]
    fmt = dict(kv_format="fp32", index_format="fp32", page_size=4)
    stage0, stage1 = (
        DevicePool(model.layout_for(**fmt, layer_end=4), 2),
        DevicePool(model.layout_for(**fmt, layer_start=4), 2),
    )
    batch = ForwardBatch(
        input_ids=torch.tensor([5, 6, 7]),
        positions=torch.tensor([0, 1, 2]),
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([3]),
        slot_table=torch.tensor([[0, 1, 2]]),
        out_slots=torch.tensor([0, 1, 2]),
    )
    carry = model.stage_forward(batch, stage0)
    want = model.stage_forward(batch, stage1, carry)  # alone: nothing interleaves
    assert want.logits is not None
    snapshot = {k: stage1.tensor(k).clone() for k in stage1.keys}
    for k in stage1.keys:
        stage1.tensor(k).zero_()
    other_pool = stage0 if other == "stage 0" else DevicePool(model.layout_for(**fmt), 2)
    before = {k: other_pool.tensor(k).clone() for k in other_pool.keys}
    check = model.check_pool
    interleaved: list[DevicePool] = []

    def check_then_other_thread(pool):  # the other thread's step checks its pool right after this one's check
        access = check(pool)
        if pool is stage1 and not interleaved:
            check(other_pool)
            interleaved.append(other_pool)
        return access

    monkeypatch.setattr(model, "check_pool", check_then_other_thread)
    got = model.stage_forward(batch, stage1, carry)
    assert interleaved == [other_pool] and model._checked[0]() is other_pool  # the model's memo: the other pool
    assert got.logits is not None and torch.equal(got.logits, want.logits) and torch.equal(got.hidden, want.hidden)
    assert all(torch.equal(stage1.tensor(k), v) for k, v in snapshot.items())  # stage 1's KV, written in its pool
    assert all(torch.equal(other_pool.tensor(k), v) for k, v in before.items())  # and nothing in the other's


def test_pp2_round_trip_one_sided_elision_and_abort():
    """PP=2 (4 + 8 layers, elision off) -> decode (elision on), local backend: colocated tokens; an aborted
    request gives a prompt abort event; no page is held anywhere afterwards."""
    dec = _decode().start()
    port = free_ports(3)
    stages = [
        _prefill({"elide": False}, {"pp_size": 2, "pp_rank": k, "partition": (4, 8), "stage_timeout": 30.0}, port=port)
        for k in (0, 1)
    ]
    for s in stages:
        s.start()
    r = RouterBackend(RouterConfig(prefill=(stages[0].address,), decode=(dec.address,), health_interval=0.1))
    try:
        r.start()
        assert r.wait_ready(30), r.health()
        assert r.health()["pairs"][0]["skipped"] == [
            "L11/index_k",
            "L3/index_k",
            "L4/index_k",
            "L5/index_k",
            "L7/index_k",
            "L8/index_k",
            "L9/index_k",
        ]
        g = torch.Generator().manual_seed(3)
        prompts = [torch.randint(2, 512, (n,), generator=g).tolist() for n in (3, 20, 47)]
        sp = SamplingParams(max_new_tokens=5, ignore_eos=True)
        want = flat_engine(tiny_model("glm_moe_dsa"), **ENGINE).generate(prompts, sp)
        for i, p in enumerate(prompts):
            r.submit(f"r{i}", p, sp)
        r.submit("gone", prompts[1], SamplingParams(max_new_tokens=200, ignore_eos=True))
        r.abort("gone")
        got, ends = [], []
        for i in range(3):
            toks = []
            for ev in r.events(f"r{i}", 20):
                toks += ev.new_token_ids
                if ev.finished:
                    ends.append((ev.finish_reason, ev.error))
            got.append(toks)
        assert ends == [("length", None)] * 3 and got == want, (ends, got)
        evs = list(r.events("gone", 5))
        assert [(e.new_token_ids, e.finished, e.finish_reason, e.error) for e in evs] == [((), True, "abort", None)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            used = [dec.engine.stats().pages_used] + [s.pages_used() for s in stages]
            if used == [0, 0, 0]:
                break
            time.sleep(0.05)
        assert used == [0, 0, 0]
        assert dec.integrity() == "ok" and [s.integrity() for s in stages] == ["ok", "ok"]
    finally:
        r.stop()
        for s in stages:
            s.stop()
        dec.stop()
