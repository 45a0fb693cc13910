"""Prefix-cache counters in the engine on the tiny checkpoint: a request that retries admission under memory
pressure is counted once (exact lookups and hit tokens), and a capped disk tier keeps outputs identical."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dsakv.engine.engine import Engine
from dsakv.engine.request import RequestOutput, SamplingParams
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.config import engine_config
from dsakv.testing.engines import flat_engine

PS = 4
SP = SamplingParams(max_new_tokens=3)
RNG = np.random.default_rng(11)
SYS = RNG.integers(2, 500, 44).tolist()  # 11 pages shared by every prompt
P0 = SYS + RNG.integers(2, 500, 5).tolist()  # warms the cache
P = [SYS + RNG.integers(2, 500, 17).tolist() for _ in range(3)]  # 61 tokens (+3) = 16 pages, 5 beyond SYS


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Any]:
    return load_model(make_tiny(tmp_path_factory.mktemp("hicache_adm") / "tiny", seed=0))


def _drain(eng: Engine) -> dict[str, RequestOutput]:
    final: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
    return final


def test_admission_retries_count_once(tiny: tuple[Any, Any]) -> None:
    """20 device pages: each of P1..P3 needs the 11 cached SYS pages + 5 own, so only one runs at a time and the
    next one matches SYS (a 44-token hit) and fails to reserve at every step the one before it runs (3 steps)."""
    eng = Engine(tiny, engine_config(page_size=PS, max_tokens=80, enable_prefix_cache=True), check_every_step=True)
    base = Engine(tiny, engine_config(page_size=PS, max_tokens=80))
    eng.generate([P0], SP)
    rids = [eng.add_request(p, SP) for p in P]
    final = _drain(eng)
    assert eng.stats().num_preemptions == 0
    assert [final[r].num_cached_tokens for r in rids] == [44, 44, 44]  # what each admission reused
    s = eng.cache_stats()
    assert s is not None
    assert (s["lookups"], s["lookup_tokens"], s["unadmitted_lookups"]) == (4, 48 + 3 * 60, 6)
    assert (s["device_hit_tokens"], s["hit_tokens"]) == (3 * 44, 3 * 44)
    assert s["hit_rate"] == round(132 / 228, 6)
    assert [list(final[r].output_ids) for r in rids] == [base.generate([p], SP)[0] for p in P]
    eng.check_integrity()


def test_capped_disk_tier_keeps_outputs_identical(tiny: tuple[Any, Any], tmp_path: Path) -> None:
    eng0 = Engine(tiny, engine_config(page_size=PS, max_tokens=80))
    want = [eng0.generate([p], SP)[0] for p in [P0, *P]]
    cap_pages = 14
    one = tmp_path / "probe"
    probe = Engine(tiny, engine_config(page_size=PS, max_tokens=80, hicache_disk_dir=one))
    assert probe.prefix_cache is not None
    file_bytes = probe.prefix_cache.disk.file_bytes  # type: ignore[attr-defined]
    kw: dict[str, Any] = {"hicache_disk_dir": tmp_path / "disk", "hicache_disk_size": cap_pages * file_bytes}
    for run in range(2):  # a second engine is a restarted server reading what the first left (capped)
        eng = flat_engine(tiny, page_size=PS, max_tokens=80, check_every_step=True, **kw)
        got = [eng.generate([p], SP)[0] for p in [P0, *P]]
        assert got == want
        s = eng.cache_stats()
        disk = eng.prefix_cache.disk  # type: ignore[union-attr]
        assert s is not None and disk.num_pages() <= cap_pages
        assert disk.disk_bytes() == disk.num_pages() * file_bytes == disk.used_bytes
        on_disk = disk.num_pages()
        if run == 0:
            # P0: 12 pages; each P: 15 whole pages (63 computed tokens, 11 shared), but a 15-page chain does not
            # fit in 14: its deepest page is not written rather than evict the chain's own pages: 3 more each
            assert (s["disk_write_pages"], s["disk_evicted_pages"]) == (12 + 3 * 3, 7)
            assert s["disk_evicted_bytes"] == 7 * file_bytes and on_disk == 14
        else:
            # left on disk: SYS (touched by every write of its chains, so most recent) + P3's 3 pages. P0 reads SYS
            # (its own 12th page was evicted), P1..P3 hit SYS on the device; each write evicts the LRU pages
            assert (s["disk_hit_tokens"], s["disk_read_pages"], s["device_hit_tokens"]) == (44, 11, 3 * 44)
            assert (s["disk_write_pages"], s["disk_evicted_pages"], on_disk) == (1 + 3 * 3, 10, 14)
