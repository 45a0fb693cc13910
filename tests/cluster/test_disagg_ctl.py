"""Control calls bound to their request and sender, and idle connections, on a real PD deployment (decode D + PP=2
prefill P over mooncake + the router in this process, one cluster secret; issue 26, findings 4 and 5).

A process holding the secret (the prefill role's key) cannot release another request's pages on prefill stage 0,
fail another request's KV with `kv_failed`, or take over a stage's registration with a handshake that reuses its
boot id with another layer split or arrives while the stage is stopped: each is refused and the victims decode
exactly the reference tokens. `abort` frees a 3600 s prealloc's pages at once (the stages promise, by REVOKE, that no
write of them is in flight). 300 idle connections to each RPC port do not fail routed requests, and every one of
them is closed once its authentication deadline passed (the servers' counters say so)."""

from __future__ import annotations

import os
import signal
import socket
import threading

import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.disagg.protocol import auth
from dsakv.disagg.protocol.auth import ClusterAuth, Keyring
from dsakv.disagg.protocol.errors import Forbidden, GrantRefused
from dsakv.disagg.protocol.messages import (
    ABORT,
    EVENTS,
    HANDSHAKE,
    KV_FAILED,
    PING,
    PREALLOC,
    RELEASED,
    SUBMIT,
    Abort,
    EventsQuery,
    Hello,
    KvFailed,
    Ping,
    Prealloc,
    Released,
    Submit,
    fetch_health,
)
from dsakv.disagg.protocol.rpc import RpcClient
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, free_ports, run_requests, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(400)]

BACKEND = "mooncake"
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
KEYS = Keyring(auth.load_secret(os.environ[auth.SECRET_ENV]))  # the suite's secret (conftest): the cluster's
AS = {r: ClusterAuth(KEYS, r) for r in auth.ROLES}
IDLE = 300


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(k),), generator=g).tolist() for k in torch.randint(5, 50, (n,), generator=g)]


@pytest.fixture(scope="module")
def reference():
    eng = Engine(tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES))
    return lambda prompts: eng.generate(prompts, PARAMS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("disagg-ctl"))
    mc = ["--mooncake-timeout", "5", "--rpc-timeout", "3"]
    try:
        d = cluster.decode("D", BACKEND, True, free_ports(1), extra=[*mc, "--max-kv-timeout", "3600"])
        p0, p1 = cluster.prefill(
            "P", BACKEND, True, (7, 5), free_ports(3), extra=[*mc, "--debug-transfer-delay", "1.0"]
        )
        cluster.wait_healthy([d, p0, p1], timeout=180)
        router = cluster.router([p0.addr], [d.addr])
        router.wait_ready(60)
        boots = [RpcClient(p.addr).request(PING, Ping()).boot for p in (p0, p1)]
        yield cluster, router, d, p0, p1, boots
    finally:
        cluster.close()


def _client(addr: str, role: str) -> RpcClient:
    return RpcClient(addr, timeout=5, auth=AS[role])


def _counters(addr: str) -> dict[str, int]:
    return fetch_health(addr).counters


def _tokens(dec: str, rid: str) -> list[int]:
    """Request `rid`'s tokens from the decode's event log, once it finished (without an error)."""
    toks: list[int] = []

    def finished() -> bool:
        rows = [e for e in _client(dec, "router").request(EVENTS, EventsQuery(since=0)).events if e.rid == rid]
        assert not any(e.error for e in rows), rows
        toks[:] = [t for e in rows for t in e.tokens]
        return any(e.finished for e in rows)

    wait_for(finished, 60, f"{rid} decoded")
    return toks


def _check(router, reference, seed: int) -> None:
    prompts = _prompts(seed)
    out = run_requests(router, prompts, PARAMS, f"v{seed}")
    assert [o[0] for o in out] == reference(prompts) and all(o[2] is None for o in out), out


def _stage_manifest(start: int, end: int) -> bytes:
    """A valid prefill stage manifest of layers [start, end) (what a forger with the secret can build)."""
    spec, mdl = tiny_model("glm_moe_dsa")
    pool = DevicePool(
        mdl.layout_for(
            elide=True, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE, layer_start=start, layer_end=end
        ),
        2,
    )
    be = make_backend("local")
    be.register(pool.regions())
    m = Manifest.from_pool(pool, be.meta(), worker="forged").to_bytes()
    be.close()
    return m


