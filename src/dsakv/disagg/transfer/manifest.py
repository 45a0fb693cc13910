"""Manifest: what one worker exposes to transfer peers, per BufferKey.

A manifest names every registered buffer by its key, never by position:

    worker "prefill-pp1"  model glm-5.2 #3f0c...  layers 20-39  page 64  fp8-656 / fp8-132  elide on
    L20/kv       addr 0x7f..000  41,984 B/page x 512 pages
    L21/kv       addr 0x7f..000  41,984 B/page x 512 pages
    L22/kv  ...  L22/index_k  addr 0x7f..000  8,448 B/page x 512 pages      (22 is a producer)
    backend mooncake  meta b"..."   (how a peer reaches this worker's engine)
    staging addr 0x7f..000  4 slots x 64 MiB    (a decode's destination staging slots, optional)

A shared layer under elision has no INDEX_K entry at all. The regions must be
exactly the layout's buffers: a region for a key the layout does not hold (a
pool sized for every layer while the layout holds only producers) is refused,
as is a missing one.

Serialised with msgpack, tagged and versioned; `from_bytes` refuses malformed
or foreign input with ManifestError, never a crash.
Imports spec only (the pool is duck-typed): no torch, no engine, no serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import msgpack

from dsakv.disagg.protocol.errors import ManifestError
from dsakv.spec.layout import INDEX_FORMATS, KV_FORMATS, BufferKey, Kind, KVLayout

MANIFEST_FORMAT = "dsakv-kv-manifest"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 16 * 1024 * 1024


class RegionLike(Protocol):
    """Anything with the address, page size in bytes and page count of one buffer (cache.device_pool.Region)."""

    @property
    def addr(self) -> int: ...

    @property
    def page_bytes(self) -> int: ...

    @property
    def num_pages(self) -> int: ...


class PoolLike(Protocol):
    """A pool that knows its layout and where its buffers live (cache.DevicePool, cache.HostPool)."""

    @property
    def layout(self) -> KVLayout: ...

    def regions(self) -> Mapping[BufferKey, RegionLike]: ...


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True)
class RegionInfo:
    """One buffer's pages, contiguous: [addr, addr + page_bytes * num_pages)."""

    addr: int
    page_bytes: int
    num_pages: int

    def __post_init__(self) -> None:
        for name in ("addr", "page_bytes", "num_pages"):
            v = getattr(self, name)
            if not _is_int(v):
                raise ManifestError(f"region {name} = {v!r} must be an integer")
        if self.addr <= 0:
            raise ManifestError(f"region address {self.addr:#x} must be a positive address")
        if self.page_bytes <= 0 or self.num_pages <= 0:
            raise ManifestError(
                f"region at {self.addr:#x} has {self.page_bytes} B/page x {self.num_pages} pages: "
                "a zero-sized region is never registered or described"
            )

    @classmethod
    def of(cls, region: RegionLike) -> RegionInfo:
        return cls(int(region.addr), int(region.page_bytes), int(region.num_pages))

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages

    @property
    def end(self) -> int:
        return self.addr + self.nbytes


@dataclass(frozen=True)
class SlotRegion:
    """A decode's registered destination-staging region: `num_slots` slots of `slot_bytes` from `addr`
    (dsakv.disagg.transfer.staging.StagingSlots). A slot holding n pages lays them out key-major in manifest key order,
    each key n x its page bytes (Manifest.slot_offsets)."""

    addr: int
    slot_bytes: int
    num_slots: int

    def __post_init__(self) -> None:
        for name in ("addr", "slot_bytes", "num_slots"):
            v = getattr(self, name)
            if not _is_int(v) or v <= 0:
                raise ManifestError(f"staging region {name} = {v!r} must be a positive integer")

    @property
    def nbytes(self) -> int:
        return self.slot_bytes * self.num_slots

    def slot_addr(self, index: int) -> int:
        if not 0 <= index < self.num_slots:
            raise ManifestError(f"staging slot {index} is not within the region's {self.num_slots} slots")
        return self.addr + index * self.slot_bytes


@dataclass(frozen=True)
class BackendMeta:
    """How a peer reaches this worker's transfer engine: backend name plus the backend's own bytes."""

    backend: str
    data: bytes

    def __post_init__(self) -> None:
        if not isinstance(self.backend, str) or not self.backend:
            raise ManifestError(f"backend name {self.backend!r} must be a non-empty string, e.g. 'mooncake'")
        if not isinstance(self.data, bytes):
            raise ManifestError(f"backend meta for {self.backend!r} must be bytes, got {type(self.data).__name__}")


