"""The shared L3 tier on a real Mooncake Store: one `dsakv store-master` process (mooncake_master + store memory,
loopback only) shared by the module. Stored bytes per page == the planner's figure, partial pages never hit,
foreign / forged / corrupt objects refused, fp32 outputs identical with L3 hits, a hit in another process and
after a restart, and (on a master of its own) a master killed mid-load or stalled: requests compute, then hits
resume when it is back."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mooncake.store")

from dsakv.cache.hicache import HiCache, HiCacheConfig  # noqa: E402
from dsakv.cache.storage.base import MAC_BYTES, META, META_MAGIC, chain_hashes, finish_checksum  # noqa: E402
from dsakv.cache.storage.master import MasterProcess, free_port  # noqa: E402
from dsakv.config import StorageConfig  # noqa: E402
from dsakv.engine.engine import Engine  # noqa: E402
from dsakv.engine.request import SamplingParams  # noqa: E402
from dsakv.errors import ConfigError  # noqa: E402
from dsakv.model.tiny import make_tiny  # noqa: E402
from dsakv.spec.layout import Kind, KVLayout  # noqa: E402
from dsakv.spec.presets import load_spec  # noqa: E402
from dsakv.testing.engines import flat_engine
from dsakv.testing.hicache import LAYOUT, PS, Harness  # noqa: E402
from dsakv.testing.hicache import expected_rows as _expected_rows  # noqa: E402
from dsakv.testing.hicache import toks as _toks  # noqa: E402
from dsakv.testing.logscan import watch  # noqa: E402
from dsakv.util.procs import die_with_parent  # noqa: E402

os.environ.setdefault("DSAKV_CACHE_DIR", tempfile.mkdtemp(prefix="dsakv-fp-"))
SP = SamplingParams(max_new_tokens=3)


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    """A `dsakv store-master` process on loopback; yields its --mooncake-master address."""
    yield from store_master()


def store_master() -> Iterator[str]:
    """Start `dsakv store-master` (128 MiB, loopback), yield its address, stop it (other modules' fixtures too)."""
    port = free_port()
    log = watch(Path(tempfile.mkdtemp(prefix="dsakv-store-")) / "store-master.log")  # scanned for tracebacks
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dsakv", "store-master", "--port", str(port), "--size", "128MiB"],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            preexec_fn=die_with_parent(),  # a killed test run takes the store (and its mooncake_master) with it
        )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until ready (or exit)
    assert "store master ready" in line, line
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def _cfg(master: str, **kw: Any) -> StorageConfig:
    """The store's config; a test not about the call deadline gets 30 s, not the default 2 s (ci26: on a busy box
    one first call took over 2 s, the cache skipped the store and wrote 12 pages of 24)."""
    kw.setdefault("timeout", 30.0)
    return StorageConfig(backend="mooncake", master=master, **kw)


def _raw(h: Harness) -> Any:
    """The store client under the harness's cache (to inspect and forge objects as another client would)."""
    return h.cache.storage._store  # type: ignore[union-attr]


def test_objects_hold_exactly_the_planner_bytes(store: str) -> None:
    a = _toks(11, 13)
    for elide in (True, False):
        layout = KVLayout(load_spec("tiny"), page_size=PS, elide=elide)
        from dsakv.cache.allocator import PageAllocator
        from dsakv.cache.device_pool import DevicePool

        c = HiCache(DevicePool(layout, 8), PageAllocator(8), HiCacheConfig(hicache_ratio=1.0, storage=_cfg(store)))
        ids = c.allocator.alloc(3)
        c.insert(np.asarray(a, dtype=np.int64), ids)
        c.allocator.free(ids)
        st = c.storage
        assert st is not None and c.stats.disk_write_pages == 3
        keys = [st.key(h) for h in st.page_hashes(a)]  # type: ignore[attr-defined]
        sizes = [st._store.get_size(k) for k in keys]  # type: ignore[attr-defined]
        metas = [st._store.get_size(k + ".meta") for k in keys]  # type: ignore[attr-defined]
        # the planner's figure: every layer's KV + INDEX_K of producer layers only (all layers without elision)
        spec = layout.spec
        kv = layout.bytes_per_token - sum(b.bytes_per_token for b in layout.buffers if b.key.kind is Kind.INDEX_K)
        owners = [b.key.layer for b in layout.buffers if b.key.kind is Kind.INDEX_K]
        assert owners == ([0, 1, 2, 6, 10] if elide else list(range(spec.num_layers)))
        assert sizes == [layout.bytes_per_token * PS] * 3 == [layout.bytes_per_page] * 3
        assert layout.bytes_per_token == kv + len(owners) * layout.buffers[1].bytes_per_token
        assert metas == [META.size] * 3
        c.close()


