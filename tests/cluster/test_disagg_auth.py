"""The authenticated control plane of a real PD deployment (decode D + PP=2 prefill P over mooncake + the router in
this process, one cluster secret): calls without the secret, from the wrong role, forged reports from a process that
did not register, a handshake that would hijack a registration, prealloc with absurd numbers, and submits with a
missing, forged, altered, foreign, spent or expired page grant are all refused; requests in flight meanwhile finish
with the reference tokens, and every worker is back to no page held with balanced books."""

from __future__ import annotations

import os
import socket
import threading
import time

import msgpack
import pytest
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.disagg.protocol import auth
from dsakv.disagg.protocol.auth import ClusterAuth, Keyring
from dsakv.disagg.protocol.errors import Forbidden, GrantRefused, MessageError
from dsakv.disagg.protocol.messages import (
    ABORT,
    EVENTS,
    HANDSHAKE,
    KV_FAILED,
    PING,
    PREALLOC,
    RELEASED,
    STAGE_DONE,
    SUBMIT,
    Abort,
    EventsQuery,
    Hello,
    KvFailed,
    Ping,
    Prealloc,
    Released,
    StageDone,
    Submit,
    fetch_health,
)
from dsakv.disagg.protocol.rpc import RpcClient, pack, recv_frame, recv_msg, send_frame
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, call, free_ports, run_requests, wait_for
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path

pytestmark = [pytest.mark.timeout(300)]

BACKEND = "mooncake"
PARAMS = SamplingParams(max_new_tokens=4, ignore_eos=True)
KEYS = Keyring(auth.load_secret(os.environ[auth.SECRET_ENV]))  # the suite's secret (conftest): the cluster's
AS = {r: ClusterAuth(KEYS, r) for r in auth.ROLES}


def _prompts(seed: int, n: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (int(k),), generator=g).tolist() for k in torch.randint(5, 50, (n,), generator=g)]


@pytest.fixture(scope="module")
def reference():
    eng = Engine(tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES))
    return lambda prompts: eng.generate(prompts, PARAMS)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("disagg-auth"))
    mc = ["--mooncake-timeout", "5", "--rpc-timeout", "3"]
    try:
        d = cluster.decode("D", BACKEND, True, free_ports(1), extra=mc)
        p0, p1 = cluster.prefill(
            "P", BACKEND, True, (7, 5), free_ports(3), extra=[*mc, "--debug-transfer-delay", "0.5"]
        )
        cluster.wait_healthy([d, p0, p1], timeout=180)
        router = cluster.router([p0.addr], [d.addr])
        router.wait_ready(60)
        boots = [RpcClient(p.addr).request(PING, Ping()).boot for p in (p0, p1)]
        yield cluster, router, d.addr, p0.addr, p1.addr, boots
    finally:
        cluster.close()


class Victims:
    """Requests through the router, started before an attack and checked after it."""

    def __init__(self, router, seed: int) -> None:
        self.prompts = _prompts(seed)
        self.out: list = []
        self.t = threading.Thread(
            target=lambda: self.out.extend(run_requests(router, self.prompts, PARAMS, f"v{seed}"))
        )
        self.t.start()

    def check(self, reference) -> None:
        self.t.join(90)
        assert [o[0] for o in self.out] == reference(self.prompts) and all(o[2] is None for o in self.out), self.out


def _client(addr: str, role: str | None) -> RpcClient:
    return RpcClient(addr, timeout=5, auth=AS[role] if role else None)


def _counters(addr: str) -> dict[str, int]:
    return fetch_health(addr).counters


def _prealloc(dec: str, rid: str, prompt: list[int], kv_timeout: float) -> object:
    return _client(dec, "router").request(PREALLOC, Prealloc(rid, prompt, PARAMS, "P", 2, kv_timeout))


def test_calls_without_the_secret_are_refused_before_parsing(world, reference):
    cluster, router, dec, p0, p1, boots = world
    v = Victims(router, 1)
    before = {a: _counters(a)["rpc_refused_unauthenticated"] for a in (dec, p0, p1)}
    forged = {  # what the attacker sent, as plain frames
        dec: [
            ("events", {"since": 0}),
            ("abort", {"rid": "v1-0#1"}),
            ("prealloc", {"rid": "x", "prompt_ids": [1], "params": {}, "prefill": "P", "num_stages": 2,
                          "kv_timeout": 1e9}),
            ("stage_done", {"rid": "v1-0#1", "prefill": "P", "stage": 0, "ok": True}),
            ("handshake", {"prefill": "P", "stage": 0, "num_stages": 2, "rpc": "127.0.0.1:1", "manifest": b""}),
            ("health", None),
        ],
        p0: [("submit", {"rid": "x", "dst_pages": [0, 1]}), ("connect", {"decode": "127.0.0.1:1"}),
             ("abort", {"rid": "x"})],
        p1: [("connect", {"decode": "127.0.0.1:1"})],
    }  # fmt: skip
    for addr, calls in forged.items():
        host, port = addr.rsplit(":", 1)
        for method, params in calls:
            s = socket.create_connection((host, int(port)), timeout=5)
            assert recv_msg(s)["auth"] == "hmac-sha256"
            send_frame(s, pack({"id": 1, "method": method, "params": params}))
            frame = recv_frame(s)
            assert frame[:2] == b"X1" and "not authenticated" in msgpack.unpackb(frame[2:])["error"]
            assert s.recv(1) == b""  # and closed
            s.close()
    wrong = ClusterAuth(Keyring(b"another deployment's secret"), "router")
    with pytest.raises(Exception, match="tag does not verify"):
        RpcClient(dec, auth=wrong).request(EVENTS, EventsQuery())
    v.check(reference)
    after = {a: _counters(a)["rpc_refused_unauthenticated"] for a in (dec, p0, p1)}
    assert {a: after[a] - before[a] for a in after} == {dec: 7, p0: 3, p1: 1}
    assert_clean([dec, p0, p1])


