"""The HTTP fuzz corpus of the colocated server (dsakv.testing.http_fuzz, same seed) through the disaggregated
router: its HTTP app in front of a decode and a PP=1 prefill (real processes over mooncake). 0 5xx, every error an
OpenAI error body; afterwards no page held, nothing in flight or queued, the router's ledger empty, 0 server
errors in /metrics, and a normal request returns the same tokens as before."""

from __future__ import annotations

import httpx
import pytest

from dsakv.disagg.router.backend import RouterBackend
from dsakv.serve.app import create_app
from dsakv.serve.tokenizer import ByteTokenizer
from dsakv.testing.cluster import NUM_PAGES, Cluster, assert_clean, wait_for
from dsakv.testing.engines import tiny_path
from dsakv.testing.http_fuzz import LIMITS, MAX_SECONDS, fuzz, reference
from dsakv.testing.servers import MODEL, LiveServer, scrape

pytestmark = [pytest.mark.timeout(400)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path_factory.mktemp("fuzz-router"))
    srv = None
    try:
        dec = cluster.decode("decode", "mooncake", True)
        (pre,) = cluster.prefill("pre", "mooncake", True, (12,))
        cluster.wait_healthy([dec, pre], timeout=180)
        router = cluster.router([pre.addr], [dec.addr])
        assert router.wait_ready(60), router.health()
        srv = LiveServer(create_app(router, MODEL, ByteTokenizer(), limits=LIMITS)).start()
        yield srv, router, dec.addr
    finally:
        if srv is not None:
            srv.stop()
        cluster.close()


def _idle(url: str, router: RouterBackend) -> bool:
    h = httpx.get(f"{url}/health", timeout=10).json()
    return h["pages_used"] == 0 and h["in_flight"] == 0 and h["queued"] == 0 and len(router.book.ledger) == 0


def test_fuzz_through_the_router_no_5xx_and_back_to_baseline(server):
    srv, router, decode = server
    url = srv.url
    want = reference(url)
    before = scrape(url)
    statuses, n = fuzz(url)
    assert n >= 50, f"only {n} cases in {MAX_SECONDS} s"
    assert sum(v for k, v in statuses.items() if k >= 400) > n // 2, statuses
    wait_for(lambda: _idle(url, router), 60, "the router idle")
    h = httpx.get(f"{url}/health", timeout=10).json()
    assert h["ok"] and h["pages_total"] == NUM_PAGES and h["error"] is None
    assert_clean([decode])
    m = scrape(url)
    assert m["dsakv_http_server_errors_total"] == before["dsakv_http_server_errors_total"] == 0
    assert m["dsakv_requests_running"] == 0
    assert router.counters["dispatch_errors_total"] == router.counters["event_errors_total"] == 0
    assert reference(url) == want
    print(f"fuzz through the router: {n} cases, statuses {dict(sorted(statuses.items()))}")