def test_partial_page_is_never_a_hit(store: str) -> None:
    a = _toks(12, 21)  # 5 pages
    h = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    h.run(a)
    st = h.cache.storage
    assert st is not None
    keys = [st.key(x) for x in st.page_hashes(a)]  # type: ignore[attr-defined]
    _raw(h).remove(keys[2] + ".meta", True)  # page 2: payload without its record (a writer died in between)
    _raw(h).remove(keys[4], True)  # page 4: record without its payload
    h2 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    assert h2.cache.storage is not None and h2.cache.storage.count_present(st.page_hashes(a)) == 2
    m = h2.run(a)  # bytes checked inside run()
    assert (m.disk_pages, m.num_tokens, h2.cache.stats.disk_hit_tokens) == (2, 8, 8)
    for c in (h.cache, h2.cache):
        c.close()


def test_foreign_layout_forged_and_corrupt_objects_are_refused(store: str) -> None:
    a = _toks(13, 17)  # 4 pages
    h = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    h.run(a)
    st = h.cache.storage
    assert st is not None
    hashes = st.page_hashes(a)
    keys = [st.key(x) for x in hashes]  # type: ignore[attr-defined]
    raw = _raw(h)
    # another layout (no elision) names other objects: nothing to load
    from dsakv.cache.allocator import PageAllocator
    from dsakv.cache.device_pool import DevicePool

    other = HiCache(
        DevicePool(KVLayout(load_spec("tiny"), page_size=PS, elide=False), 8),
        PageAllocator(8),
        HiCacheConfig(hicache_ratio=1.0, storage=_cfg(store)),
    )
    assert other.match_prefix(a).num_tokens == 0 and other.stats.disk_read_pages == 0
    other.close()
    # page 3: a payload of another size under its key; page 2: a record naming another layout; page 1: one
    # flipped payload byte (the record is genuine)
    raw.remove(keys[3], True)
    assert raw.put(keys[3], b"\0" * (LAYOUT.bytes_per_page + 8)) == 0
    raw.remove(keys[2] + ".meta", True)
    forged = META.pack(META_MAGIC, b"0123456789abcdef", hashes[2].encode(), LAYOUT.bytes_per_page, 0, bytes(32))
    assert raw.put(keys[2] + ".meta", forged) == 0
    good = bytearray(raw.get(keys[1]))
    good[100] ^= 0x10
    raw.remove(keys[1], True)
    assert raw.put(keys[1], bytes(good)) == 0
    h2 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    m = h2.run(a)  # page 0 loads, page 1 fails its checksum: 1 page hit, the rest computed (bytes checked)
    s = h2.cache.stats
    assert (m.disk_pages, s.disk_hit_tokens, s.storage_corrupt_pages) == (1, 4, 1)
    good[100] ^= 0x10
    assert raw.get(keys[1]) == bytes(good)  # the corrupt object was dropped, the recomputed page written back
    # page 1 was recomputed and written back; now page 2's foreign record is what stops the run
    h3 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    m = h3.run(a)
    assert (m.disk_pages, h3.cache.stats.storage_refused_pages) == (2, 1)
    for c in (h.cache, h2.cache, h3.cache):
        c.check_integrity()
        c.close()


def _resum(payload: bytes) -> int:
    """The plain word sum (page_checksum) of a payload, recomputed as a forger would."""
    w = np.frombuffer(payload + bytes(-len(payload) % 8), dtype=np.uint64)
    return finish_checksum(int(w.sum(dtype=np.uint64)), len(payload))