def test_roles_may_call_only_their_rpcs(world, reference):
    cluster, router, dec, p0, p1, boots = world
    v = Victims(router, 2)
    before = {a: _counters(a)["rpc_refused_forbidden"] for a in (dec, p0)}
    sd = StageDone("v2-0#1", "P", 0, True, boot=boots[0])
    attempts = [
        ("prefill", dec, EVENTS, EventsQuery()),
        ("prefill", dec, ABORT, Abort("v2-0#1")),
        ("prefill", dec, PREALLOC, Prealloc("x", [1, 2], PARAMS, "P", 2, 5.0)),
        ("decode", dec, ABORT, Abort("v2-1#1")),
        ("router", dec, STAGE_DONE, sd),
        ("router", dec, KV_FAILED, KvFailed("v2-0#1", "forged", "P", boots[0])),
        ("router", dec, HANDSHAKE, Hello("P", 0, 2, p0, b"", boot=boots[0])),
        ("prefill", p0, SUBMIT, Submit("x", [1], PARAMS, 0, dec, "b", [0], 5.0)),
        ("prefill", p0, ABORT, Abort("v2-0#1")),
        ("decode", p0, SUBMIT, Submit("x", [1], PARAMS, 0, dec, "b", [0], 5.0)),
        ("router", p0, RELEASED, Released("v2-0#1", 1)),
    ]
    for role, addr, rpc, msg in attempts:
        with pytest.raises(Forbidden, match=f"{rpc.name} may be called by .* only, not by a {role}"):
            _client(addr, role).request(rpc, msg)
    v.check(reference)
    after = {a: _counters(a)["rpc_refused_forbidden"] for a in (dec, p0)}
    assert {a: after[a] - before[a] for a in after} == {dec: 7, p0: 4}
    assert_clean([dec, p0, p1])


def test_handshake_cannot_hijack_a_registration(world, reference):
    cluster, router, dec, p0, p1, boots = world
    spec, mdl = tiny_model("glm_moe_dsa")
    pool = DevicePool(
        mdl.layout_for(
            elide=True, kv_format="fp32", index_format="fp32", page_size=PAGE_SIZE, layer_start=0, layer_end=7
        ),
        2,
    )
    be = make_backend("local")
    be.register(pool.regions())
    manifest = Manifest.from_pool(pool, be.meta(), worker="evil").to_bytes()  # a valid stage-0 manifest
    be.close()
    stages = [(s.prefill, s.stage, s.rpc) for s in fetch_health(dec).stages]
    pre = _client(dec, "prefill")
    cases = [
        (Hello("P", 0, 2, "127.0.0.1:1", manifest, boot="evil"), Forbidden, "which still answers"),
        (Hello("P", 0, 1, p0, manifest, boot="evil"), MessageError, "it is the last of 1 stages"),
        (Hello("P", 1, 2, p0, manifest, boot="evil"), MessageError, "its manifest starts at layer 0"),
        (Hello("P", 3, 2, p0, manifest, boot="evil"), MessageError, "stage 3 is not within its 2-stage pipeline"),
        (Hello("P", 0, 2, "nonsense", manifest, boot="evil"), MessageError, "must be host:port"),
        (Hello("P", 0, 2, p0, manifest), MessageError, "no boot id"),
        (Hello("P", 0, 10**6, p0, manifest, boot="evil"), MessageError, "out of range"),
    ]
    for hello, err, match in cases:
        with pytest.raises(err, match=match):
            pre.request(HANDSHAKE, hello)
    assert [(s.prefill, s.stage, s.rpc) for s in fetch_health(dec).stages] == stages
    Victims(router, 4).check(reference)  # P still served through its registration
    assert_clean([dec, p0, p1])


