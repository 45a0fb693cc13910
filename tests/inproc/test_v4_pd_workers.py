"""The DeepSeek-V4 PD workers in one process (local transfer backend, real RPC servers): a request through
prealloc -> submit -> transfer -> decode equals a colocated V4Engine; and every failure path frees what the
request held, exactly, without touching another request: a forged grant or report is refused, a stage that never
reports fails its request at the deadline naming the stage, KV_FAILED and ABORT free pages and slot."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dsakv.config import (
    Config,
    DecodeConfig,
    EngineConfig,
    LayoutConfig,
    PoolConfig,
    PrefillConfig,
    SchedulerConfig,
    TransferConfig,
)
from dsakv.disagg.decode.v4_worker import V4DecodeWorker
from dsakv.disagg.prefill.v4_worker import V4PrefillWorker
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.errors import Forbidden, GrantRefused, IncompatiblePeer
from dsakv.disagg.protocol.messages import Abort, Connect, Hello, KvFailed, Prealloc, StageDone, Submit
from dsakv.engine.request import SamplingParams
from dsakv.engine.v4_engine import V4Engine
from dsakv.errors import ConfigError
from dsakv.model.deepseek_v4 import load_v4
from dsakv.model.deepseek_v4_tiny import make_tiny_v4
from dsakv.util import ceil_div
from dsakv.util.procs import free_ports

PAGES, RUNNING, PAGE = 24, 3, 16
GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0)


def _config() -> Config:
    return Config(
        engine=EngineConfig(
            layout=LayoutConfig(page_size=PAGE),
            pool=PoolConfig(num_pages=PAGES),
            scheduler=SchedulerConfig(max_batch_tokens=16, max_running_requests=RUNNING),
        ),
        transfer=TransferConfig(backend="local"),
    )


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4pdw") / "flash", "flash")


@pytest.fixture(scope="module")
def pair(ckpt: Path) -> Iterator[tuple[V4PrefillWorker, V4DecodeWorker]]:
    dec = V4DecodeWorker(DecodeConfig(model=str(ckpt), config=_config(), name="v4d")).start()
    pre = V4PrefillWorker(PrefillConfig(model=str(ckpt), config=_config(), name="v4p")).start()
    pre.connect(Connect(decode=dec.address))
    try:
        yield pre, dec
    finally:
        pre.stop()
        dec.stop()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _events(dec: V4DecodeWorker, rid: str, timeout: float = 60.0) -> tuple[list[int], str | None, str | None]:
    """The request's tokens, finish reason and error once its last event came."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        rows = [e for e in dec.events.since(0, 0.0).events if e.rid == rid]
        if rows and rows[-1].finished:
            return [t for e in rows for t in e.tokens], rows[-1].reason, rows[-1].error
        time.sleep(0.02)
    raise AssertionError(f"{rid}: no finished event within {timeout}s")


def _free(dec: V4DecodeWorker) -> tuple[int, int]:
    e = dec.engine.engine
    return e.pages.num_free, e.slots.num_free


def _prealloc(dec: V4DecodeWorker, rid: str, prompt: list[int], kv_timeout: float = 30.0) -> tuple[list[int], bytes]:
    got = dec.prealloc(Prealloc(rid, prompt, GREEDY, "v4p", 1, kv_timeout))
    return got.pages, got.grant


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(max_new_tokens=6, temperature=0.8, top_k=64, seed=77)])
def test_request_through_both_workers_equals_colocated(pair, ckpt: Path, params: SamplingParams) -> None:  # type: ignore[no-untyped-def]
    """Greedy, and seeded sampling: the prefill draws token 0 with (seed, 0), the decode tokens 1.. with (seed, i)."""
    pre, dec = pair
    prompts = [_prompt(n, s) for n, s in ((5, 1), (21, 2), (40, 3))]
    eng = V4Engine(load_v4(ckpt), num_pages=64, max_running=4)
    ids = [eng.add_request(p, 6, sampling=params, seed=int(params.seed or 0)) for p in prompts]
    while eng.has_unfinished():
        eng.step()
    want = [eng.finished[i].output for i in ids]
    sent, kv = pre.stats.transfer_bytes, dec.stats.kv_bytes
    for i, p in enumerate(prompts):
        rid = f"ok-{params.temperature}-{i}"
        got = dec.prealloc(Prealloc(rid, p, params, "v4p", 1, 30.0))
        assert len(got.pages) == ceil_div(len(p) + 6, PAGE)
        pre.submit(Submit(rid, p, params, int(params.seed or 0), dec.address, dec.boot, got.pages, 30.0, got.grant))
    got = [_events(dec, f"ok-{params.temperature}-{i}") for i in range(3)]
    assert [g[0] for g in got] == want and {(g[1], g[2]) for g in got} == {("length", None)}
    lay = dec.layout
    figure = sum(ceil_div(len(p), PAGE) * sum(b.page_bytes for b in lay.paged) + lay.state_bytes_per_request
                 for p in prompts)  # fmt: skip
    assert dec.stats.kv_bytes - kv == figure and pre.stats.transfer_bytes - sent == figure
    _settled(pre, dec)


def _settled(pre: V4PrefillWorker, dec: V4DecodeWorker) -> None:
    end = time.monotonic() + 20
    while time.monotonic() < end and (_free(dec) != (PAGES, RUNNING) or pre.jobs):
        time.sleep(0.02)
    assert _free(dec) == (PAGES, RUNNING) and not pre.jobs
    assert pre.engine.pages.num_free == PAGES and pre.engine.slots.num_free == RUNNING
    assert dec.integrity() == "ok" and pre.integrity() == "ok"


