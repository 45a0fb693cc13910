"""The backend contract on the in-process backend: registration, boundary checks, deadlines, metrics.

Failure mode 2 (a refused registration whose return value is ignored) and failure mode 1 (a
zero-length block handed to the engine) are refused here, before any engine sees them.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dsakv.cache.device_pool import DevicePool, Region  # noqa: E402
from dsakv.disagg.transfer import (  # noqa: E402
    BackendMeta,
    Blocks,
    Manifest,
    RegistrationError,
    TransferError,
    TransferPlan,
    TransferStatus,
    TransferTimeout,
    check_pair,
    deadline_in,
    make_backend,
)
from dsakv.disagg.transfer.backends import LocalBackend  # noqa: E402
from dsakv.errors import ConfigError  # noqa: E402
from dsakv.spec import BufferKey, Kind, KVLayout, load_spec  # noqa: E402
from dsakv.testing.peer_process import fill_random, page_checksums  # noqa: E402

KV, IK = Kind.KV, Kind.INDEX_K


def worker(layout: KVLayout, pages: int, name: str, seed: int | None = None, **opts):
    pool = DevicePool(layout, pages)
    if seed is not None:
        fill_random(pool, seed)
    be = make_backend("local", **opts)
    be.register(pool.regions())
    return pool, be, Manifest.from_pool(pool, be.meta(), name)


@pytest.fixture
def tiny():
    return load_spec("tiny")


def test_transfer_moves_exact_bytes_and_counts_metrics(tiny) -> None:
    src_pool, sb, sm = worker(KVLayout(tiny, 4, 12), 6, "pp1", seed=3)
    dst_pool, db, dm = worker(KVLayout(tiny), 10, "decode")
    pairing = check_pair(sm, dm)
    peer = sb.connect(dm)
    src, dst = np.array([5, 0, 1, 2]), np.array([9, 3, 4, 5])
    plan = TransferPlan.build(pairing.pairs, src, dst)
    m = sb.transfer(peer, plan.blocks, deadline_in(5))
    # layers 4..11: 8 KV (100 B/token) + index-K of producers 6 and 10 (36 B/token), 64-token pages
    assert m.nbytes == plan.nbytes == 4 * 64 * (8 * 100 + 2 * 36)
    assert (m.blocks, m.batches, m.ok) == (plan.num_blocks, 1, True) and plan.num_runs == 2
    keys = [p.key for p in pairing.pairs]
    assert page_checksums(dst_pool, dst, keys) == page_checksums(src_pool, src, keys)
    untouched = np.setdiff1d(np.arange(10), dst)
    assert all(int(dst_pool.tensor(k)[untouched].count_nonzero()) == 0 for k in dst_pool.keys)
    assert all(int(dst_pool.tensor(BufferKey(i, KV)).count_nonzero()) == 0 for i in range(4))  # not the sender's
    t = sb.stats.totals()
    assert (t.transfers, t.failures, t.bytes, t.blocks) == (1, 0, m.nbytes, m.blocks)


def test_zero_length_registration_refused_before_engine(tiny) -> None:
    be = LocalBackend()
    buf = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(RegistrationError, match="= 0 bytes: a zero-length registration is refused before"):
        be.register({"a": Region(buf.data_ptr(), 1024, 1), "b": Region(buf.data_ptr() + 1024, 1024, 0)})
    assert be.registered == {}


def test_refused_registration_leaves_nothing_registered(tiny) -> None:
    be = LocalBackend()
    buf = torch.zeros(8192, dtype=torch.uint8)
    a = buf.data_ptr()
    regions = {"a": Region(a, 1024, 2), "b": Region(a + 2048, 1024, 2), "c": Region(a + 1024, 1024, 2)}
    with pytest.raises(RegistrationError) as e:
        be.register(regions)  # "c" overlaps "a": the engine refuses it with -7
    assert e.value.code == -7 and "unregistered the 2 region(s) this call had registered" in str(e.value)
    assert be.registered == {} and be._engine_spans == {}
    be.register({"a": regions["a"], "b": regions["b"]})  # the same regions register cleanly afterwards
    assert sorted(be.registered) == ["a", "b"]


def test_meta_before_register_and_unknown_backend() -> None:
    with pytest.raises(TransferError, match="meta\\(\\) before register\\(\\)"):
        LocalBackend().meta()
    with pytest.raises(ConfigError, match="unknown transfer backend 'rdma-magic': choose one of local, mooncake, nixl"):
        make_backend("rdma-magic")


def test_boundary_refuses_zero_length_unregistered_and_foreign_blocks(tiny) -> None:
    src_pool, sb, sm = worker(KVLayout(tiny), 4, "a", seed=1)
    dst_pool, db, dm = worker(KVLayout(tiny), 4, "b")
    peer = sb.connect(dm)
    s = src_pool.regions()[BufferKey(0, KV)]
    d = dst_pool.regions()[BufferKey(0, KV)]
    with pytest.raises(TransferError, match="block\\(s\\) of length <= 0"):
        sb.submit(peer, Blocks.of([s.addr], [d.addr], [0]), deadline_in(5))
    stray = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransferError, match="source block #0 .* outside every region registered with this backend"):
        sb.submit(peer, Blocks.of([stray.data_ptr()], [d.addr], [4096]), deadline_in(5))
    with pytest.raises(TransferError, match="destination block #1 .* outside every region of b's manifest"):
        sb.submit(peer, Blocks.of([s.addr, s.addr], [d.addr, d.addr + d.nbytes - 8], [64, 64]), deadline_in(5))
    assert sb.stats.totals().transfers == 0  # nothing was submitted
    assert int(dst_pool.tensor(BufferKey(0, KV)).count_nonzero()) == 0


def test_deadline_cancels_and_destination_stays_untouched(tiny) -> None:
    # the transfer would land 3 s in, its deadline is at 0.2 s: the wait ends between the two (a wide window, so a
    # loaded machine that schedules this thread late still tells the deadline from the completion)
    src_pool, sb, sm = worker(KVLayout(tiny), 4, "a", seed=2, latency_s=3.0)
    dst_pool, db, dm = worker(KVLayout(tiny), 4, "b")
    plan = TransferPlan.build(check_pair(sm, dm).pairs, [0, 1], [2, 3])
    peer = sb.connect(dm)
    t0 = time.monotonic()
    h = sb.submit(peer, plan.blocks, deadline_in(0.2))
    assert sb.poll(h) is TransferStatus.PENDING
    with pytest.raises(TransferTimeout, match="unfinished at its deadline"):
        sb.wait(h)
    assert 0.2 <= time.monotonic() - t0 < 3.0
    assert h.status is TransferStatus.FAILED
    time.sleep(0.4)
    assert sb.poll(h) is TransferStatus.FAILED
    assert sum(int(dst_pool.tensor(k).count_nonzero()) for k in dst_pool.keys) == 0
    t = sb.stats.totals()
    assert (t.transfers, t.failures, t.bytes) == (1, 1, 0)
    # the same transfer with room to finish succeeds
    m = sb.transfer(peer, plan.blocks, deadline_in(5))
    assert m.ok and m.seconds >= 3.0
    keys = [p.key for p in check_pair(sm, dm).pairs]
    assert page_checksums(dst_pool, np.array([2, 3]), keys) == page_checksums(src_pool, np.array([0, 1]), keys)
    assert sum(int(dst_pool.tensor(k)[[0, 1]].count_nonzero()) for k in dst_pool.keys) == 0
    t = sb.stats.totals()
    assert (t.transfers, t.failures, t.bytes) == (2, 1, m.nbytes)


def test_closed_peer_fails_and_backend_mismatch_is_refused(tiny) -> None:
    src_pool, sb, sm = worker(KVLayout(tiny), 4, "a", seed=2)
    dst_pool, db, dm = worker(KVLayout(tiny), 4, "b")
    peer = sb.connect(dm)
    plan = TransferPlan.build(check_pair(sm, dm).pairs, [0], [1])
    db.close()
    with pytest.raises(TransferError, match="peer .* is gone") as e:
        sb.transfer(peer, plan.blocks, deadline_in(5))
    assert e.value.code == -1
    with pytest.raises(TransferError, match="is gone"):
        sb.connect(dm)
    foreign = dataclasses.replace(dm, backend_meta=BackendMeta("nixl", b"agent"))
    with pytest.raises(TransferError, match="uses transfer backend 'nixl'; both peers must use the same"):
        sb.connect(foreign)


def test_mooncake_batch_limit_follows_both_env_vars(monkeypatch) -> None:
    from dsakv.disagg.transfer.backends import mooncake_batch_limit

    monkeypatch.delenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", raising=False)
    monkeypatch.delenv("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", raising=False)
    assert mooncake_batch_limit() == 1024
    monkeypatch.setenv("MC_TCP_MAX_QUEUED_TRANSFERS_PER_PEER", "8192")
    assert mooncake_batch_limit() == 1024  # one raised is not enough
    monkeypatch.setenv("MC_TCP_MAX_PENDING_ADMISSIONS_PER_PEER", "4096")
    assert mooncake_batch_limit() == 4096
