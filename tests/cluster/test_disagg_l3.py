"""Two prefill instances (`dsakv serve --role prefill --pp-size 1`, real processes) on one shared L3 tier (a real
`dsakv store-master`), one decode, a router per prefill (so which prefill computes is certain, not left to the
router's prefix affinity). Prefill A computes a 50-token prompt and writes its 3 whole pages to the store;
prefill B, which never saw the prompt, gets exactly those 48 tokens from the store (no device or host hit) and
computes only the last 2. Tokens equal a colocated engine both times, and every instance's books balance."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("mooncake.store")

from test_hicache_storage import store_master  # noqa: E402

from dsakv.disagg.protocol.messages import fetch_health  # noqa: E402
from dsakv.engine.engine import Engine  # noqa: E402
from dsakv.engine.request import SamplingParams  # noqa: E402
from dsakv.testing.cluster import NUM_PAGES, PAGE_SIZE, Cluster, assert_clean, run_requests, wait_for  # noqa: E402
from dsakv.testing.config import engine_config
from dsakv.testing.engines import tiny_model, tiny_path  # noqa: E402

pytestmark = [pytest.mark.timeout(300)]

GREEDY = SamplingParams(max_new_tokens=4, ignore_eos=True)


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    yield from store_master()


def _cache(addr: str) -> dict[str, Any]:
    c = fetch_health(addr, timeout=3.0).prefix_cache
    assert c is not None, f"{addr}: no prefix cache in its health"
    return c


def _held_by_requests(addr: str) -> tuple[int, int, str]:
    h = fetch_health(addr, timeout=3.0)
    return h.pages_used - (h.cache_pages or 0), h.jobs or 0, h.integrity


def test_second_prefill_hits_what_the_first_stored(tmp_path, store: str) -> None:
    prompt = torch.randint(2, 512, (50,), generator=torch.Generator().manual_seed(15)).tolist()  # 3 pages + 2
    eng = Engine(
        tiny_model("glm_moe_dsa"), engine_config(page_size=PAGE_SIZE, num_pages=NUM_PAGES, max_batch_tokens=256)
    )
    want = eng.generate([prompt], GREEDY)[0]

    l3 = ["--hicache-ratio", "2", "--hicache-storage", "mooncake", "--mooncake-master", store]
    cluster = Cluster(tiny_path("glm_moe_dsa"), tmp_path)
    try:
        dec = cluster.decode("d", "mooncake", True)
        pa, pb = (cluster.prefill(n, "mooncake", True, (12,), extra=l3)[0] for n in ("pa", "pb"))
        cluster.wait_healthy([dec, pa, pb], timeout=180)
        ra, rb = cluster.router([pa.addr], [dec.addr]), cluster.router([pb.addr], [dec.addr])
        assert ra.wait_ready(60) and rb.wait_ready(60), (ra.health(), rb.health())

        assert run_requests(ra, [prompt], GREEDY, "l3-a") == [(want, "length", None)]
        # A's write-through puts the prompt's 3 whole pages into the store when its request releases the pages
        wait_for(lambda: _cache(pa.addr)["disk_write_pages"] == 3, 20, "prefill A stored 3 pages", cluster.procs)
        a = _cache(pa.addr)
        assert (a["storage_hit_tokens"], a["hit_tokens"], a["storage_failures"]) == (0, 0, 0), a

        assert run_requests(rb, [prompt], GREEDY, "l3-b") == [(want, "length", None)]
        b = _cache(pb.addr)
        assert (b["storage_hit_tokens"], b["disk_read_pages"], b["hit_tokens"]) == (48, 3, 48), b
        assert (b["device_hit_tokens"], b["host_hit_tokens"], b["disk_write_pages"]) == (0, 0, 0), b
        assert b["storage_corrupt_pages"] == b["storage_refused_pages"] == b["storage_failures"] == 0, b
        assert fetch_health(pb.addr).counters["submitted"] == fetch_health(pa.addr).counters["submitted"] == 1

        assert_clean([dec.addr], procs=cluster.procs)
        for p in (pa, pb):  # the prefix cache keeps its pages; no request holds one
            wait_for(lambda p=p: _held_by_requests(p.addr) == (0, 0, "ok"), 20, f"{p.name} settled", cluster.procs)
    finally:
        cluster.close()