def test_forged_grant_and_reports_are_refused_and_touch_nothing(pair) -> None:  # type: ignore[no-untyped-def]
    pre, dec = pair
    p = _prompt(20, 7)
    pages, grant = _prealloc(dec, "forge", p)
    held = _free(dec)
    assert held == (PAGES - len(pages), RUNNING - 1)
    forged = grants.sign(b"k" * 32, rid="forge", prefill="v4p", boot=dec.boot, pages=pages, expires=time.time() + 9)
    with pytest.raises(GrantRefused, match="does not verify"):
        pre.submit(Submit("forge", p, GREEDY, 0, dec.address, dec.boot, pages, 30.0, forged))
    with pytest.raises(GrantRefused, match="not the granted pages"):  # pages other than the granted ones
        pre.submit(Submit("forge", p, GREEDY, 0, dec.address, dec.boot, pages[::-1], 30.0, grant))
    assert not pre.jobs and not pre.engine.waiting
    with pytest.raises(Forbidden, match="boot nope is not its stage 0"):
        dec.stage_done(StageDone("forge", "v4p", 0, True, first_token=5, boot="nope", grant=grant))
    with pytest.raises(Forbidden, match="does not carry the request's grant"):
        dec.stage_done(StageDone("forge", "v4p", 0, True, first_token=5, boot=pre.boot, grant=forged))
    with pytest.raises(Forbidden, match="stage 1 is not one of its stages"):
        dec.kv_failed(KvFailed("forge", "x", "v4p", pre.boot, 1, grant))
    assert _free(dec) == held and "forge" in dec.inbound and dec.inbound["forge"].reported == {}
    assert dec.abort(Abort("forge", "client went away"))
    assert _free(dec) == held  # the grant is out: its pages wait for stage 0's report (or the deadline)
    assert dec.kv_failed(KvFailed("forge", "dropped", "v4p", pre.boot, 0, grant)) is False  # failed already
    dec.stage_done(StageDone("forge", "v4p", 0, False, "never sent", boot=pre.boot, grant=grant))
    assert _free(dec) == (PAGES, RUNNING) and "forge" not in dec.inbound
    rows = [e for e in dec.events.since(0, 0.0).events if e.rid == "forge"]
    assert [(r.finished, r.reason, r.tokens) for r in rows] == [(True, "abort", [])]


def test_missing_stage_fails_at_the_deadline_naming_it(pair) -> None:  # type: ignore[no-untyped-def]
    _, dec = pair
    pages, _ = _prealloc(dec, "late", _prompt(9, 8), kv_timeout=0.05)
    assert _free(dec) == (PAGES - len(pages), RUNNING - 1)
    end = time.monotonic() + 20
    while "late" in dec.inbound and time.monotonic() < end:
        time.sleep(0.02)
    rows = [e for e in dec.events.since(0, 0.0).events if e.rid == "late"]
    assert len(rows) == 1 and rows[0].reason == "error"
    assert "prefill v4p stage(s) 0 did not report its KV by the deadline" in (rows[0].error or "")
    assert _free(dec) == (PAGES, RUNNING)


def test_kv_failed_frees_and_refusals_hold_nothing(pair, ckpt: Path) -> None:  # type: ignore[no-untyped-def]
    pre, dec = pair
    pages, grant = _prealloc(dec, "kvf", _prompt(30, 9))
    assert dec.kv_failed(KvFailed("kvf", "prefill dropped it", "v4p", pre.boot, 0, grant))
    assert _free(dec) == (PAGES, RUNNING)
    rows = [e for e in dec.events.since(0, 0.0).events if e.rid == "kvf"]
    assert [(r.reason, r.error) for r in rows] == [("error", "prefill dropped it")]
    with pytest.raises(ConfigError, match="penalties, logit_bias or min_tokens"):
        dec.prealloc(Prealloc("pen", [5, 6], SamplingParams(max_new_tokens=2, presence_penalty=0.5), "v4p", 1, 5.0))
    with pytest.raises(ConfigError, match="n 2"):
        dec.prealloc(Prealloc("two", [5, 6], SamplingParams(max_new_tokens=2, n=2), "v4p", 1, 5.0))
    with pytest.raises(IncompatiblePeer, match="stage\\(s\\) 0, 1 of 2 have not handshaken"):
        dec.prealloc(Prealloc("pp", [5, 6], GREEDY, "v4p", 2, 5.0))
    with pytest.raises(IncompatiblePeer, match="'other' stage\\(s\\) 0 of 1"):
        dec.prealloc(Prealloc("who", [5, 6], GREEDY, "other", 1, 5.0))
    assert _free(dec) == (PAGES, RUNNING) and dec.integrity() == "ok"
    _settled(pre, dec)


def test_a_gone_prefill_fails_its_requests_at_once(pair) -> None:  # type: ignore[no-untyped-def]
    pre, dec = pair
    ghost = f"127.0.0.1:{free_ports(1)}"  # nothing listens there: the prefill process is gone
    dec.handshake(Hello("ghost", 0, 1, ghost, pre.manifests[0], "ghostboot"))
    pages = dec.prealloc(Prealloc("orphan", _prompt(12, 4), GREEDY, "ghost", 1, 60.0)).pages
    assert _free(dec) == (PAGES - len(pages), RUNNING - 1)
    toks, reason, error = _events(dec, "orphan", timeout=20)
    assert (toks, reason) == ([], "error")
    assert error == f"prefill ghost stage 0 at {ghost} is gone (nothing listens there): its KV will not come"
    assert _free(dec) == (PAGES, RUNNING) and "orphan" not in dec.inbound and dec.integrity() == "ok"
