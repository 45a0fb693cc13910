"""V4Layout: the buffers a DeepSeek-V4 role (or PP stage) holds, each a BufferKey present only where read.

Token-indexed kinds page: a page of P tokens (P a multiple of the HCA ratio) holds P/csa entries of CSA_KV and
CSA_INDEX_K and P/hca entries of HCA_KV, so no entry straddles a page. Per-request state is a keyed region of
slots (one slot per running request):

    layer type   paged kinds (per page of P tokens)            per-request state (per slot)
    window       -                                             WINDOW (window x E)
    CSA (4)      CSA_KV (P/4 x E), CSA_INDEX_K (P/4 x X)       WINDOW, CSA_STATE, CSA_INDEX_STATE
    HCA (128)    HCA_KV (P/128 x E)                            WINDOW, HCA_STATE
    MTP          -                                             WINDOW

E = KV entry (fp8-584: 448 B fp8 no-rope part + 128 B bf16 rope part + 8 B scales and pad), X = index-K entry
(fp8-132 or fp4-68). Compressor state is fp32: CSA keeps the last 2 x ratio tokens' projected kv and gate
(2 x head_dim each: the overlapping Ca/Cb windows), its indexer the same at index_head_dim; HCA keeps one
running slot (online softmax: max, sum, weighted sum, head_dim each) or, as a ring, ratio tokens' kv + gate.
Must not import torch or any higher dsakv layer.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property

from dsakv.errors import ConfigError
from dsakv.spec.layout import INDEX_FORMAT_BYTES, BufferKey, Kind, index_bytes_per_token
from dsakv.spec.v4 import CSA, HCA, WINDOW, V4Spec
from dsakv.util import Registry, ceil_div

PAGED_KINDS = (Kind.CSA_KV, Kind.CSA_INDEX_K, Kind.HCA_KV)
STATE_KINDS = (Kind.WINDOW, Kind.CSA_STATE, Kind.CSA_INDEX_STATE, Kind.HCA_STATE)
HCA_STATE_MODES = ("online", "ring")
FP32 = 4

# V4 K=V entry formats -> bytes per entry, f(head_dim, rope_dim)
V4_KV_FORMAT_BYTES: Registry[Callable[[int, int], int]] = Registry(
    "V4 KV format", flag="--kv-format", unknown="unknown DeepSeek-V4 KV format {name!r}: use one of {choices}"
)


def _fp8_584(head_dim: int, rope: int) -> int:
    nope = head_dim - rope
    return nope + 2 * rope + ceil_div(ceil_div(nope, 64), 8) * 8  # fp8 no-rope + bf16 rope + ue8m0 scales, pad 8


V4_KV_FORMAT_BYTES.add("fp8-584", _fp8_584)
V4_KV_FORMAT_BYTES.add("bf16", lambda hd, rope: 2 * hd)
V4_KV_FORMAT_BYTES.add("fp32", lambda hd, rope: 4 * hd)
V4_KV_FORMATS = V4_KV_FORMAT_BYTES.names()


@dataclass(frozen=True)
class PagedSpec:
    """A token-indexed buffer: `entries_per_page` entries of `entry_bytes` per page of `page_size` tokens."""

    key: BufferKey
    ratio: int
    entry_bytes: int
    entries_per_page: int

    @property
    def page_bytes(self) -> int:
        return self.entry_bytes * self.entries_per_page

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.entry_bytes, self.ratio)


@dataclass(frozen=True)
class StateSpec:
    """A per-request buffer: one slot of `slot_bytes` per running request (`rows` x `row_bytes`)."""

    key: BufferKey
    rows: int
    row_bytes: int

    @property
    def slot_bytes(self) -> int:
        return self.rows * self.row_bytes


@dataclass(frozen=True)
class V4Layout:
    """The V4 buffers of main layers [layer_start, layer_end) plus `draft_layers` MTP layers.

    `every_layer=True` gives every main layer every paged kind (the layout that ignores what each layer
    reads; for comparison only).
    """

    spec: V4Spec = field(repr=False)
    layer_start: int = 0
    layer_end: int | None = None
    draft_layers: int = 0
    kv_format: str = "fp8-584"
    index_format: str = "fp8-132"
    page_size: int | None = None
    hca_state: str = "online"
    every_layer: bool = False

    def __post_init__(self) -> None:
        n = self.spec.num_layers
        if self.layer_end is None:
            object.__setattr__(self, "layer_end", n)
        if self.page_size is None:
            object.__setattr__(self, "page_size", self.spec.page_multiple)
        if not 0 <= self.layer_start < self.end <= n:
            raise ConfigError(
                f"layer range {self.layer_start}..{self.end - 1} is not a non-empty range inside the model's "
                f"layers 0..{n - 1}: fix the PP partition"
            )
        if not 0 <= self.draft_layers <= self.spec.num_draft_layers:
            raise ConfigError(
                f"draft layers = {self.draft_layers}: {self.spec.name} has {self.spec.num_draft_layers} MTP layers"
            )
        p, m = self.page, self.spec.page_multiple
        if isinstance(p, bool) or not isinstance(p, int) or p < 1 or p % m:
            raise ConfigError(
                f"page size = {p!r} does not hold whole compressed entries: DeepSeek-V4 pages must be a multiple of "
                f"{m} tokens (ratios {self.spec.csa_ratio} and {self.spec.hca_ratio}), e.g. {m} or {2 * m}"
            )
        if self.hca_state not in HCA_STATE_MODES:
            raise ConfigError(f"HCA state = {self.hca_state!r}: use one of {', '.join(HCA_STATE_MODES)}")
        V4_KV_FORMAT_BYTES.get(self.kv_format)
        INDEX_FORMAT_BYTES.get(self.index_format)

    @property
    def end(self) -> int:
        assert self.layer_end is not None
        return self.layer_end

    @property
    def page(self) -> int:
        assert self.page_size is not None
        return self.page_size

    @property
    def main_layers(self) -> tuple[int, ...]:
        return tuple(range(self.layer_start, self.end))

    @property
    def layers(self) -> tuple[int, ...]:
        n = self.spec.num_layers
        return self.main_layers + tuple(range(n, n + self.draft_layers))

    @property
    def entry_bytes(self) -> int:
        return int(V4_KV_FORMAT_BYTES.get(self.kv_format)(self.spec.head_dim, self.spec.qk_rope_head_dim))

    @property
    def index_entry_bytes(self) -> int:
        return index_bytes_per_token(self.index_format, self.spec.index_head_dim)

    def kinds_of(self, layer: int) -> tuple[Kind, ...]:
        """The kinds this layout holds for `layer`, paged kinds first."""
        t = self.spec.layer_type(layer)
        if self.every_layer and layer < self.spec.num_layers:
            return (*PAGED_KINDS, *STATE_KINDS)
        if t == CSA:
            return (Kind.CSA_KV, Kind.CSA_INDEX_K, Kind.WINDOW, Kind.CSA_STATE, Kind.CSA_INDEX_STATE)
        if t == HCA:
            return (Kind.HCA_KV, Kind.WINDOW, Kind.HCA_STATE)
        assert t == WINDOW
        return (Kind.WINDOW,)

    def _paged(self, key: BufferKey) -> PagedSpec:
        s = self.spec
        ratio = s.hca_ratio if key.kind is Kind.HCA_KV else s.csa_ratio
        entry = self.index_entry_bytes if key.kind is Kind.CSA_INDEX_K else self.entry_bytes
        return PagedSpec(key, ratio, entry, self.page // ratio)

    def _state(self, key: BufferKey) -> StateSpec:
        s = self.spec
        hd, ihd = s.head_dim, s.index_head_dim
        if key.kind is Kind.WINDOW:
            return StateSpec(key, s.sliding_window, self.entry_bytes)
        if key.kind is Kind.CSA_STATE:  # 2 x ratio tokens x (kv 2hd + gate 2hd)
            return StateSpec(key, 2 * s.csa_ratio, 4 * hd * FP32)
        if key.kind is Kind.CSA_INDEX_STATE:
            return StateSpec(key, 2 * s.csa_ratio, 4 * ihd * FP32)
        assert key.kind is Kind.HCA_STATE
        if self.hca_state == "online":  # running max, sum of exp, weighted sum
            return StateSpec(key, 3, hd * FP32)
        return StateSpec(key, s.hca_ratio, 2 * hd * FP32)  # kv + gate of each token of the open window

    @cached_property
    def paged(self) -> tuple[PagedSpec, ...]:
        return tuple(
            self._paged(BufferKey(layer, k)) for layer in self.layers for k in self.kinds_of(layer) if k in PAGED_KINDS
        )

    @cached_property
    def states(self) -> tuple[StateSpec, ...]:
        return tuple(
            self._state(BufferKey(layer, k)) for layer in self.layers for k in self.kinds_of(layer) if k in STATE_KINDS
        )

    @cached_property
    def by_key(self) -> dict[BufferKey, PagedSpec | StateSpec]:
        out: dict[BufferKey, PagedSpec | StateSpec] = {b.key: b for b in self.paged}
        out.update({s.key: s for s in self.states})
        return out

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return tuple(self.by_key)

    def buffer(self, key: BufferKey) -> PagedSpec | StateSpec:
        try:
            return self.by_key[key]
        except KeyError:
            raise KeyError(self.missing_key_message(key)) from None

    def missing_key_message(self, key: BufferKey) -> str:
        if key.layer not in self.layers:
            why = f"layer {key.layer} is outside this layout's layers {self.describe_range()}"
        else:
            t = self.spec.layer_type(key.layer)
            held = ", ".join(k.value for k in self.kinds_of(key.layer))
            why = f"layer {key.layer} is a {t} layer: it reads only {held}"
        return f"no buffer {key} (layer {key.layer}, kind {key.kind.value}) in this V4 layout: {why}"

    # ---- figures -------------------------------------------------------------------

    @property
    def bytes_per_page(self) -> int:
        return sum(b.page_bytes for b in self.paged)

    @property
    def bytes_per_token(self) -> Fraction:
        """Growing bytes per context token (paged kinds)."""
        return Fraction(self.bytes_per_page, self.page)

    @property
    def state_bytes_per_request(self) -> int:
        return sum(s.slot_bytes for s in self.states)

    def bytes_per_token_of(self, kind: Kind) -> Fraction:
        return sum((b.bytes_per_token for b in self.paged if b.key.kind is kind), Fraction(0))

    def state_bytes_of(self, kind: Kind) -> int:
        return sum(s.slot_bytes for s in self.states if s.key.kind is kind)

    def layers_of_kind(self, kind: Kind) -> tuple[int, ...]:
        return tuple(layer for layer in self.layers if kind in self.kinds_of(layer))

    def pool_bytes(self, num_pages: int, num_slots: int) -> int:
        """Bytes of a pool of `num_pages` pages and `num_slots` request slots for this layout."""
        return num_pages * self.bytes_per_page + num_slots * self.state_bytes_per_request

    def describe_range(self) -> str:
        s = f"{self.layer_start}-{self.end - 1}"
        return s + (f" +{self.draft_layers} MTP" if self.draft_layers else "")

    def identity(self) -> dict[str, object]:
        """What two peers / tiers must agree on to share pages of this layout."""
        return {
            "model": self.spec.identity_hash(),
            "layers": [self.layer_start, self.end],
            "draft_layers": self.draft_layers,
            "kv_format": self.kv_format,
            "index_format": self.index_format,
            "page_size": self.page,
            "hca_state": self.hca_state,
        }


def dense_bytes_per_token(spec: V4Spec, kv_format: str = "fp8-584", index_format: str = "fp8-132") -> int:
    """A V3.2-style layout: every token's K=V entry and index-K on every main layer (no compression, no window)."""
    e = int(V4_KV_FORMAT_BYTES.get(kv_format)(spec.head_dim, spec.qk_rope_head_dim))
    return spec.num_layers * (e + index_bytes_per_token(index_format, spec.index_head_dim))