def test_released_only_from_its_stage_with_the_grant(world, reference):
    """Prefill stage 0 frees a request's pages once every stage released them: a release from a process that is not
    the stage, without the request's grant, or for stage 0 itself is refused, and the request decodes exactly."""
    cluster, router, d, p0, p1, boots = world
    prompt = _prompts(11, 1)[0]
    rid = "rel#1"
    res = _client(d.addr, "router").request(PREALLOC, Prealloc(rid, prompt, PARAMS, "P", 2, 30.0))
    before = _counters(p0.addr).get("releases_refused", 0)
    sub = Submit(rid, prompt, PARAMS, 0, d.addr, res.boot, res.pages, 30.0, res.grant)
    assert _client(p0.addr, "router").request(SUBMIT, sub).accepted  # p0 holds the job from here (1 s transfer delay)
    forger = _client(p0.addr, "prefill")
    cases = [
        (Released(rid, 1), "comes from boot \\(none\\), but stage 1 of this pipeline is boot"),  # the attack
        (Released(rid, 1, "forged", res.grant), "comes from boot forged"),
        (Released(rid, 1, boots[1]), "does not carry the request's grant"),
        (Released(rid, 1, boots[1], b"\0" * len(res.grant)), "does not carry the request's grant"),
        (Released(rid, 0, boots[0], res.grant), "stage 0 of this pipeline is no stage that reports releases"),
        (Released(rid, 5, boots[1], res.grant), "stage 5 of this pipeline is no stage"),
    ]
    for msg, match in cases:
        with pytest.raises(Forbidden, match=f"released of {rid} stage {msg.stage} refused: .*{match}"):
            forger.request(RELEASED, msg)
    assert _counters(p0.addr)["releases_refused"] - before == len(cases)
    assert _tokens(d.addr, rid) == reference([prompt])[0]
    _check(router, reference, 12)
    assert_clean([d.addr, p0.addr, p1.addr])


def test_kv_failed_only_from_its_stage_with_the_grant(world, reference):
    cluster, router, d, p0, p1, boots = world
    prompt = _prompts(13, 1)[0]
    rid = "kvf#1"
    res = _client(d.addr, "router").request(PREALLOC, Prealloc(rid, prompt, PARAMS, "P", 2, 30.0))
    before = _counters(d.addr)["reports_refused"]
    forger = _client(d.addr, "prefill")
    cases = [
        (KvFailed(rid, "forged", "P", boots[0]), "stage -1 is not one of its 2 stages"),  # the attack
        (KvFailed(rid, "forged", "P", boots[0], 0), "it does not carry the request's grant"),
        (KvFailed(rid, "forged", "P", boots[1], 1, b"x" * len(res.grant)), "it does not carry the request's grant"),
        (KvFailed(rid, "forged", "P", boots[1], 0, res.grant), f"boot {boots[1]} is not the request's stage 0"),
        (KvFailed(rid, "forged", "P", "forged", 1, res.grant), "boot forged is not the request's stage 1"),
    ]
    for msg, match in cases:
        with pytest.raises(Forbidden, match=f"kv_failed of {rid} refused: {match}"):
            forger.request(KV_FAILED, msg)
    assert _counters(d.addr)["reports_refused"] - before == len(cases)
    sub = Submit(rid, prompt, PARAMS, 0, d.addr, res.boot, res.pages, 30.0, res.grant)
    assert _client(p0.addr, "router").request(SUBMIT, sub).accepted  # still waiting for its KV: it decodes exactly
    assert _tokens(d.addr, rid) == reference([prompt])[0]
    assert_clean([d.addr, p0.addr, p1.addr])


def test_handshake_reusing_a_boot_with_another_split_is_refused(world, reference):
    cluster, router, d, p0, p1, boots = world
    stages = [(s.prefill, s.stage, s.rpc, s.layers, s.boot) for s in fetch_health(d.addr).stages]
    forger = _client(d.addr, "prefill")
    for hello in (
        Hello("P", 0, 2, p0.addr, _stage_manifest(0, 6), boot=boots[0]),  # stage 0's boot, layers 0-5
        Hello("P", 1, 2, p1.addr, _stage_manifest(6, 12), boot=boots[1]),  # stage 1's boot, layers 6-11
        Hello("P", 1, 2, "127.0.0.1:1", _stage_manifest(7, 12), boot=boots[1]),  # its boot, another address
    ):
        with pytest.raises(Forbidden, match=f"stage {hello.stage} \\(boot {hello.boot}\\) registered layers"):
            forger.request(HANDSHAKE, hello)
    assert [(s.prefill, s.stage, s.rpc, s.layers, s.boot) for s in fetch_health(d.addr).stages] == stages
    _check(router, reference, 14)  # the pair still serves
    assert_clean([d.addr, p0.addr, p1.addr])


def test_handshake_while_the_stage_is_stopped_cannot_take_it_over(world, reference):
    """Stage 1 stopped (SIGSTOP) for longer than the decode's 1 s ping: a handshake from another boot is refused
    (a stalled process may resume), and once it resumes the pair serves exactly."""
    cluster, router, d, p0, p1, boots = world
    stages = [(s.prefill, s.stage, s.rpc, s.boot) for s in fetch_health(d.addr).stages]
    forger = _client(d.addr, "prefill")
    hello = Hello("P", 1, 2, p1.addr, _stage_manifest(7, 12), boot="evil")
    p1.signal(signal.SIGSTOP)
    try:
        with pytest.raises(Forbidden, match=f"registered by boot {boots[1]} at {p1.addr}, which still answers or may"):
            forger.request(HANDSHAKE, hello)
    finally:
        p1.signal(signal.SIGCONT)
    assert [(s.prefill, s.stage, s.rpc, s.boot) for s in fetch_health(d.addr).stages] == stages
    wait_for(lambda: fetch_health(p0.addr).ok, 60, "P serving again")  # (the stop may have re-formed the pipeline)
    _check(router, reference, 15)
    assert_clean([d.addr, p0.addr, p1.addr])


