"""Prefix cache on a pipeline-parallel prefill worker (mooncake, in-process workers): prompts sharing a prefix,
sent one after another, hit stage 0's cache (exact hit tokens), every stage reuses the cached pages and still
transfers the full prompt to decode (exact bytes), tokens equal a colocated engine, and every stage's books
balance afterwards (free + held by requests + held by the cache == total; the mirror books stage 0's cache)."""

from __future__ import annotations

import time

import pytest
import torch

from dsakv.cache.allocator import IntegrityError
from dsakv.config import DecodeConfig, PrefillConfig, RouterConfig
from dsakv.disagg.decode.worker import DecodeWorker
from dsakv.disagg.prefill.worker import PrefillStage
from dsakv.disagg.protocol.messages import fetch_health
from dsakv.disagg.router.backend import RouterBackend
from dsakv.engine.request import SamplingParams
from dsakv.pipeline.page_mirror import PageMirror
from dsakv.testing.cluster import free_ports, role_config
from dsakv.testing.engines import flat_engine, tiny_model
from dsakv.util import ceil_div

pytestmark = [pytest.mark.timeout(180)]

ENGINE = dict(kv_format="fp32", index_format="fp32", page_size=16, num_pages=64)


def test_page_mirror_books_cached_pages():
    m = PageMirror(8, name="s1")
    m.set_cached([1, 2])
    m.hold("a", [1, 2, 3])
    m.hold("b", [1, 2, 4])
    m.check_integrity()  # cached pages may be shared by the requests that hit them
    assert (m.num_cached, m.num_used, m.num_free, m.cached) == (2, 4, 4, [1, 2])
    m.hold("c", [3])
    with pytest.raises(IntegrityError, match=r"page\(s\) \[3\] are held twice"):
        m.check_integrity()
    m.release("c")
    m.set_cached([])
    with pytest.raises(IntegrityError, match=r"page\(s\) \[1, 2\] are held twice"):
        m.check_integrity()
    with pytest.raises(IntegrityError, match="outside 0..7"):
        m.set_cached([8])