@dataclass(frozen=True)
class V4Pair:
    """One key both sides hold: bytes per page (paged kinds) or per request slot (state kinds)."""

    key: BufferKey
    nbytes: int
    paged: bool


def pair_layouts(sender: V4Layout, receiver: V4Layout) -> tuple[V4Pair, ...]:
    """The keys a sender stage ships to a receiver, over the intersection of their layers, paired by key.

    Refused (ConfigError naming the kind and both sizes) when the models differ, or a shared key's entry size,
    entries per page or slot size differ (another page size, KV / index format or HCA state mode).
    """
    if sender.spec.identity_hash() != receiver.spec.identity_hash():
        raise ConfigError(
            f"incompatible V4 peers: models {sender.spec.name!r} and {receiver.spec.name!r} differ "
            f"({sender.spec.identity_hash()} vs {receiver.spec.identity_hash()})"
        )
    out, problems = [], []
    for key, mine in sender.by_key.items():
        theirs = receiver.by_key.get(key)
        if theirs is None:
            continue  # the receiver does not hold this layer
        if isinstance(mine, PagedSpec) and isinstance(theirs, PagedSpec):
            if (mine.entry_bytes, mine.entries_per_page) != (theirs.entry_bytes, theirs.entries_per_page):
                problems.append(
                    f"{key} ({key.kind.value}): sender {mine.entries_per_page} x {mine.entry_bytes} B per page "
                    f"(page {sender.page}, {sender.kv_format}/{sender.index_format}), receiver "
                    f"{theirs.entries_per_page} x {theirs.entry_bytes} B (page {receiver.page}, "
                    f"{receiver.kv_format}/{receiver.index_format})"
                )
            else:
                out.append(V4Pair(key, mine.page_bytes, True))
        elif isinstance(mine, StateSpec) and isinstance(theirs, StateSpec):
            if mine.slot_bytes != theirs.slot_bytes:
                problems.append(
                    f"{key} ({key.kind.value}): sender slot {mine.rows} x {mine.row_bytes:,} B, receiver "
                    f"{theirs.rows} x {theirs.row_bytes:,} B (HCA state {sender.hca_state} vs {receiver.hca_state})"
                )
            else:
                out.append(V4Pair(key, mine.slot_bytes, False))
    if problems:
        more = f" (and {len(problems) - 4} more)" if len(problems) > 4 else ""
        raise ConfigError("incompatible V4 peers: " + "; ".join(problems[:4]) + more)
    return tuple(out)
