"""Seeded fuzz over the live HTTP API of the colocated server (the corpus: dsakv.testing.http_fuzz). Asserts no
response is a 5xx, every error has an OpenAI error body, and afterwards the server is back to baseline: no page
used, nothing running, /metrics counts 0 server errors, and a normal request still returns the same tokens as
before. tests/cluster/test_serve_fuzz_router.py sends the same corpus through the disaggregated router."""

from __future__ import annotations

import pytest

from dsakv.testing.http_fuzz import LIMITS, MAX_SECONDS, fuzz, reference
from dsakv.testing.servers import NUM_PAGES, live_server, make_engine, scrape, wait_idle


@pytest.fixture(scope="module")
def server():
    with live_server(make_engine(), limits=LIMITS) as (srv, _backend):
        yield srv


def test_fuzz_http_api_no_5xx_and_back_to_baseline(server):
    url = server.url
    want = reference(url)
    before = scrape(url)
    statuses, n = fuzz(url)
    assert n >= 50, f"only {n} cases in {MAX_SECONDS} s"
    assert sum(v for k, v in statuses.items() if k >= 400) > n // 2, statuses  # mostly refusals: the fuzz bites
    h = wait_idle(url, timeout=30)
    assert h["pages_used"] == 0 and h["pages_free"] == NUM_PAGES and h["running"] == 0
    m = scrape(url)
    assert m["dsakv_http_server_errors_total"] == before["dsakv_http_server_errors_total"] == 0
    assert m["dsakv_requests_running"] == 0
    assert reference(url) == want
    print(f"fuzz: {n} cases, statuses {dict(sorted(statuses.items()))}")
