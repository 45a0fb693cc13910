"""DeepSeek-V4 over the transfer layer: a keyed manifest of every paged kind and state slot, the handshake check
and the blocks that move one request from a prefill stage to a decode stage.

    worker "v4-prefill-pp0"  model #3f0c...  layers 0-2  page 16  fp32/fp32  hca online
    L1/csa_kv           addr 0x7f..000  page 4 x 128 B  x 64 pages     (paged: a row per page)
    L1/csa_index_k      addr 0x7f..000  ...
    L0/window           addr 0x7f..000  slot 8 x 128 B  x 4 slots      (state: a row per request slot)
    backend mooncake  meta b"..."

Every region is one contiguous registered buffer (V4Pool.regions: pages or slots x their bytes). The handshake
(`check_v4_pair`) rebuilds the peer's V4Layout from the identity its manifest states, checks the manifest's
regions are exactly that layout's buffers, and pairs the common keys with `spec.v4_layout.pair_layouts`, so a
peer with another page size, format or HCA state mode is refused (IncompatiblePeer) naming the kind and both
sizes. `v4_blocks` turns (source pages, source slot) -> (destination pages, destination slot) into Blocks: one
per paged key and joint page run (the TransferPlan rule) and one per state key (its slot). Bytes moved ==
pages x the pair's bytes per page + the pair's state bytes per request, exactly.

Imports spec and disagg.transfer only (the pool is duck-typed): no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import msgpack
import numpy as np

from dsakv.disagg.protocol.errors import IncompatiblePeer, ManifestError
from dsakv.disagg.transfer.backends.base import Peer, TransferBackend
from dsakv.disagg.transfer.manifest import BackendMeta, Manifest, RegionInfo, RegionLike
from dsakv.disagg.transfer.plan import Blocks, contiguous_runs
from dsakv.errors import ConfigError
from dsakv.spec.layout import BufferKey, Kind
from dsakv.spec.v4 import V4Spec
from dsakv.spec.v4_layout import PagedSpec, V4Layout, V4Pair, pair_layouts

V4_MANIFEST_FORMAT = "dsakv-v4-manifest"
V4_MANIFEST_VERSION = 1
MAX_V4_MANIFEST_BYTES = 16 * 1024 * 1024
_IDENTITY_FIELDS = ("model", "layers", "draft_layers", "kv_format", "index_format", "page_size", "hca_state")


class V4PoolLike(Protocol):
    """What `V4Manifest.from_pool` reads (cache.v4_pool.V4Pool)."""

    @property
    def layout(self) -> V4Layout: ...

    def regions(self) -> Mapping[BufferKey, RegionLike]: ...


@dataclass(frozen=True)
class V4Manifest:
    """What a V4 worker (or PP stage) exposes: its layout identity and one region per key it holds.

    Duck-compatible with `Manifest` where the backends read it (worker, backend_meta, regions, staging)."""

    worker: str
    model_name: str
    identity: Mapping[str, Any] = field(hash=False)
    regions: Mapping[BufferKey, RegionInfo] = field(hash=False)
    backend_meta: BackendMeta
    version: int = V4_MANIFEST_VERSION
    staging: None = None  # no destination staging slots for V4 (yet)

    def __post_init__(self) -> None:
        if self.version != V4_MANIFEST_VERSION:
            raise ManifestError(f"V4 manifest version {self.version!r} is not supported: this dsakv reads version 1")
        missing = [f for f in _IDENTITY_FIELDS if f not in self.identity]
        if missing:
            raise ManifestError(f"V4 manifest of {self.worker!r} lacks identity field(s) {', '.join(missing)}")
        if not isinstance(self.backend_meta, BackendMeta):
            raise ManifestError(f"V4 manifest of {self.worker!r}: backend_meta must be a BackendMeta")
        for key, reg in self.regions.items():
            if not isinstance(key, BufferKey) or not isinstance(reg, RegionInfo):
                raise ManifestError(f"V4 manifest of {self.worker!r}: regions must map BufferKey -> RegionInfo")
        spans = sorted((r.addr, r.end, k) for k, r in self.regions.items())
        for (_, e0, k0), (a1, _, k1) in zip(spans, spans[1:], strict=False):
            if a1 < e0:
                raise ManifestError(f"V4 manifest of {self.worker!r}: regions {k0} and {k1} overlap")

    @classmethod
    def from_pool(cls, pool: V4PoolLike, backend_meta: BackendMeta, worker: str = "") -> V4Manifest:
        lay = pool.layout
        regions = {k: RegionInfo.of(r) for k, r in pool.regions().items()}
        m = cls(
            worker or f"{lay.spec.name}:{lay.describe_range()}", lay.spec.name, lay.identity(), regions, backend_meta
        )
        m.check_against(lay)
        return m

    @property
    def page_size(self) -> int:
        return int(self.identity["page_size"])

    def layout(self, spec: V4Spec) -> V4Layout:
        """The peer's layout, rebuilt from its identity over this side's `spec` (the model must be the same)."""
        ident = self.identity
        if ident["model"] != spec.identity_hash():
            raise IncompatiblePeer(
                f"incompatible V4 peer {self.worker!r}: model {self.model_name!r} #{ident['model']} vs this "
                f"worker's {spec.name!r} #{spec.identity_hash()}: load the same checkpoint on both"
            )
        try:
            start, end = ident["layers"]
            lay = V4Layout(
                spec,
                int(start),
                int(end),
                draft_layers=int(ident["draft_layers"]),
                kv_format=str(ident["kv_format"]),
                index_format=str(ident["index_format"]),
                page_size=int(ident["page_size"]),
                hca_state=str(ident["hca_state"]),
            )
        except (ConfigError, TypeError, ValueError) as e:
            raise ManifestError(f"V4 manifest of {self.worker!r} states an invalid layout: {e}") from None
        self.check_against(lay)
        return lay

    def check_against(self, lay: V4Layout) -> None:
        """The regions must be exactly `lay`'s buffers, each of its size (pages or slots of the layout's bytes)."""
        want, have = set(lay.keys), set(self.regions)
        if want != have:
            extra, miss = sorted(have - want), sorted(want - have)
            what = (
                f"a region for {extra[0]} ({lay.missing_key_message(extra[0])})"
                if extra
                else f"no region for {miss[0]} (layer {miss[0].layer}, kind {miss[0].kind.value}), which its "
                "layout holds"
            )
            raise ManifestError(f"V4 manifest of {self.worker!r} has {what}")
        for key, reg in self.regions.items():
            b = lay.buffer(key)
            size = b.page_bytes if isinstance(b, PagedSpec) else b.slot_bytes
            if reg.page_bytes != size:
                unit = "page" if isinstance(b, PagedSpec) else "slot"
                raise ManifestError(
                    f"V4 manifest of {self.worker!r}: {key} ({key.kind.value}) has {reg.page_bytes} B per {unit} but "
                    f"its layout says {size} B: the pool and the layout disagree"
                )

    @property
    def bytes_per_page(self) -> int:
        return sum(r.page_bytes for k, r in self.regions.items() if k.kind in _PAGED)

    def describe(self) -> str:
        i = self.identity
        return (
            f"worker {self.worker!r}: {self.model_name} #{i['model']} layers {i['layers'][0]}-{i['layers'][1] - 1}"
            f" +{i['draft_layers']} MTP, page {i['page_size']}, {i['kv_format']}/{i['index_format']}, HCA "
            f"{i['hca_state']}, {len(self.regions)} buffers, backend {self.backend_meta.backend}"
        )

    # ---- wire format ------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        obj = {
            "format": V4_MANIFEST_FORMAT,
            "version": self.version,
            "worker": self.worker,
            "model_name": self.model_name,
            "identity": dict(self.identity),
            "regions": [[k.layer, k.kind.value, r.addr, r.page_bytes, r.num_pages] for k, r in self.regions.items()],
            "backend": self.backend_meta.backend,
            "backend_meta": self.backend_meta.data,
        }
        return bytes(msgpack.packb(obj, use_bin_type=True))

    @classmethod
    def from_bytes(cls, data: bytes) -> V4Manifest:
        """Parse a peer's V4 manifest; anything malformed or foreign raises ManifestError saying what."""
        if not isinstance(data, (bytes, bytearray)) or len(data) > MAX_V4_MANIFEST_BYTES:
            raise ManifestError(f"a V4 manifest is at most {MAX_V4_MANIFEST_BYTES} bytes of msgpack")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ManifestError(f"not a dsakv V4 manifest: msgpack decoding failed ({type(e).__name__})") from None
        if not isinstance(obj, dict) or obj.get("format") != V4_MANIFEST_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ManifestError(
                f"foreign manifest: expected format {V4_MANIFEST_FORMAT!r}, got {got!r} (a DeepSeek-V4 worker pairs "
                "only with DeepSeek-V4 workers)"
            )
        if obj.get("version") != V4_MANIFEST_VERSION:
            raise ManifestError(
                f"V4 manifest version {obj.get('version')!r} is not supported: this dsakv reads version 1"
            )
        regions: dict[BufferKey, RegionInfo] = {}
        kinds = {k.value for k in Kind}
        for i, row in enumerate(obj.get("regions") or []):
            if not isinstance(row, list) or len(row) != 5 or row[1] not in kinds or not isinstance(row[0], int):
                raise ManifestError(f"V4 manifest region #{i} = {row!r} must be [layer, kind, addr, bytes, count]")
            key = BufferKey(row[0], Kind(row[1]))
            if key in regions:
                raise ManifestError(f"V4 manifest lists {key} twice")
            regions[key] = RegionInfo(row[2], row[3], row[4])
        ident, meta = obj.get("identity"), obj.get("backend_meta")
        if not isinstance(ident, dict) or not isinstance(meta, bytes):
            raise ManifestError("V4 manifest: 'identity' must be a map and 'backend_meta' bytes")
        return cls(
            str(obj.get("worker", "")),
            str(obj.get("model_name", "")),
            ident,
            regions,
            BackendMeta(str(obj.get("backend", "")), meta),
        )