def test_abort_frees_a_3600s_prealloc_at_once(world, reference):
    cluster, router, d, p0, p1, boots = world
    base = fetch_health(d.addr).pages_used
    dec = _client(d.addr, "router")
    held = [dec.request(PREALLOC, Prealloc(f"held{i}#1", [3] * 100, PARAMS, "P", 2, 3600.0)) for i in range(4)]
    assert [len(h.pages) for h in held] == [7] * 4 and fetch_health(d.addr).pages_used == base + 28
    before = _counters(d.addr).get("revoked", 0)
    for i in range(4):
        assert dec.request(ABORT, Abort(f"held{i}#1"))
    # both stages promise no write of them can land (REVOKE): freed now, not after 3600 s + grace + quarantine
    wait_for(lambda: fetch_health(d.addr).pages_used == base, 30, "the aborted preallocs' pages freed")
    h = fetch_health(d.addr)
    assert (h.pages_used, h.inbound, h.failed_held, h.counters["revoked"] - before) == (base, 0, 0, 8)
    g = held[0]  # a submit of a revoked grant is refused (and a stage that had it queued would not write it)
    with pytest.raises(GrantRefused, match="request held0#1: the decode revoked its page grant"):
        sub = Submit("held0#1", [3] * 100, PARAMS, 0, d.addr, g.boot, g.pages, 30.0, g.grant)
        _client(p0.addr, "router").request(SUBMIT, sub)
    assert fetch_health(d.addr).pages_used == base
    _check(router, reference, 16)
    assert_clean([d.addr, p0.addr, p1.addr])


def _drain_closed(s: socket.socket) -> None:
    """Read until the server closes `s` (its greeting first, if it sent one)."""
    s.settimeout(30)
    while s.recv(4096):
        pass
    s.close()


def test_idle_connections_do_not_fail_routed_requests(world, reference):
    """While requests are routed, rounds of 300 idle connections to each RPC port (decode, both prefill stages)
    are opened, each round held until the servers closed every one of them: every request decodes exactly, no
    connection is refused for the cap, and every idle one was closed by the server (evicted by a newer one, or at
    its authentication deadline)."""
    cluster, router, d, p0, p1, boots = world
    addrs = [d.addr, p0.addr, p1.addr]
    key = ("rpc_refused_auth_timeout", "rpc_refused_evicted")
    before = {a: sum(_counters(a)[k] for k in key) for a in addrs}
    opened = dict.fromkeys(addrs, 0)
    done = threading.Event()

    def flood() -> None:
        while not done.is_set():
            idle = []
            for a in addrs:
                host, port = a.rsplit(":", 1)
                idle += [socket.create_connection((host, int(port)), timeout=10) for _ in range(IDLE)]
                opened[a] += IDLE
            for s in idle:
                _drain_closed(s)

    flooder = threading.Thread(target=flood)
    flooder.start()
    out: list = []
    try:
        wait_for(lambda: all(opened.values()), 60, "the first round of idle connections")
        threads = [
            threading.Thread(target=lambda s=s: out.append((s, run_requests(router, _prompts(s), PARAMS, f"i{s}"))))
            for s in (21, 22, 23)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        done.set()
        flooder.join(120)
    assert len(out) == 3 and not flooder.is_alive()
    for s, res in sorted(out):
        assert [o[0] for o in res] == reference(_prompts(s)) and all(o[2] is None for o in res), (s, res)
    wait_for(lambda: all(_counters(a)["rpc_connections_pending"] == 0 for a in addrs), 30, "no connection pending")
    for a in addrs:
        c = _counters(a)
        assert sum(c[k] for k in key) - before[a] >= opened[a] >= IDLE and c["rpc_refused_connections"] == 0, (a, c)
    _check(router, reference, 24)
    assert_clean(addrs)


def test_abort_of_a_submitted_request_frees_once_no_write_can_land(world, reference):
    """Abort (as the router sends it: decode and prefill stage 0) of a request inside its transfer window: the
    pages come back once the stages revoked or reported the write, and every book balances."""
    cluster, router, d, p0, p1, boots = world
    base = fetch_health(d.addr).pages_used
    prompt = _prompts(17, 1)[0]
    rid = "ab#1"
    res = _client(d.addr, "router").request(PREALLOC, Prealloc(rid, prompt, PARAMS, "P", 2, 3600.0))
    sub = Submit(rid, prompt, PARAMS, 0, d.addr, res.boot, res.pages, 3600.0, res.grant)
    assert _client(p0.addr, "router").request(SUBMIT, sub).accepted
    assert _client(d.addr, "router").request(ABORT, Abort(rid, "client left"))
    _client(p0.addr, "router").request(ABORT, Abort(rid, "client left"))
    wait_for(lambda: fetch_health(d.addr).pages_used == base, 30, "the aborted request's pages freed")
    assert_clean([d.addr, p0.addr, p1.addr])
    _check(router, reference, 18)