def expected_keys(
    layers: tuple[int, ...],
    num_main_layers: int,
    shared_layers: frozenset[int],
    index_format: str | None,
    elide: bool,
) -> tuple[BufferKey, ...]:
    """The keys a worker holding `layers` has: KV everywhere, INDEX_K where the layer owns one."""
    out = []
    for layer in layers:
        out.append(BufferKey(layer, Kind.KV))
        if index_format is not None and (layer >= num_main_layers or not elide or layer not in shared_layers):
            out.append(BufferKey(layer, Kind.INDEX_K))
    return tuple(out)


@dataclass(frozen=True)
class Manifest:
    """What a worker exposes to transfer peers. Build with `from_pool` / `from_layout`; ship with `to_bytes`.

    `shared_layers` are the model's main layers that reuse a producer's top-k (their
    INDEX_K may be elided); `draft_layers` are the MTP layer ids this worker holds;
    `index_format` is None for a model without an indexer.
    """

    worker: str
    model_name: str
    model_hash: str
    num_main_layers: int
    layer_start: int
    layer_end: int
    draft_layers: tuple[int, ...]
    shared_layers: tuple[int, ...]
    page_size: int
    kv_format: str
    index_format: str | None
    elide: bool
    regions: Mapping[BufferKey, RegionInfo] = field(hash=False)
    backend_meta: BackendMeta
    version: int = MANIFEST_VERSION
    staging: SlotRegion | None = None  # a decode's destination-staging slots (None: it offers none)
    _layer_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.version != MANIFEST_VERSION:
            raise ManifestError(f"manifest version {self.version!r} is not supported: this dsakv reads version 1")
        for name in ("num_main_layers", "layer_start", "layer_end", "page_size"):
            if not _is_int(getattr(self, name)):
                raise ManifestError(f"manifest field {name} = {getattr(self, name)!r} must be an integer")
        if not (0 <= self.layer_start < self.layer_end <= self.num_main_layers):
            raise ManifestError(
                f"manifest of {self.worker!r}: layer range {self.layer_start}..{self.layer_end - 1} is not a "
                f"non-empty range inside the model's layers 0..{self.num_main_layers - 1}"
            )
        if self.page_size < 1:
            raise ManifestError(f"manifest of {self.worker!r}: page size {self.page_size} must be >= 1")
        if self.kv_format not in KV_FORMATS:
            raise ManifestError(f"manifest of {self.worker!r}: unknown KV format {self.kv_format!r}")
        if self.index_format is not None and self.index_format not in INDEX_FORMATS:
            raise ManifestError(f"manifest of {self.worker!r}: unknown index-K format {self.index_format!r}")
        for d in self.draft_layers:
            if not _is_int(d) or d < self.num_main_layers:
                raise ManifestError(
                    f"manifest of {self.worker!r}: draft layer {d!r} must be >= the main layer count "
                    f"{self.num_main_layers}"
                )
        if not isinstance(self.backend_meta, BackendMeta):
            raise ManifestError(f"manifest of {self.worker!r}: backend_meta must be a BackendMeta")
        if self.staging is not None and not isinstance(self.staging, SlotRegion):
            raise ManifestError(f"manifest of {self.worker!r}: staging must be a SlotRegion or None")
        regions = dict(self.regions)
        for key, reg in regions.items():
            if not isinstance(key, BufferKey) or not isinstance(reg, RegionInfo):
                raise ManifestError(f"manifest of {self.worker!r}: regions must map BufferKey -> RegionInfo")
        object.__setattr__(self, "regions", dict(sorted(regions.items())))
        object.__setattr__(self, "_layer_set", frozenset(self.layers))
        self._check_keys()
        self._check_sizes()

    # ---- validation --------------------------------------------------------------

    def _check_keys(self) -> None:
        want = set(
            expected_keys(
                self.layers, self.num_main_layers, frozenset(self.shared_layers), self.index_format, self.elide
            )
        )
        have = set(self.regions)
        extra, missing = sorted(have - want), sorted(want - have)
        if extra:
            k = extra[0]
            why = ""
            if k.kind is Kind.INDEX_K and k.layer in self.shared_layers and self.elide:
                why = (
                    f" (layer {k.layer} is shared and elision is on: a pool sized for every layer would back "
                    "a buffer that does not exist)"
                )
            elif k.layer not in self._layer_set:
                why = f" (layer {k.layer} is outside this worker's layers {self.describe_layers()})"
            raise ManifestError(
                f"manifest of {self.worker!r} has a region for {k} (layer {k.layer}, kind {k.kind.value}) but its "
                f"layout holds no such buffer{why}; {len(extra)} such key(s): {', '.join(map(str, extra[:6]))}"
            )
        if missing:
            raise ManifestError(
                f"manifest of {self.worker!r} has no region for {missing[0]} (layer {missing[0].layer}, kind "
                f"{missing[0].kind.value}), which its layout holds; {len(missing)} missing: "
                f"{', '.join(map(str, missing[:6]))}"
            )

    def _check_sizes(self) -> None:
        per_kind: dict[Kind, tuple[BufferKey, int]] = {}
        for key, reg in self.regions.items():
            if reg.page_bytes % self.page_size:
                raise ManifestError(
                    f"manifest of {self.worker!r}: {key} has {reg.page_bytes} B/page, not a multiple of the "
                    f"page size {self.page_size} tokens"
                )
            first = per_kind.setdefault(key.kind, (key, reg.page_bytes))
            if first[1] != reg.page_bytes:
                raise ManifestError(
                    f"manifest of {self.worker!r}: {key} has {reg.page_bytes} B/page but {first[0]} has "
                    f"{first[1]} B/page; every buffer of one kind has the same page size"
                )
        spans = sorted((r.addr, r.end, k) for k, r in self.regions.items())
        for (a0, e0, k0), (a1, _, k1) in zip(spans, spans[1:], strict=False):
            if a1 < e0:
                raise ManifestError(
                    f"manifest of {self.worker!r}: regions {k0} [{a0:#x}, {e0:#x}) and {k1} (from {a1:#x}) overlap"
                )

    # ---- construction ----------------------------------------------------------------

    @classmethod
    def from_layout(
        cls,
        layout: KVLayout,
        regions: Mapping[BufferKey, RegionLike],
        backend_meta: BackendMeta,
        worker: str = "",
        staging: SlotRegion | None = None,
    ) -> Manifest:
        """A manifest for `layout` whose buffers live at `regions` (one per layout key, exactly)."""
        spec = layout.spec
        infos: dict[BufferKey, RegionInfo] = {}
        for key, reg in regions.items():
            info = RegionInfo.of(reg)
            if key in layout.by_key and info.page_bytes != layout.by_key[key].page_bytes:
                raise ManifestError(
                    f"region for {key} (layer {key.layer}, kind {key.kind.value}) has {info.page_bytes} B/page but "
                    f"the layout says {layout.by_key[key].page_bytes} B/page: the pool and the layout disagree"
                )
            infos[key] = info
        return cls(
            worker=worker or f"{spec.name}:{layout.describe_range()}",
            model_name=spec.name,
            model_hash=spec.identity_hash(),
            num_main_layers=spec.num_layers,
            layer_start=layout.layer_start,
            layer_end=layout.end,
            draft_layers=layout.draft_layer_ids,
            shared_layers=spec.shared_layers,
            page_size=layout.page_size,
            kv_format=layout.kv_format,
            index_format=layout.index_format if spec.has_indexer else None,
            elide=layout.elide,
            regions=infos,
            backend_meta=backend_meta,
            staging=staging,
        )

    @classmethod
    def from_pool(
        cls, pool: PoolLike, backend_meta: BackendMeta, worker: str = "", staging: SlotRegion | None = None
    ) -> Manifest:
        """The manifest of a DevicePool (or HostPool) registered with a backend whose meta is `backend_meta`."""
        return cls.from_layout(pool.layout, pool.regions(), backend_meta, worker, staging)

    # ---- queries -----------------------------------------------------------------------

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(range(self.layer_start, self.layer_end)) + tuple(self.draft_layers)

    def holds_layer(self, layer: int) -> bool:
        return layer in self._layer_set

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return tuple(self.regions)

    def region(self, key: BufferKey) -> RegionInfo:
        try:
            return self.regions[key]
        except KeyError:
            raise KeyError(f"worker {self.worker!r} holds no buffer {key}") from None

    def slot_offsets(self, pages: int) -> dict[BufferKey, int]:
        """Byte offset of each key's pages in a staging slot holding `pages` pages (key-major, key order)."""
        out, off = {}, 0
        for key, reg in self.regions.items():
            out[key] = off
            off += reg.page_bytes * pages
        return out

    def format_of(self, kind: Kind) -> str | None:
        return self.kv_format if kind is Kind.KV else self.index_format

    @property
    def bytes_per_page(self) -> int:
        return sum(r.page_bytes for r in self.regions.values())

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_page // self.page_size

    def describe_layers(self) -> str:
        s = f"{self.layer_start}-{self.layer_end - 1}"
        if self.draft_layers:
            s += f" +draft {','.join(map(str, self.draft_layers))}"
        return s

    def describe(self) -> str:
        return (
            f"worker {self.worker!r}: {self.model_name} #{self.model_hash} layers {self.describe_layers()}, "
            f"page {self.page_size}, {self.kv_format}/{self.index_format}, elide {'on' if self.elide else 'off'}, "
            f"{len(self.regions)} buffers, backend {self.backend_meta.backend}"
        )

    # ---- wire format -----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": MANIFEST_FORMAT,
            "version": self.version,
            "worker": self.worker,
            "model_name": self.model_name,
            "model_hash": self.model_hash,
            "num_main_layers": self.num_main_layers,
            "layer_start": self.layer_start,
            "layer_end": self.layer_end,
            "draft_layers": list(self.draft_layers),
            "shared_layers": list(self.shared_layers),
            "page_size": self.page_size,
            "kv_format": self.kv_format,
            "index_format": self.index_format,
            "elide": self.elide,
            "regions": [[k.layer, k.kind.value, r.addr, r.page_bytes, r.num_pages] for k, r in self.regions.items()],
            "backend": self.backend_meta.backend,
            "backend_meta": self.backend_meta.data,
            "staging": None
            if self.staging is None
            else [self.staging.addr, self.staging.slot_bytes, self.staging.num_slots],
        }

    def to_bytes(self) -> bytes:
        return bytes(msgpack.packb(self.to_dict(), use_bin_type=True))

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse a peer's manifest; anything malformed or foreign raises ManifestError saying what is wrong."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ManifestError(f"a manifest is bytes, got {type(data).__name__}")
        if len(data) > MAX_MANIFEST_BYTES:
            raise ManifestError(f"manifest of {len(data)} bytes exceeds the {MAX_MANIFEST_BYTES}-byte limit")
        try:
            obj = msgpack.unpackb(bytes(data), raw=False, strict_map_key=False)
        except Exception as e:  # msgpack raises several unrelated types on garbage
            raise ManifestError(f"not a dsakv manifest: msgpack decoding failed ({type(e).__name__}: {e})") from None
        return cls.from_dict(obj)

    @classmethod
    def from_dict(cls, obj: object) -> Manifest:
        if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
            got = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ManifestError(f"foreign manifest: expected format {MANIFEST_FORMAT!r}, got {got!r}")
        version = obj.get("version")
        if version != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest version {version!r} is not supported: this dsakv reads version {MANIFEST_VERSION}; "
                "run the same dsakv version on both peers"
            )
        r = _Reader(obj)
        regions: dict[BufferKey, RegionInfo] = {}
        for i, row in enumerate(r.get("regions", list)):
            if not isinstance(row, list) or len(row) != 5:
                raise ManifestError(f"manifest region #{i} = {row!r} must be [layer, kind, addr, page_bytes, pages]")
            layer, kind, addr, page_bytes, num_pages = row
            if not _is_int(layer) or kind not in {k.value for k in Kind}:
                raise ManifestError(f"manifest region #{i}: bad key (layer {layer!r}, kind {kind!r})")
            key = BufferKey(layer, Kind(kind))
            if key in regions:
                raise ManifestError(f"manifest lists {key} twice")
            regions[key] = RegionInfo(addr, page_bytes, num_pages)
        index_format = obj.get("index_format")
        if index_format is not None and not isinstance(index_format, str):
            raise ManifestError(f"manifest field 'index_format' = {index_format!r} must be a string or nil")
        meta = obj.get("backend_meta")
        if not isinstance(meta, bytes):
            raise ManifestError(f"manifest field 'backend_meta' must be bytes, got {type(meta).__name__}")
        st = obj.get("staging")
        if st is not None and (not isinstance(st, list) or len(st) != 3):
            raise ManifestError(f"manifest field 'staging' = {st!r} must be [addr, slot_bytes, slots] or nil")
        return cls(
            worker=r.get("worker", str),
            model_name=r.get("model_name", str),
            model_hash=r.get("model_hash", str),
            num_main_layers=r.get("num_main_layers", int),
            layer_start=r.get("layer_start", int),
            layer_end=r.get("layer_end", int),
            draft_layers=tuple(r.int_list("draft_layers")),
            shared_layers=tuple(r.int_list("shared_layers")),
            page_size=r.get("page_size", int),
            kv_format=r.get("kv_format", str),
            index_format=index_format,
            elide=r.get("elide", bool),
            regions=regions,
            backend_meta=BackendMeta(r.get("backend", str), meta),
            staging=SlotRegion(*st) if st is not None else None,
        )


class _Reader:
    def __init__(self, obj: dict[str, Any]) -> None:
        self.obj = obj

    def get(self, name: str, typ: type) -> Any:
        if name not in self.obj:
            raise ManifestError(f"manifest is missing field {name!r}")
        v = self.obj[name]
        ok = isinstance(v, typ) and (typ is not int or not isinstance(v, bool))
        if not ok:
            raise ManifestError(f"manifest field {name!r} = {v!r} must be of type {typ.__name__}")
        return v

    def int_list(self, name: str) -> list[int]:
        v = self.get(name, list)
        if not all(_is_int(x) for x in v):
            raise ManifestError(f"manifest field {name!r} = {v!r} must be a list of integers")
        return list(v)
