"""DeepSeek-V4 prefixes on the L3 tier: a real `dsakv store-master` (mooncake_master + store memory, loopback)
shared by the module, and the page-file disk tier. A stored page holds each paged kind only on the layers that
read it, the boundary state is one object of its own; a hit in a fresh engine == no hit (tokens); forged objects
(the record's word sum recomputed) fail the page MAC of cache/storage, are dropped, and the prompt computes."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("mooncake.store")

from dsakv.cache.storage.base import MAC_BYTES, META, finish_checksum  # noqa: E402
from dsakv.cache.storage.master import free_port  # noqa: E402
from dsakv.cache.v4_storage import V4StoredLayout  # noqa: E402
from dsakv.config import StorageConfig  # noqa: E402
from dsakv.engine.v4_engine import V4Engine  # noqa: E402
from dsakv.errors import ConfigError  # noqa: E402
from dsakv.model.deepseek_v4 import DeepseekV4, load_v4  # noqa: E402
from dsakv.model.deepseek_v4_tiny import make_tiny_v4  # noqa: E402
from dsakv.spec.layout import Kind  # noqa: E402
from dsakv.spec.v4 import CSA, HCA, WINDOW  # noqa: E402
from dsakv.util.procs import die_with_parent  # noqa: E402

NEW = 3


@pytest.fixture(scope="module")
def store() -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "dsakv", "store-master", "--port", str(port), "--size", "64MiB"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=die_with_parent(),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # blocks until ready (or exit)
    assert "store master ready" in line, line
    yield f"127.0.0.1:{port}"
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DeepseekV4:
    return load_v4(make_tiny_v4(tmp_path_factory.mktemp("v4l3") / "flash", "flash"))


def _toks(seed: int, n: int) -> list[int]:
    return torch.randint(2, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _engine(model: DeepseekV4, storage: StorageConfig | None, **kw: Any) -> V4Engine:
    return V4Engine(model, num_pages=32, max_running=2, chunk_size=7, max_batch_tokens=20, prefix_cache=True,
                    storage=storage, **kw)  # fmt: skip


def _mooncake(master: str) -> StorageConfig:
    return StorageConfig(backend="mooncake", master=master)


def _workload(seed: int) -> tuple[list[int], list[list[int]]]:
    """A 40-token prompt (boundary 32: 2 pages of 16) and prompts after it: 2 share its boundary, 1 only page 0."""
    base = _toks(seed, 40)
    return base, [base[:33] + _toks(seed + 1, 3), base + _toks(seed + 2, 2), base[:20] + _toks(seed + 3, 9)]


def _plain(model: DeepseekV4, prompts: list[list[int]]) -> list[list[int]]:
    eng = V4Engine(model, num_pages=32, max_running=1, chunk_size=7, max_batch_tokens=20)
    return [r.output for p in prompts for r in eng.generate([p], NEW)]


def test_objects_hold_each_kind_only_where_read(model: DeepseekV4, store: str) -> None:
    """Page objects: CSA_KV + CSA_INDEX_K of the CSA layers and HCA_KV of the HCA layers, nothing of the two
    window-only layers, byte for byte the pool's pages; the state object: every layer's window ring + the
    compressor states at the boundary, byte for byte the slot at the snapshot."""
    spec = model.spec
    assert spec.layer_types == (WINDOW, WINDOW, CSA, HCA, CSA, HCA)
    eng = _engine(model, _mooncake(store))
    base, _ = _workload(1)
    eng.generate([base], NEW)
    lay, l3 = eng.layout, eng.l3
    assert l3 is not None and l3.stats.l3_page_writes == 2 and l3.stats.l3_state_writes == 1
    # per page of 16 tokens (fp32 tiny: KV entry 128 B, index-K entry 64 B): 2 CSA layers x (4 x 128 + 4 x 64)
    # + 2 HCA layers x 1 x 128
    by_kind = {k: sum(b.page_bytes for b in lay.paged if b.key.kind is k) for k in Kind}
    assert {k: v for k, v in by_kind.items() if v} == {Kind.CSA_KV: 1024, Kind.CSA_INDEX_K: 512, Kind.HCA_KV: 256}
    assert {b.key.layer for b in lay.paged} == {2, 3, 4, 5}
    assert lay.bytes_per_page == 1792 and V4StoredLayout(lay).bytes_per_page == 1792
    # state: windows 6 x 8 x 128, CSA 2 x 8 x 512, CSA indexer 2 x 8 x 256, HCA online 2 x 3 x 128
    assert lay.state_bytes_per_request == 6144 + 8192 + 4096 + 768 == V4StoredLayout(lay, "state").bytes_per_page
    hs = l3.hashes(base, 2)
    raw = l3.pages._store  # type: ignore[attr-defined]
    ids, snap = eng._cache[tuple(base[:32])]
    for i, h in enumerate(hs):
        key = l3.pages.key(h)  # type: ignore[attr-defined]
        assert raw.get_size(key) == 1792 and raw.get_size(key + ".meta") == META.size
        want = b"".join(eng.pool.paged(b.key)[int(ids[i])].numpy().tobytes() for b in lay.paged)
        assert bytes(raw.get(key)) == want
    skey = l3.states.key(hs[1])  # type: ignore[attr-defined]
    assert raw.get_size(skey) == 19200
    assert bytes(raw.get(skey)) == b"".join(snap[s.key].numpy().tobytes() for s in lay.states)
    assert raw.get_size(l3.states.key(hs[0])) < 0  # type: ignore[attr-defined]  # no state at page 1's boundary
    eng.close()


def test_hit_in_a_fresh_engine_equals_no_hit(model: DeepseekV4, store: str) -> None:
    base, then = _workload(3)
    want = _plain(model, [base, *then])
    first = _engine(model, _mooncake(store))
    got = [r.output for r in first.generate([base], NEW)]
    first.close()
    fresh = _engine(model, _mooncake(store))  # another store client, empty device cache
    got += [r.output for p in then for r in fresh.generate([p], NEW)]
    assert got == want
    assert fresh.l3 is not None
    # then[0] loads 2 pages + the state from L3; then[1] hits them on the device; then[2]: page 0 is stored but
    # no state at token 16, so it computes (and stores its own boundary)
    assert (fresh.l3.stats.l3_hits, fresh.l3.stats.l3_hit_tokens, fresh.stats.hits) == (1, 32, 1)
    assert fresh.l3.stats.l3_refused == fresh.l3.stats.l3_errors == 0
    fresh.check_integrity()
    fresh.close()


def _resum(payload: bytes) -> int:
    w = np.frombuffer(payload + bytes(-len(payload) % 8), dtype=np.uint64)
    return finish_checksum(int(w.sum(dtype=np.uint64)), len(payload))


def _forge(raw: Any, key: str, payload: bytes, mac: bytes | None = None) -> None:
    """Rewrite an object as a client without the secret: `payload`, its record's word sum recomputed."""
    magic, lid, hh, nbytes, _, genuine = META.unpack(bytes(raw.get(key + ".meta")))
    raw.remove(key, True)
    raw.remove(key + ".meta", True)
    assert raw.put(key, payload) == 0
    assert raw.put(key + ".meta", META.pack(magic, lid, hh, nbytes, _resum(payload), mac or genuine)) == 0


