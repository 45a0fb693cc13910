"""DeepSeek-V4 PD over both real engines: a PP 2 prefill (stages 0-2 and 3-5 of the tiny model, each on its own
V4Pool and its own mooncake / nixl engine) sends every paged kind and the per-request state slot, as keyed
regions of V4 manifests, to a decode V4Engine in another process. Tokens == colocated V4Engine, bytes per
(prefill stage, decode) pair == pages x the pair's bytes per page + its state bytes, every key's bytes land
intact, and a decode of another page size or format is refused at the handshake naming the kind."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from dsakv.config import LOOPBACK_UCX_ENV  # noqa: E402
from dsakv.disagg.protocol.errors import IncompatiblePeer, ManifestError  # noqa: E402
from dsakv.disagg.transfer.v4 import V4Manifest, check_v4_pair  # noqa: E402
from dsakv.engine.v4_engine import V4Engine  # noqa: E402
from dsakv.model.deepseek_v4 import load_v4  # noqa: E402
from dsakv.model.deepseek_v4_tiny import make_tiny_v4  # noqa: E402
from dsakv.spec.layout import BufferKey, Kind  # noqa: E402
from dsakv.testing.v4_pd import (  # noqa: E402
    V4DecodePeer,
    V4DecodeSpec,
    V4PrefillProcesses,
    V4PrefillStages,
)

ENGINES = ["mooncake", "nixl"]
CHILD_ENV = {**LOOPBACK_UCX_ENV, "MC_LOG_LEVEL": "WARNING", "OMP_NUM_THREADS": "1"}
LENGTHS = (5, 17, 24, 40)  # up to 5x the window (8), several CSA (4) and HCA (16) groups
NEW = 8
SPLITS = [(0, 3), (3, 6)]
PAGES = 32


def options(engine: str) -> dict:
    return {"env": LOOPBACK_UCX_ENV} if engine == "nixl" else {}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(2, 500, (n,), generator=g).tolist() for n in LENGTHS]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_v4(tmp_path_factory.mktemp("v4pd") / "flash", "flash")


@pytest.fixture(scope="module")
def colocated(ckpt: Path) -> list[list[int]]:
    eng = V4Engine(load_v4(ckpt), num_pages=64, max_running=4)
    return [r.output for r in eng.generate(_prompts(), NEW)]


@pytest.mark.parametrize("engine", ENGINES)
def test_v4_pp2_prefill_to_decode_over_engine(ckpt: Path, colocated: list[list[int]], engine: str) -> None:
    model = load_v4(ckpt)
    pre = V4PrefillStages(model, SPLITS, PAGES, 2, engine, options(engine), chunk_size=7)
    dec = V4DecodePeer(V4DecodeSpec(str(ckpt), PAGES, 2, None, engine, options(engine), CHILD_ENV))
    try:
        # the handshake, both ways, over the manifests' bytes
        assert (
            dec.call("hello", pre.manifests()) == len(dec.manifest.regions) == 6 + 2 * 4 + 2 * 2
        )  # windows, CSA 2 and 4, HCA 3 and 5
        pairs = pre.handshake(dec.manifest)
        lay0, lay1 = (s.layout for s in pre.stages)
        # stage 0 = window, window, CSA; stage 1 = HCA, CSA, HCA (page 16, fp32 entries of 128 B)
        assert [(p.key, p.nbytes) for p in pairs[0] if p.paged] == [
            (BufferKey(2, Kind.CSA_KV), 4 * 128),
            (BufferKey(2, Kind.CSA_INDEX_K), 4 * 64),
        ]
        assert [(p.key, p.nbytes) for p in pairs[1] if p.paged] == [
            (BufferKey(3, Kind.HCA_KV), 128),
            (BufferKey(4, Kind.CSA_KV), 4 * 128),
            (BufferKey(4, Kind.CSA_INDEX_K), 4 * 64),
            (BufferKey(5, Kind.HCA_KV), 128),
        ]
        assert (lay0.bytes_per_page, lay1.bytes_per_page) == (768, 1024)
        state = (lay0.state_bytes_per_request, lay1.state_bytes_per_request)
        outputs, per_pair = [], []
        for i, prompt in enumerate(_prompts()):
            req = pre.prefill(prompt, owner=i)
            rid, dst_pages, dst_slot = dec.call("accept", (prompt, req.first_token, NEW))
            sent = pre.send(req, dec.manifest, dst_pages, dst_slot)
            n = -(-len(prompt) // 16)
            assert req.num_pages == n
            assert [s["bytes"] for s in sent] == [s["figure"] for s in sent]
            assert [s["bytes"] for s in sent] == [n * 768 + state[0], n * 1024 + state[1]]
            assert sent[0]["by_kind"] == {
                "csa_kv": n * 512,
                "csa_index_k": n * 256,
                "window": 3 * 8 * 128,
                "csa_state": 8 * 4 * 32 * 4,
                "csa_index_state": 8 * 4 * 16 * 4,
            }
            per_pair.append([s["bytes"] for s in sent])
            assert dec.call("digests", (rid, n)) == pre.digests(req)  # every key's bytes landed intact
            pre.release(req, owner=i)
            outputs.append(dec.call("start", rid))
        assert outputs == colocated
        assert tuple(dec.call("pages_free")) == (PAGES, 2)
        assert all(s.pages.num_free == PAGES and s.slots.num_free == 2 for s in pre.stages)
        assert per_pair == [[-(-n // 16) * 768 + state[0], -(-n // 16) * 1024 + state[1]] for n in LENGTHS]
    finally:
        dec.stop()
        pre.close()


@pytest.mark.parametrize("engine", ENGINES)
def test_v4_pp2_stage_processes_to_decode_over_engine(ckpt: Path, colocated: list[list[int]], engine: str) -> None:
    """Each prefill stage its own process (the hidden streams go stage to stage over pipes), the decode a third:
    each (stage, decode) pair moves exactly its layout figure over its own engine; tokens == colocated."""
    model = load_v4(ckpt)
    pre = V4PrefillProcesses(model, str(ckpt), SPLITS, PAGES, 2, engine, options(engine), chunk_size=7)
    dec = V4DecodePeer(V4DecodeSpec(str(ckpt), PAGES, 2, None, engine, options(engine), CHILD_ENV))
    try:
        assert dec.call("hello", pre.manifests()) == 18
        assert [len(p) for p in pre.handshake(dec)] == [7, 11]
        lay0 = model.stage_layout(0, 3)
        lay1 = model.stage_layout(3, 6)
        state = (lay0.state_bytes_per_request, lay1.state_bytes_per_request)
        outputs = []
        for i, prompt in enumerate(_prompts()):
            req = pre.prefill(prompt, owner=i)
            rid, dst_pages, dst_slot = dec.call("accept", (prompt, req.first_token, NEW))
            sent = pre.send(req, dec, dst_pages, dst_slot)
            n = -(-len(prompt) // 16)
            assert [(s["stage"], s["bytes"]) for s in sent] == [
                ("0-2", n * 768 + state[0]),
                ("3-5", n * 1024 + state[1]),
            ]
            assert [s["bytes"] for s in sent] == [s["figure"] for s in sent]
            assert dec.call("digests", (rid, n)) == pre.digests(req)
            pre.release(req, owner=i)
            outputs.append(dec.call("start", rid))
        assert outputs == colocated
        assert pre.free() == (PAGES, 2)
        assert tuple(dec.call("pages_free")) == (PAGES, 2)
    finally:
        dec.stop()
        pre.close()


@pytest.mark.parametrize(
    ("page_size", "match"),
    [(32, r"L2/csa_kv \(csa_kv\): sender 4 x 128 B per page \(page 16"), (16, None)],
)
def test_v4_decode_of_other_page_size_refused_at_handshake(ckpt: Path, page_size: int, match: str | None) -> None:
    """A decode with pages of 32 tokens publishes its manifest; both sides refuse it naming the kind and sizes."""
    model = load_v4(ckpt)
    pre = V4PrefillStages(model, SPLITS, 8, 1, "mooncake")
    dec = V4DecodePeer(V4DecodeSpec(str(ckpt), 8, 1, page_size, "mooncake", {}, CHILD_ENV))
    try:
        if match is None:
            assert [len(p) for p in pre.handshake(dec.manifest)] == [2 + 5, 4 + 3 + 2 + 2]
            return
        with pytest.raises(IncompatiblePeer, match=match):
            pre.handshake(dec.manifest)
        with pytest.raises(RuntimeError, match=r"IncompatiblePeer: .*csa_kv\): sender 8 x 128 B per page \(page 32"):
            dec.call("hello", pre.manifests())
        assert tuple(dec.call("pages_free")) == (8, 1)  # refused: nothing allocated
    finally:
        dec.stop()
        pre.close()


def test_v4_manifest_refuses_other_format_and_bad_bytes(ckpt: Path) -> None:
    model = load_v4(ckpt)
    pre = V4PrefillStages(model, SPLITS, 4, 1, "mooncake")
    try:
        m = pre.stages[1].manifest
        back = V4Manifest.from_bytes(m.to_bytes())
        assert back == m and back.bytes_per_page == 1024
        ident = dict(m.identity, index_format="bf16")  # a decode holding a bf16 index-K: 4 x 32 B per page
        other = V4Manifest(m.worker, m.model_name, ident, m.regions, m.backend_meta)
        with pytest.raises(
            ManifestError, match=r"L4/csa_index_k \(csa_index_k\) has 256 B per page but its layout says 128"
        ):
            check_v4_pair(pre.stages[1].layout, other)
        with pytest.raises(ManifestError, match="foreign manifest"):
            V4Manifest.from_bytes(b"\x80")
        with pytest.raises(ManifestError, match="msgpack decoding failed"):
            V4Manifest.from_bytes(b"\xc1")
        assert np.array_equal(sorted(m.regions), sorted(pre.stages[1].layout.keys))
    finally:
        pre.close()
