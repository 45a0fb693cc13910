"""How long a decode holds a request's pages (issue 26, finding 4): a prealloc may ask at most the decode's
--max-kv-timeout, and a prefill stage's REVOKE promise (KvSender.revoke) holds exactly: a revoked grant is never
written, and a grant whose write is running, or timed out and is in its quarantine, is reported in flight."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from dsakv.config import DecodeConfig, Timeouts
from dsakv.disagg.decode.worker import DecodeWorker
from dsakv.disagg.prefill.kv_sender import KvSender
from dsakv.disagg.prefill.stats import PrefillStats
from dsakv.disagg.protocol.lifecycle import StageJob
from dsakv.disagg.protocol.messages import Prealloc, Revoke
from dsakv.disagg.protocol.worker_service import Notifier
from dsakv.disagg.transfer.backends import make_backend
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.testing.cluster import role_config
from dsakv.testing.engines import tiny_model


def _job(rid: str, grant: bytes) -> StageJob:
    return StageJob(
        rid=rid, prompt_len=4, decode="127.0.0.1:1", decode_boot="db", dst_pages=[0], params=SamplingParams(),
        seed=0, grant=grant,
    )  # fmt: skip


@pytest.fixture
def sender():
    be = make_backend("local")
    notifier = Notifier(1.0, 0.5)
    links = SimpleNamespace(hello=SimpleNamespace(boot="stage-boot"))
    s = KvSender(
        backend=be, links=links, prefill="P", stage=1, timeouts=Timeouts(), notifier=notifier, stats=PrefillStats(),
        on_done=lambda job, ok: None,
    )  # fmt: skip
    yield s
    notifier.stop()
    be.close()


def test_a_revoked_grant_is_never_written(sender):
    r = sender.revoke(Revoke("a#1", b"grant-a"))
    assert (r.in_flight, r.boot) == (False, "stage-boot") and sender.is_revoked(b"grant-a")
    assert sender._begin_write(_job("a#1", b"grant-a")) == (
        "prefill stage 1: the decode revoked request a#1's pages (it gave up on it)"
    )
    assert not sender.is_revoked(b"grant-b")


def test_a_running_or_quarantined_write_is_in_flight(sender):
    job = _job("b#1", b"grant-b")
    assert sender._begin_write(job) is None
    assert sender.revoke(Revoke("b#1", b"grant-b")).in_flight  # running: no promise
    assert not sender.is_revoked(b"grant-b")
    sender._end_write(job, quarantine=600.0)  # it timed out: the engine may still write for the quarantine
    assert sender.revoke(Revoke("b#1", b"grant-b")).in_flight
    sender._end_write(job, quarantine=0.0)  # (a write that ended cleanly)
    assert not sender.revoke(Revoke("b#1", b"grant-b")).in_flight and sender.is_revoked(b"grant-b")


def test_prealloc_over_max_kv_timeout_is_refused():
    with pytest.raises(ConfigError, match=r"--max-kv-timeout 4000.0 must be in \(0, 3600\] seconds"):
        DecodeConfig(model="", max_kv_timeout=4000.0)
    engine = dict(kv_format="fp32", index_format="fp32", page_size=16, num_pages=16)
    dec = DecodeWorker(
        DecodeConfig(model="", config=role_config(engine), max_kv_timeout=60.0), tiny_model("glm_moe_dsa")
    )
    try:
        with pytest.raises(ConfigError, match="asks its pages be held 61s for its KV, more than this decode's "
                           "--max-kv-timeout 60s: lower the router's --kv-timeout"):  # fmt: skip
            dec.prealloc(Prealloc("r", [3, 4, 5], SamplingParams(), "P", 1, kv_timeout=61.0))
        assert dec.engine.stats().pages_used == 0 and len(dec.inbound) == 0
    finally:
        dec.backend.close()