_PAGED = (Kind.CSA_KV, Kind.CSA_INDEX_K, Kind.HCA_KV)


def check_v4_pair(mine: V4Layout, theirs: V4Manifest) -> tuple[V4Pair, ...]:
    """Handshake: the keys this side and the peer both hold, paired by key. A peer of another model, or whose
    common keys differ in page size, format or HCA state mode, raises IncompatiblePeer naming the kind and both
    sizes; a peer sharing no layer raises too."""
    their_layout = theirs.layout(mine.spec)
    try:
        pairs = pair_layouts(mine, their_layout)
    except ConfigError as e:
        raise IncompatiblePeer(f"{e} (peer {theirs.worker!r}, {theirs.describe()})") from None
    if not pairs:
        raise IncompatiblePeer(
            f"V4 peer {theirs.worker!r} holds layers {their_layout.describe_range()}, this side "
            f"{mine.describe_range()}: no common layer, nothing to transfer"
        )
    return pairs


@dataclass(frozen=True)
class V4Transfer:
    """The blocks of one request between one (sender, receiver) pair, and the bytes each kind moves."""

    blocks: Blocks
    by_kind: dict[Kind, int]
    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


def v4_blocks(
    pairs: Sequence[V4Pair],
    src: V4Manifest,
    dst: V4Manifest,
    src_pages: Sequence[int] | np.ndarray,
    dst_pages: Sequence[int] | np.ndarray,
    src_slot: int,
    dst_slot: int,
) -> V4Transfer:
    """Blocks moving pages src_pages[i] -> dst_pages[i] of every paired paged key and slot src_slot -> dst_slot of
    every paired state key. Page and slot ids are checked against both manifests' regions."""
    sp = np.asarray(src_pages, dtype=np.int64)
    dp = np.asarray(dst_pages, dtype=np.int64)
    if sp.ndim != 1 or sp.shape != dp.shape:
        raise ValueError(f"{sp.size} source pages vs {dp.size} destination pages: they pair one to one")
    if np.unique(dp).size != dp.size:
        raise ValueError("a destination page appears twice: two pages cannot land on one")
    paged = [p for p in pairs if p.paged]
    state = [p for p in pairs if not p.paged]
    srcs: list[np.ndarray] = []
    dsts: list[np.ndarray] = []
    lens: list[np.ndarray] = []
    by_kind: dict[Kind, int] = {}
    if paged and sp.size:
        run_src, run_dst, run_pages = contiguous_runs(sp, dp)
        for p in paged:
            s, d = src.regions[p.key], dst.regions[p.key]
            for name, ids, reg in (("source", sp, s), ("destination", dp, d)):
                if int(ids.min()) < 0 or int(ids.max()) >= reg.num_pages:
                    raise ValueError(
                        f"{name} page ids {int(ids.min())}..{int(ids.max())} are outside {p.key}'s "
                        f"{reg.num_pages} pages"
                    )
            srcs.append(s.addr + run_src * p.nbytes)
            dsts.append(d.addr + run_dst * p.nbytes)
            lens.append(run_pages * p.nbytes)
            by_kind[p.key.kind] = by_kind.get(p.key.kind, 0) + int(sp.size) * p.nbytes
    for p in state:
        s, d = src.regions[p.key], dst.regions[p.key]
        for name, slot, reg in (("source", src_slot, s), ("destination", dst_slot, d)):
            if not 0 <= slot < reg.num_pages:
                raise ValueError(f"{name} slot {slot} is outside {p.key}'s {reg.num_pages} request slots")
        srcs.append(np.asarray([s.addr + src_slot * p.nbytes], dtype=np.int64))
        dsts.append(np.asarray([d.addr + dst_slot * p.nbytes], dtype=np.int64))
        lens.append(np.asarray([p.nbytes], dtype=np.int64))
        by_kind[p.key.kind] = by_kind.get(p.key.kind, 0) + p.nbytes
    if not srcs:
        raise ValueError("nothing to transfer: no paired key (or no page and no state key)")
    blocks = Blocks(np.concatenate(srcs), np.concatenate(dsts), np.concatenate(lens))
    blocks.check("V4 transfer plan")
    return V4Transfer(blocks, by_kind, int(sp.size))


def pair_figure(pairs: Sequence[V4Pair], num_pages: int) -> int:
    """The layout figure of one pair: pages x the paired bytes per page + the paired state bytes per request."""
    return num_pages * sum(p.nbytes for p in pairs if p.paged) + sum(p.nbytes for p in pairs if not p.paged)


def connect_v4(backend: TransferBackend, theirs: V4Manifest) -> Peer:
    """Open the peer over `backend` (the backends read only worker, backend_meta, regions and staging)."""
    return backend.connect(cast(Manifest, theirs))