def test_forged_pages_and_states_fail_the_mac(model: DeepseekV4, store: str) -> None:
    base, then = _workload(5)
    want = _plain(model, [then[0]])
    first = _engine(model, _mooncake(store))
    first.generate([base], NEW)
    assert first.l3 is not None
    hs = first.l3.hashes(base, 2)
    raw = first.l3.pages._store  # type: ignore[attr-defined]
    pkey, skey = first.l3.pages.key(hs[1]), first.l3.states.key(hs[1])  # type: ignore[attr-defined]
    genuine = {k: bytes(raw.get(k)) for k in (pkey, skey)}
    for key, forged, mac in [(pkey, bytes(1792), None), (skey, bytes(reversed(genuine[skey])), b"\x5a" * MAC_BYTES)]:
        _forge(raw, key, forged, mac)
        eng = _engine(model, _mooncake(store))
        assert eng.l3 is not None and eng.l3.lookup(then[0], 2) == 2  # present: only the read tells
        assert [r.output for r in eng.generate([then[0]], NEW)] == want
        assert (eng.l3.stats.l3_hits, eng.l3.stats.l3_refused) == (0, 1)
        assert eng.l3.last_refusal.endswith("MAC mismatch"), eng.l3.last_refusal
        assert eng.l3.last_refusal.startswith("page 1" if key == pkey else "state")
        assert bytes(raw.get(key)) == genuine[key]  # dropped, then written back by the compute's snapshot
        eng.check_integrity()
        eng.close()
    first.close()  # its store client forged the objects


def test_disk_tier_hit_equals_no_hit(model: DeepseekV4, tmp_path: Path) -> None:
    base, then = _workload(7)
    want = _plain(model, [base, then[1]])
    disk = StorageConfig(backend="file", dir=str(tmp_path / "l3"))
    first = _engine(model, disk)
    got = [r.output for r in first.generate([base], NEW)]
    fresh = _engine(model, disk)
    got += [r.output for r in fresh.generate([then[1]], NEW)]
    assert got == want and fresh.l3 is not None and fresh.l3.stats.l3_hit_tokens == 32
    files = sorted(p.stat().st_size for p in (tmp_path / "l3").rglob("*.page"))
    assert files == [META.size + 1792] * 2 + [META.size + 19200]
    with pytest.raises(ConfigError, match="turn the prefix cache on too"):
        V4Engine(model, num_pages=8, max_running=1, storage=disk)