def _forge(raw: Any, key: str, payload: bytes, mac: bytes | None = None) -> None:
    """Objects written under a real page's key by a client without the secret: `payload`, and a record of the
    genuine identity with the plain checksum recomputed for it (and the genuine record's MAC, or `mac`)."""
    magic, lid, hh, nbytes, _, genuine = META.unpack(bytes(raw.get(key + ".meta")))
    raw.remove(key, True)
    raw.remove(key + ".meta", True)
    assert raw.put(key, payload) == 0
    assert raw.put(key + ".meta", META.pack(magic, lid, hh, nbytes, _resum(payload), mac or genuine)) == 0


def _swapped(payload: bytes) -> bytes:
    """Two different u64 words of `payload` exchanged: the same word sum, other bytes."""
    w = np.frombuffer(payload, dtype=np.uint64, count=len(payload) // 8).copy()
    j = next(j for j in range(1, w.size) if w[j] != w[0])
    w[0], w[j] = w[j], w[0]
    out = w.tobytes() + payload[8 * w.size :]
    assert out != payload and _resum(out) == _resum(payload)
    return out


def test_forged_objects_with_a_recomputed_checksum_are_refused(store: str) -> None:
    """A client of the master without the secret rewrites real pages' objects: page 1 with two words swapped,
    page 2 with a wholly other payload, each with its record's plain checksum recomputed (page 1 keeps the
    genuine MAC, page 2 a made-up one). Both are refused ("MAC mismatch"), counted as corrupt, dropped from the
    store, never loaded (the loaded rows are checked byte for byte), and the recomputed pages are written back."""
    a = _toks(21, 17)  # 4 pages
    h = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    h.run(a)
    st = h.cache.storage
    assert st is not None
    keys = [st.key(x) for x in st.page_hashes(a)]  # type: ignore[attr-defined]
    raw = _raw(h)
    genuine = [bytes(raw.get(k)) for k in keys]
    _forge(raw, keys[1], _swapped(genuine[1]))
    _forge(raw, keys[2], bytes(len(genuine[2])), mac=b"\x5a" * MAC_BYTES)
    for stage, (loaded, forged_at) in enumerate([(1, 1), (2, 2)]):
        h2 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
        m = h2.run(a)  # the rows loaded are the genuine ones (checked in run); the forged page stops the load
        s = h2.cache.stats
        assert (m.disk_pages, s.disk_hit_tokens, s.storage_corrupt_pages, s.storage_refused_pages) == (
            loaded,
            4 * loaded,
            1,
            0,
        ), stage
        assert bytes(raw.get(keys[forged_at])) == genuine[forged_at]  # dropped, then written back by the compute
        h2.cache.check_integrity()
        h2.cache.close()
    h3 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    assert h3.run(a).disk_pages == 4 and h3.cache.stats.storage_corrupt_pages == 0
    for c in (h.cache, h3.cache):
        c.close()


def test_pages_are_keyed_by_the_deployment_secret(store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another deployment's secret on the same master names other objects (its key id): it reads none of this
    one's pages and drops none; no secret at all is refused with the flag that gives one."""
    from dsakv.util.secret import SECRET_ENV, write_secret

    a = _toks(22, 13)  # 3 pages
    h = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    h.run(a)
    other = write_secret(tmp_path / "other.secret")
    h2 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store, secret_file=str(other)))
    assert h2.cache.storage is not None and h.cache.storage is not None
    assert h2.cache.storage.key(h2.cache.storage.page_hashes(a)[0]) != h.cache.storage.key(  # type: ignore[attr-defined]
        h.cache.storage.page_hashes(a)[0]
    )
    m = h2.run(a)
    assert (m.disk_pages, h2.cache.stats.storage_corrupt_pages, h2.cache.stats.disk_write_pages) == (0, 0, 3)
    h3 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    assert h3.run(a).disk_pages == 3 and h3.cache.stats.storage_corrupt_pages == 0
    monkeypatch.delenv(SECRET_ENV)
    with pytest.raises(ConfigError, match="--hicache-storage-secret-file PATH"):
        Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    loose = tmp_path / "loose.secret"
    write_secret(loose)
    loose.chmod(0o644)
    with pytest.raises(ConfigError, match=f"chmod 600 {loose}"):
        Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store, secret_file=str(loose)))
    for c in (h.cache, h2.cache, h3.cache):
        c.close()