def _settle(stages: list[PrefillStage], timeout: float = 10.0) -> None:
    """Wait until stage 0 freed every request (all stages released) and the mirrors got its cache set."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s0 = stages[0]
        if s0.idle() and all(s.cached_pages() == s0.cached_pages() and s.idle() for s in stages[1:]):
            return
        time.sleep(0.05)
    raise AssertionError(f"prefill did not settle: {[s.health() for s in stages]}")


def _pipeline(num_pages: int, **kw) -> tuple[DecodeWorker, list[PrefillStage], RouterBackend]:
    dec = DecodeWorker(
        DecodeConfig(model="", config=role_config(ENGINE, "mooncake")), model=tiny_model("glm_moe_dsa")
    ).start()
    port = free_ports(3)
    stages = [
        PrefillStage(
            PrefillConfig(
                model="",
                config=role_config(
                    {"page_size": 16, "num_pages": num_pages, "enable_prefix_cache": True, **kw},
                    "mooncake",
                    {"pp_size": 2, "pp_rank": k, "partition": (7, 5), "stage_timeout": 60.0},
                ),
                port=port,
            ),
            model=tiny_model("glm_moe_dsa"),
        )
        for k in (0, 1)
    ]
    for s in stages:
        s.start()
    r = RouterBackend(RouterConfig(prefill=(stages[0].address,), decode=(dec.address,), health_interval=0.1))
    return dec, stages, r


def _run_one(r: RouterBackend, stages: list[PrefillStage], rid: str, prompt: list[int], sp: SamplingParams):
    """Send one request, wait for its tokens and for the prefill to settle; (tokens, stage 0 counters delta)."""
    before = stages[0].prefix_cache_stats()
    assert before is not None
    r.submit(rid, prompt, sp)
    toks = []
    for ev in r.events(rid, 30):
        toks += ev.new_token_ids
    _settle(stages)
    after = stages[0].prefix_cache_stats()
    assert after is not None
    return toks, {k: after[k] - before[k] for k in ("hit_tokens", "device_hit_tokens", "host_hit_tokens")}


def test_pp2_host_tier_write_back_replayed_on_every_stage():
    """12 pages per stage, host tier (ratio 1, write_back): p0's 2 cached pages are offloaded when a 170-token
    prompt needs 11 pages; p1 (same 32-token prefix) loads them back from the host on every stage."""
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(2, 512, (32,), generator=g).tolist()
    p0 = prefix + torch.randint(2, 512, (8,), generator=g).tolist()
    big = torch.randint(2, 512, (170,), generator=g).tolist()
    p1 = prefix + torch.randint(2, 512, (13,), generator=g).tolist()
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = flat_engine(tiny_model("glm_moe_dsa"), **ENGINE).generate([p0, big, p1], sp)
    dec, stages, r = _pipeline(12, hicache_ratio=1.0, hicache_write_policy="write_back")
    try:
        r.start()
        assert r.wait_ready(60), r.health()
        got, deltas = [], []
        for i, p in enumerate((p0, big, p1)):
            toks, d = _run_one(r, stages, f"h{i}", p, sp)
            got.append(toks)
            deltas.append(d)
        assert got == want
        assert deltas[2] == {"hit_tokens": 32, "device_hit_tokens": 0, "host_hit_tokens": 32}
        stats = stages[0].prefix_cache_stats()
        assert stats is not None
        assert stats["load_pages"] == 2 and stats["offload_pages"] >= 2
        replayed = stages[1].follower.replayed
        assert replayed.as_dict() == {"offload_pages": stats["offload_pages"], "load_pages": 2}
        pages = sum(ceil_div(len(p), 16) for p in (p0, big, p1))
        for s in stages:
            assert s.backend.stats.totals().bytes == pages * s.layout.bytes_per_page
        assert stages[1].cached_pages() == stages[0].cached_pages()
        assert [s.integrity() for s in stages] == ["ok", "ok"]
        cache, host_pool = stages[0].leader.cache, stages[1].follower.host_pool
        assert cache is not None and cache.host_alloc is not None and cache.host is not None
        assert host_pool is not None and host_pool.num_pages == cache.host.num_pages == 12
    finally:
        r.stop()
        for s in stages:
            s.stop()
        dec.stop()


def test_pp2_prefix_cache_hits_and_full_transfer():
    g = torch.Generator().manual_seed(11)
    prefix = torch.randint(2, 512, (32,), generator=g).tolist()
    tail = torch.randint(2, 512, (43,), generator=g).tolist()
    prompts = [prefix + tail[:8], prefix + tail[:13], prefix + tail, prefix + tail]  # 40, 45, 75, 75 tokens
    want_hits = [0, 32, 32, 64]  # p1, p2 reuse p0's 2 pages; p3 reuses p2's 4 whole pages
    sp = SamplingParams(max_new_tokens=4, ignore_eos=True)
    want = flat_engine(tiny_model("glm_moe_dsa"), **ENGINE).generate(prompts, sp)

    dec, stages, r = _pipeline(64)
    try:
        r.start()
        assert r.wait_ready(60), r.health()
        got, hits = [], []
        for i, p in enumerate(prompts):
            toks, delta = _run_one(r, stages, f"r{i}", p, sp)
            got.append(toks)
            hits.append(delta["hit_tokens"])
        assert got == want
        assert hits == want_hits
        stats = stages[0].prefix_cache_stats()
        assert stats is not None
        assert (stats["lookups"], stats["lookup_tokens"], stats["device_hit_tokens"]) == (4, 39 + 44 + 74 + 74, 128)
        assert stats["inserted_tokens"] == 64  # p0's 2 pages, then p2's pages 3 and 4
        # every stage moved the full prompt pages of its own layers, cache hits included
        pages = sum(ceil_div(len(p), 16) for p in prompts)
        for s in stages:
            assert s.backend.stats.totals().bytes == pages * s.layout.bytes_per_page
            assert s.counters["transferred"] == 4
        # books: 4 cached pages (p2's run), no request holds any; the mirror books the same set
        cached = stages[0].cached_pages()
        assert len(cached) == 4 and stages[1].cached_pages() == cached
        a, cache = stages[0].leader.engine.allocator, stages[0].leader.cache
        assert (a.num_free, a.num_used) == (60, 4)
        assert cache is not None and a.num_free + cache.cached_device_pages == 64
        m = stages[1].follower.mirror
        assert (m.num_free, m.num_used, m.num_cached, m.owners) == (60, 4, 4, [])
        health = [fetch_health(s.address) for s in stages]
        assert [h.integrity for h in health] == ["ok", "ok"]
        assert [h.cache_pages for h in health] == [4, 4]
        pc = health[0].prefix_cache
        assert pc is not None and pc["hit_tokens"] == 128 and health[1].prefix_cache is None
        assert [s.pages_used() for s in stages] == [4, 4] and dec.engine.stats().pages_used == 0
    finally:
        r.stop()
        for s in stages:
            s.stop()
        dec.stop()


def test_prefill_role_prefix_cache_options():
    import argparse

    from dsakv.cli.disagg_roles import prefill_cache_config
    from dsakv.errors import ConfigError

    base = dict.fromkeys(("hicache_ratio", "hicache_size", "hicache_disk_dir", "hicache_disk_size"), None)
    base |= {"prefix_cache": True, "hicache_layout": "page_first", "hicache_write_policy": "write_back"}
    base["hicache_selective_threshold"] = 2
    c = prefill_cache_config(argparse.Namespace(**{**base, "hicache_size": "1MiB"}))
    assert (c.prefix_cache, c.hicache_ratio, c.hicache_size, c.layout, c.write_policy) == (
        True,
        None,
        1 << 20,
        "page_first",
        "write_back",
    )
    assert (c.selective_threshold, c.storage, c.disk_dir, c.disk_size) == (2, None, None, None)
    with pytest.raises(ConfigError, match="--role prefill does not support --hicache-disk-dir"):
        prefill_cache_config(argparse.Namespace(**{**base, "hicache_ratio": 0.5, "hicache_disk_dir": "/tmp/x"}))
    # the shared storage tier: on a single-stage prefill only (its StorageConfig, as a colocated server gets it)
    mc = {"hicache_storage": "mooncake", "mooncake_master": "127.0.0.1:50051", "mooncake_metadata": None}
    mc |= {"mooncake_segment_size": "0", "mooncake_protocol": "tcp", "mooncake_device_names": ""}
    mc |= {"host": "127.0.0.1", "hicache_storage_timeout": 1.5, "hicache_ratio": 2.0}
    sc = prefill_cache_config(argparse.Namespace(**{**base, **mc, "pp_size": 1})).storage
    assert sc is not None
    assert (sc.backend, sc.master, sc.segment_bytes, sc.timeout) == ("mooncake", "127.0.0.1:50051", 0, 1.5)
    with pytest.raises(ConfigError, match=r"^--hicache-storage mooncake with --pp-size 2: .* use --pp-size 1 or drop"):
        prefill_cache_config(argparse.Namespace(**{**base, **mc, "pp_size": 2}))
    with pytest.raises(ConfigError, match="--role prefill does not support --hicache-storage file"):
        prefill_cache_config(argparse.Namespace(**{**base, "hicache_storage": "file", "pp_size": 1}))