def test_reports_only_from_the_registered_stage_with_the_grant(world, reference):
    """A holder of the prefill key that is not the registered stage process (or lacks the request's grant)
    cannot start a decode on unwritten KV or fail someone else's request."""
    cluster, router, dec, p0, p1, boots = world
    v = Victims(router, 3)
    before = _counters(dec)["reports_refused"]
    prompt = list(range(2, 30))
    res = _prealloc(dec, "mine#1", prompt, 3.0)
    pre = _client(dec, "prefill")
    with pytest.raises(Forbidden, match="boot forged, but the request's stage 0 is prefill 'P' boot"):
        pre.request(STAGE_DONE, StageDone("mine#1", "P", 0, True, first_token=5, boot="forged", grant=res.grant))
    with pytest.raises(Forbidden, match="does not carry the request's grant"):
        pre.request(STAGE_DONE, StageDone("mine#1", "P", 1, True, first_token=5, boot=boots[1]))
    with pytest.raises(Forbidden, match="kv_failed of mine#1 refused: boot forged is not the request's stage 0"):
        pre.request(KV_FAILED, KvFailed("mine#1", "forged", "P", "forged", 0, res.grant))
    assert fetch_health(dec).inbound >= 1  # still waiting for its KV: nothing started, nothing failed
    assert _counters(dec)["reports_refused"] - before == 3
    assert _client(dec, "router").request(ABORT, Abort("mine#1"))  # released after deadline + quarantine (last test)
    v.check(reference)


def test_prealloc_numbers_refused_and_abort_releases(world):
    cluster, router, dec, p0, p1, boots = world
    base = fetch_health(dec).pages_used
    for kv in (float("inf"), float("nan"), 1e9, -1.0):
        params = {
            "rid": "big",
            "prompt_ids": [3] * 100,
            "params": {},
            "prefill": "P",
            "num_stages": 2,
            "kv_timeout": kv,
        }
        with pytest.raises(MessageError, match=r"prealloc request\.kv_timeout: .*(finite|out of range)"):
            call(dec, "prealloc", params)
        assert fetch_health(dec).pages_used == base
    with pytest.raises(MessageError, match=r"events request\.wait: .*finite"):
        call(dec, "events", {"since": 0, "wait": float("inf")})
    # the longest a prealloc may hold pages is bounded, and abort releases them once both stages promised no write
    # of them can land (REVOKE; tests/test_disagg_ctl.py checks exact counts)
    res = _prealloc(dec, "held#1", [3] * 100, 0.5)
    assert len(res.pages) == 7 and fetch_health(dec).pages_used == base + 7
    assert _client(dec, "router").request(ABORT, Abort("held#1"))
    wait_for(lambda: fetch_health(dec).pages_used <= base, 30, "the aborted prealloc's pages freed")


def test_submit_needs_the_decodes_grant(world, reference):
    cluster, router, dec, p0, p1, boots = world
    prompt = _prompts(9, 1)[0]
    before = _counters(p0).get("grants_refused", 0)
    res = _prealloc(dec, "g#1", prompt, 0.5)
    other = _prealloc(dec, "g#2", prompt, 20.0)  # another request's pages: the forged submit's target
    sub = _client(p0, "router")

    def submit(rid, pages, grant):
        return sub.request(SUBMIT, Submit(rid, prompt, PARAMS, 0, dec, res.boot, pages, 20.0, grant))

    tampered = bytearray(res.grant)
    tampered[-40] ^= 1
    cases = [
        (("g#3", res.pages, res.grant), "the page grant is for request 'g#1', not 'g#3'"),
        (("g#1", other.pages, res.grant), "are not the granted pages"),
        (("g#1", res.pages, b""), "no page grant"),
        (("g#1", res.pages, bytes(tampered)), "does not verify"),
        (("g#2", other.pages, res.grant), "is for request 'g#1'"),
    ]
    for args, match in cases:
        with pytest.raises(GrantRefused, match=match):
            submit(*args)
    time.sleep(2.0)  # g#1's grant expires (0.5 s + the decode's 1 s grace): stolen now, it is worthless
    with pytest.raises(GrantRefused, match="request g#1: the page grant expired"):
        submit("g#1", res.pages, res.grant)
    _client(dec, "router").request(ABORT, Abort("g#1"))  # (it may have failed its deadline already)
    # the genuine grant works once: the request decodes the reference tokens; a replay of it is refused
    assert submit("g#2", other.pages, other.grant).accepted
    with pytest.raises(GrantRefused, match="used already"):
        submit("g#2", other.pages, other.grant)
    assert _counters(p0)["grants_refused"] - before == 7
    toks: list[int] = []

    def finished() -> bool:
        rows = [e for e in _client(dec, "router").request(EVENTS, EventsQuery(since=0)).events if e.rid == "g#2"]
        toks[:] = [t for e in rows for t in e.tokens]
        return any(e.finished for e in rows)

    wait_for(finished, 30, "g#2 decoded")
    assert toks == reference([prompt])[0]


def test_every_page_comes_back(world, reference):
    """What the tests above left held (aborted and expired preallocs) is released once no stage can write it any
    more (the deadline + mooncake's 30 s quarantine), and the deployment still serves the reference tokens."""
    cluster, router, dec, p0, p1, boots = world
    Victims(router, 5).check(reference)
    assert_clean([dec, p0, p1], timeout=60)