def test_layout_needs_a_host_tier_and_a_reachable_master(store: str) -> None:
    with pytest.raises(ConfigError, match="host tier"):
        Harness(device_pages=8, storage=_cfg(store))
    dead = free_port()
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=f"127.0.0.1:{dead}"):
        Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(f"127.0.0.1:{dead}"))
    assert time.monotonic() - t0 < 10  # refused at once, not after the client's own ~90 s of retries
    with pytest.raises(ConfigError, match="HOST:PORT"):
        _cfg("nowhere")
        Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg("nowhere"))


# ---- the engine ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny(tmp_path_factory.mktemp("l3") / "tiny", seed=0)


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)
    return [rng.integers(2, 500, 49).tolist() for _ in range(2)]  # 48-token lookups: 12 pages each


def _engine(model: Any, **kw: Any) -> Engine:
    return flat_engine(model, page_size=PS, max_tokens=80, check_every_step=True, **kw)


def test_engine_l3_hits_identical_across_instances_and_restart(tiny_dir: Path, store: str) -> None:
    prompts = _prompts()
    plain = _engine(tiny_dir)
    base = [plain.generate([p], SP)[0] for p in prompts]
    kw = {"hicache_ratio": 2.0, "hicache_storage": _cfg(store)}
    a = _engine(tiny_dir, **kw)
    assert [a.generate([p], SP)[0] for p in prompts] == base
    s = a.cache_stats()
    assert s is not None and s["disk_write_pages"] == 24 and s["disk_hit_tokens"] == 0
    # another instance (its own process): every lookup page comes from the store
    argv = [sys.executable, "-m", "dsakv", "generate", "--model", str(tiny_dir), "--page-size", str(PS)]
    argv += ["--max-tokens", "80", "--max-new-tokens", "3", "--sequential", "--json", "--stats", "--threads", "1"]
    argv += ["--hicache-ratio", "2", "--hicache-storage", "mooncake", "--mooncake-master", store]
    for p in prompts:
        argv += ["--prompt-ids", ",".join(map(str, p))]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    assert [r["output_ids"] for r in json.loads(out.stdout)] == base
    stats = [json.loads(x) for x in out.stderr.splitlines() if x.startswith('{"prefix_cache"')][-1]["prefix_cache"]
    assert (stats["disk_hit_tokens"], stats["disk_read_pages"], stats["disk_write_pages"]) == (96, 24, 0)
    assert stats["storage_corrupt_pages"] == stats["storage_refused_pages"] == stats["storage_failures"] == 0
    # a restarted instance (this one's cache gone, the store kept the pages)
    assert a.prefix_cache is not None
    a.prefix_cache.close()  # type: ignore[attr-defined]
    b = _engine(tiny_dir, **kw)
    assert [b.generate([p], SP)[0] for p in prompts] == base
    s = b.cache_stats()
    assert s is not None and (s["disk_hit_tokens"], s["device_hit_tokens"]) == (96, 0)
    b.prefix_cache.close()  # type: ignore[union-attr]


def test_engine_forged_l3_objects_never_change_a_token(tiny_dir: Path, store: str) -> None:
    """Page 1 of each prompt rewritten in the store with two words swapped and the plain checksum recomputed:
    a restarted engine refuses both (counted), and its tokens, and the next restart's (every page a hit again),
    are exactly the no-tier run's."""
    rng = np.random.default_rng(23)
    prompts = [rng.integers(2, 500, 49).tolist() for _ in range(2)]
    base = [_engine(tiny_dir).generate([p], SP)[0] for p in prompts]
    kw = {"hicache_ratio": 2.0, "hicache_storage": _cfg(store)}
    a = _engine(tiny_dir, **kw)
    assert [a.generate([p], SP)[0] for p in prompts] == base
    st: Any = a.prefix_cache.storage  # type: ignore[union-attr]
    for p in prompts:
        key = st.key(st.page_hashes(p)[1])
        _forge(st._store, key, _swapped(bytes(st._store.get(key))))
    a.prefix_cache.close()  # type: ignore[union-attr]
    for corrupt, hits in [(2, 2 * 4), (0, 96)]:  # page 0 of each, then (rewritten genuine) all 12 of each
        b = _engine(tiny_dir, **kw)
        assert [b.generate([p], SP)[0] for p in prompts] == base
        s = b.cache_stats()
        assert s is not None and (s["storage_corrupt_pages"], s["disk_hit_tokens"]) == (corrupt, hits)
        b.prefix_cache.close()  # type: ignore[union-attr]


def test_master_killed_mid_load_then_back(tiny_dir: Path, tmp_path: Path) -> None:
    """A master of its own: killed between the existence query and the read, requests compute (same tokens, no
    error, counted); a stalled master (SIGSTOP) delays a request by at most the timeout; back -> hits resume."""
    master = MasterProcess(log_path=tmp_path / "master.log").start()
    try:
        cfg = _cfg(master.address, segment_bytes=32 << 20, timeout=1.0)  # this client holds the store memory
        prompts = _prompts()
        plain = _engine(tiny_dir)
        base = [plain.generate([p], SP)[0] for p in prompts]
        eng = _engine(tiny_dir, hicache_ratio=2.0, hicache_storage=cfg)
        cache: Any = eng.prefix_cache
        assert eng.generate([prompts[0]], SP)[0] == base[0]
        assert cache.stats.disk_write_pages == 12
        cache.clear()  # the next lookup must go to the store
        real_get = cache.storage.get

        def get_after_kill(*args: Any) -> Any:
            master.kill()
            return real_get(*args)

        cache.storage.get = get_after_kill
        assert eng.generate([prompts[0]], SP)[0] == base[0]  # computed: no client error
        cache.storage.get = real_get
        s = cache.stats
        assert s.disk_hit_tokens == 0 and s.storage_failures + s.storage_timeouts >= 1
        cache.clear()
        assert eng.generate([prompts[1]], SP)[0] == base[1]  # the store is down: computed, skipped or failed fast
        eng.check_integrity()
        master.start()  # back on the same ports: the client reconnects and remounts its memory
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            cache.clear()
            eng.generate([prompts[1]], SP)
            cache.clear()
            before = cache.stats.disk_hit_tokens
            assert eng.generate([prompts[1]], SP)[0] == base[1]
            if cache.stats.disk_hit_tokens - before == 48:
                break
            time.sleep(0.5)
        else:
            pytest.fail(f"no L3 hit within 30 s of the master's restart: {cache.stats}")
        # a stalled master: the request waits at most the timeout, then computes; the store is skipped until the
        # stuck call returns, and its reserved host pages come back afterwards
        cache.clear()
        os.kill(master.pid, signal.SIGSTOP)  # type: ignore[arg-type]
        try:
            t0 = time.monotonic()
            assert eng.generate([prompts[1]], SP)[0] == base[1]
            assert time.monotonic() - t0 < cfg.timeout + 5.0
            assert cache.stats.storage_timeouts >= 1
        finally:
            os.kill(master.pid, signal.SIGCONT)  # type: ignore[arg-type]
        deadline = time.monotonic() + 30
        while cache._quarantine and time.monotonic() < deadline:
            time.sleep(0.2)
            cache._reap()
        assert not cache._quarantine
        eng.check_integrity()
        cache.check_integrity()
        cache.close()
    finally:
        master.kill()


def test_store_holder_keeps_pages_after_the_writer_exits(store: str) -> None:
    """The writer's client is closed (a server exit): its pages stay in the store-master's memory."""
    a = _toks(14, 9)
    h = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    h.run(a)
    h.cache.close()
    h2 = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    m = h2.run(a)
    assert m.disk_pages == 2
    import torch

    from dsakv.cache.page_copy import gather_rows

    assert torch.equal(gather_rows(h2.dev, m.page_ids), _expected_rows(np.asarray(a[:8])))
    assert h2.cache.storage is not None
    assert chain_hashes(h2.cache.storage.layout_id, a, PS) == h2.cache.storage.page_hashes(a)
    h2.cache.close()


def test_write_policies_decide_when_pages_reach_the_store(store: str) -> None:
    a, b = _toks(15, 13), _toks(16, 13)  # 3 pages each; a device pool of 4 pages holds one of them
    wb = Harness(device_pages=4, hicache_ratio=2.0, write_policy="write_back", storage=_cfg(store))
    wb.run(a)
    assert wb.cache.stats.disk_write_pages == 0  # write_back: nothing stored while a is on the device
    wb.run(b)  # evicts a: backed up to the host, then to the store
    assert (wb.cache.stats.disk_write_pages, wb.cache.stats.device_evicted_pages) == (3, 3)
    sel = Harness(device_pages=8, hicache_ratio=2.0, write_policy="write_through_selective", storage=_cfg(store))
    sel.cache.policy.threshold = 1  # type: ignore[attr-defined]
    c = _toks(17, 13)
    sel.run(c)
    assert sel.cache.stats.disk_write_pages == 0  # not hit yet: cold runs never reach host or store
    sel.run(c)  # hit once: backed up to the host and stored
    assert sel.cache.stats.disk_write_pages == 3
    fresh = Harness(device_pages=8, hicache_ratio=2.0, storage=_cfg(store))
    assert [fresh.run(x).disk_pages for x in (a, b, c)] == [3, 0, 3]  # b is still only on wb's device
    for h in (wb, sel, fresh):
        h.cache.check_integrity()
        h.cache.close()


class _Copies:
    """A HostCopyObserver that records every copy it is told of, as plain lists."""

    def __init__(self) -> None:
        self.events: list[tuple[str, list[int], list[int]]] = []

    def on_offload(self, dev_ids: Any, host_ids: Any) -> None:
        self.events.append(("offload", np.asarray(dev_ids).tolist(), np.asarray(host_ids).tolist()))

    def on_load(self, host_ids: Any, dev_ids: Any) -> None:
        self.events.append(("load", np.asarray(host_ids).tolist(), np.asarray(dev_ids).tolist()))


def test_storage_hits_tell_the_observers_their_host_to_device_loads(store: str) -> None:
    a = _toks(14, 21)  # 5 whole pages + 1 token
    h = Harness(device_pages=8, hicache_ratio=1.0, storage=_cfg(store))
    h.run(a)
    st = h.cache.storage
    assert st is not None
    keys = [st.key(x) for x in st.page_hashes(a)]  # type: ignore[attr-defined]

    def fresh() -> tuple[Harness, _Copies]:
        c = Harness(device_pages=12, hicache_ratio=1.0, storage=_cfg(store))
        c.alloc.hold("another request", c.alloc.alloc(3))  # device pages 0-2 taken: the ids differ below
        seen = _Copies()
        c.cache.add_observer(seen)
        return c, seen

    h2, seen = fresh()
    m = h2.run(a)  # all 5 pages from the store, through host pages, onto the device (bytes checked in run())
    assert (m.disk_pages, m.host_pages, m.num_tokens) == (5, 0, 20)
    [node] = h2.cache.radix.match(a[:20])
    assert node.host is not None and node.device is not None
    assert seen.events == [("load", node.host.tolist(), node.device.tolist())]
    assert seen.events == [("load", [0, 1, 2, 3, 4], [3, 4, 5, 6, 7])]
    # a broken chain: page 2 has no record, so only the intact prefix (pages 0, 1) is read and told; the
    # recomputed pages 2-4 are then backed up (write-through) like any computed page
    _raw(h).remove(keys[2] + ".meta", True)
    h3, seen3 = fresh()
    m = h3.run(a)
    assert (m.disk_pages, m.num_tokens) == (2, 8)
    assert seen3.events == [("load", [0, 1], [3, 4]), ("offload", [5, 6, 7], [2, 3, 4])]
    for c in (h.cache, h2.cache, h3.cache):
        c.check_integrity()
        c.close()
