"""Storage codecs: how one token's KV or index-K values are laid out as bytes in a page.

A codec turns float values [N, dim] into byte *segments* and back. A page of P
tokens stores segment 0 of all P tokens, then segment 1 of all P tokens, ...:

    one segment (row formats: every KV format, bf16/fp32 index-K), page = P rows:
    | row tok0 | row tok1 | ... | row tok P-1 |

    fp8-656 KV row (kv_lora_rank r, rope dim d; one fp32 scale per 128 latent values):
    | latent fp8 e4m3 (r B) | scales fp32 (4 x ceil(r/128) B) | rope bf16 (2d B) |

    fp8-576 KV row:  | latent fp8 (r B) | rope fp8 (d B) |      (plain casts, no scales)

    two segments (fp8-132 / fp4-68 index-K, dim D, G = ceil(D/128) scale groups):
    | k fp8 tok0 (D B) | ... | k fp8 tok P-1 | scales tok0 (4G B) | ... | scales tok P-1 |
    fp4-68 packs two e2m1 codes per byte (even element in the low nibble) in place of fp8.

Byte sizes equal spec.layout.kv_bytes_per_token / index_bytes_per_token for every
dimension. Decoding always gives float32. Quantised formats scale each group of 128
values by amax / max_code (amax clamped to 1e-12) and round to nearest.
Imports torch and dsakv.spec; must not import model, engine or disagg.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dsakv.errors import ConfigError
from dsakv.spec.layout import (
    INDEX_FORMAT_BYTES,
    KV_FORMAT_BYTES,
    QUANT_GROUP,
    index_bytes_per_token,
    kv_bytes_per_token,
)
from dsakv.util import ceil_div

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FP4_MAX = 6.0
# e2m1 magnitudes by code 0..7, and the midpoints between them (round to nearest, ties to the lower code)
_FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_FP4_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_AMAX_FLOOR = 1e-12


def _groups(dim: int) -> int:
    return ceil_div(dim, QUANT_GROUP)


def _as_bytes(x: torch.Tensor) -> torch.Tensor:
    """[N, k] tensor of any dtype -> [N, k * itemsize] uint8 (a copy when x is not contiguous)."""
    return x.contiguous().view(torch.uint8)


def _from_bytes(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, k * itemsize] uint8 -> [N, k] of dtype (copies, so any byte offset is fine)."""
    return b.contiguous().view(dtype)


def _group_scales(x: torch.Tensor, max_code: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, D] float32 -> (scales [N, G] float32, x / its group's scale [N, D]); whole groups divide by the
    scales broadcast (no per-element expansion), the same quotients."""
    n, d = x.shape
    g = _groups(d)
    pad = g * QUANT_GROUP - d
    xp = torch.nn.functional.pad(x, (0, pad)) if pad else x
    amax = xp.abs().view(n, g, QUANT_GROUP).amax(dim=-1).clamp(min=_AMAX_FLOOR)
    scales = amax / max_code
    if not pad:
        return scales, (x.view(n, g, QUANT_GROUP) / scales[:, :, None]).view(n, d)
    return scales, x / scales.repeat_interleave(QUANT_GROUP, dim=1)[:, :d]


def _expand_scales(scales: torch.Tensor, d: int) -> torch.Tensor:
    return scales.repeat_interleave(QUANT_GROUP, dim=1)[:, :d]


def _fp8_cast(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def _fp8_group_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, y = _group_scales(x, FP8_MAX)
    return _as_bytes(_fp8_cast(y)), _as_bytes(scales)


def _scale_groups_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """out [N, d] = codes [N, d] (fp8) as float32 * each group's scale [N, G]: one multiply, no expansion."""
    n, d = codes.shape
    g = scales.shape[1]
    if g == 1:
        torch.mul(codes.to(torch.float32), scales, out=out)
    elif d == g * QUANT_GROUP:
        torch.mul(codes.to(torch.float32).view(n, g, QUANT_GROUP), scales[:, :, None], out=out.view(n, g, QUANT_GROUP))
    else:
        out.copy_(codes.to(torch.float32) * _expand_scales(scales, d))


def _fp8_group_decode(codes: torch.Tensor, scale_bytes: torch.Tensor, d: int) -> torch.Tensor:
    scales = _from_bytes(scale_bytes, torch.float32)
    out = torch.empty(codes.shape[0], d, dtype=torch.float32, device=codes.device)
    _scale_groups_into(out, _from_bytes(codes, FP8), scales)
    return out


def _fp4_group_encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scales, y = _group_scales(x, FP4_MAX)
    mids = torch.tensor(_FP4_MIDPOINTS, dtype=torch.float32, device=x.device)
    mag = torch.bucketize(y.abs().clamp(max=FP4_MAX), mids, right=False).to(torch.uint8)
    codes = mag | ((y < 0).to(torch.uint8) << 3)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.contiguous(), _as_bytes(scales)


def _fp4_group_decode(packed: torch.Tensor, scale_bytes: torch.Tensor, d: int) -> torch.Tensor:
    lo = packed & 0x0F
    hi = packed >> 4
    codes = torch.stack((lo, hi), dim=-1).reshape(packed.shape[0], d)
    table = torch.tensor(_FP4_VALUES, dtype=torch.float32, device=packed.device)
    mag = table[(codes & 0x07).long()]
    vals = torch.where((codes & 0x08) != 0, -mag, mag)
    return vals * _expand_scales(_from_bytes(scale_bytes, torch.float32), d)


@dataclass(frozen=True)
class Codec:
    """Float values [N, dim] <-> byte segments; `segments` are the bytes per token of each segment."""

    fmt: str
    kind: str  # "kv" or "index_k"
    dim: int  # values per token (kv: kv_lora_rank + rope_dim)
    latent_dim: int  # kv: kv_lora_rank; index_k: dim
    segments: tuple[int, ...]

    def __post_init__(self) -> None:
        if self.dim < 1 or not self.segments or min(self.segments) < 1:
            raise ConfigError(f"codec {self.fmt!r} for {self.kind} has an empty value or segment: dim={self.dim}")

    @property
    def bytes_per_token(self) -> int:
        return sum(self.segments)

    @property
    def exact(self) -> bool:
        return self.fmt == "fp32"

    def encode(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [N, dim] (any float dtype) -> one uint8 [N, w] tensor per segment."""
        if x.dim() != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{self.kind} codec {self.fmt!r} encodes [N, {self.dim}] values, got {tuple(x.shape)}")
        if x.dtype != torch.float32:
            x = x.to(torch.float32)
        r = self.latent_dim
        f = self.fmt
        if f == "fp32":
            out = [_as_bytes(x)]
        elif f == "bf16":
            out = [_as_bytes(x.to(torch.bfloat16))]
        elif self.kind == "kv" and f == "fp8-656":
            codes, scales = _fp8_group_encode(x[:, :r])
            out = [torch.cat((codes, scales, _as_bytes(x[:, r:].to(torch.bfloat16))), dim=1)]
        elif self.kind == "kv" and f == "fp8-576":
            out = [_as_bytes(_fp8_cast(x))]
        elif self.kind == "index_k" and f == "fp8-132":
            out = list(_fp8_group_encode(x))
        elif self.kind == "index_k" and f == "fp4-68":
            out = list(_fp4_group_encode(x))
        else:  # pragma: no cover - guarded by make_codec
            raise ConfigError(f"no {self.kind} codec {f!r}")
        return out

    def decode(self, segs: list[torch.Tensor]) -> torch.Tensor:
        """One uint8 [N, w] tensor per segment -> float32 [N, dim]."""
        r = self.latent_dim
        f = self.fmt
        if f == "fp32":
            return _from_bytes(segs[0], torch.float32)
        if f == "bf16":
            return _from_bytes(segs[0], torch.bfloat16).to(torch.float32)
        if self.kind == "kv" and f == "fp8-656":
            row = segs[0].contiguous()
            g = _groups(r)
            if r % 4 == 0 and row.shape[1] % 4 == 0:  # reinterpret in place: scales and rope need no copies
                scales = row.view(torch.float32)[:, r // 4 : r // 4 + g]
                rope = row.view(torch.bfloat16)[:, (r + 4 * g) // 2 :]
                out = torch.empty(row.shape[0], self.dim, dtype=torch.float32, device=row.device)
                _scale_groups_into(out[:, :r], row.view(FP8)[:, :r], scales)
                out[:, r:] = rope
                return out
            latent = _fp8_group_decode(row[:, :r], row[:, r : r + 4 * g], r)
            rope = _from_bytes(row[:, r + 4 * g :], torch.bfloat16).to(torch.float32)
            return torch.cat((latent, rope), dim=1)
        if self.kind == "kv" and f == "fp8-576":
            return _from_bytes(segs[0], FP8).to(torch.float32)
        if self.kind == "index_k" and f == "fp8-132":
            return _fp8_group_decode(segs[0], segs[1], self.dim)
        if self.kind == "index_k" and f == "fp4-68":
            return _fp4_group_decode(segs[0], segs[1], self.dim)
        raise ConfigError(f"no {self.kind} codec {f!r}")  # pragma: no cover

    # ---- page placement ---------------------------------------------------------

    def _segment_views(self, buf: torch.Tensor, page_size: int) -> list[torch.Tensor]:
        """Views [num_pages, page_size, w] of each segment inside buf [num_pages, page_bytes]."""
        num_pages, page_bytes = buf.shape
        if buf.dtype != torch.uint8 or page_bytes != self.bytes_per_token * page_size:
            raise ValueError(
                f"{self.kind} buffer is {buf.dtype} [{num_pages}, {page_bytes}] but format {self.fmt!r} with "
                f"page size {page_size} needs uint8 pages of {self.bytes_per_token * page_size} bytes"
            )
        views, base = [], 0
        for w in self.segments:
            views.append(buf[:, base : base + page_size * w].view(num_pages, page_size, w))
            base += page_size * w
        return views

    def _row_views(self, buf: torch.Tensor, page_size: int) -> list[torch.Tensor]:
        """Per segment, the view rows are gathered from / scattered to by one indexed op.

        One segment (every KV format, bf16/fp32 index-K): pages hold whole rows back to back, so the buffer is
        [num_pages * page_size, w] rows and a slot is a row index (index_select copies rows, not bytes).
        Several segments: [num_pages, page_size, w] per segment, read as int32 words where w allows it.
        """
        if len(self.segments) == 1:
            num_pages, page_bytes = buf.shape
            if buf.dtype != torch.uint8 or page_bytes != self.bytes_per_token * page_size:
                self._segment_views(buf, page_size)  # raises the layout error
            return [buf.view(num_pages * page_size, self.segments[0])]
        views = self._segment_views(buf, page_size)
        return [v.view(torch.int32) if v.shape[-1] % 4 == 0 and buf.shape[1] % 4 == 0 else v for v in views]

    def write(
        self, buf: torch.Tensor, slots: torch.Tensor, x: torch.Tensor, page_size: int, check: bool = True
    ) -> None:
        """Store x [N, dim] at token slots [N] (slot = page * page_size + offset) of buf.

        check=False skips the bounds check of the slots (the caller has checked them: a model step checks its
        slot table once for every layer)."""
        slots = _check_slots(slots, buf.shape[0] * page_size, x.shape[0]) if check else slots
        if slots.numel() == 0:
            return
        views = self._row_views(buf, page_size)
        segs = self.encode(x)
        if len(views) == 1:
            views[0][slots] = segs[0] if segs[0].device == buf.device else segs[0].to(buf.device)
            return
        pages, offs = slots // page_size, slots % page_size
        for view, seg in zip(views, segs, strict=True):
            view[pages, offs] = (seg if seg.device == buf.device else seg.to(buf.device)).view(view.dtype)

    def read(self, buf: torch.Tensor, slots: torch.Tensor, page_size: int, check: bool = True) -> torch.Tensor:
        """Float32 [N, dim] values at token slots [N] of buf: only those rows are gathered and decoded."""
        slots = _check_slots(slots, buf.shape[0] * page_size, None) if check else slots
        views = self._row_views(buf, page_size)
        if len(views) == 1:
            return self.decode([views[0].index_select(0, slots)])
        pages, offs = slots // page_size, slots % page_size
        return self.decode([view[pages, offs].view(torch.uint8) for view in views])


def _check_slots(slots: torch.Tensor, capacity: int, n: int | None) -> torch.Tensor:
    if slots.dim() != 1:
        raise ValueError(f"slots must be a 1-D tensor of token slots, got shape {tuple(slots.shape)}")
    if n is not None and slots.numel() != n:
        raise ValueError(f"{slots.numel()} slots for {n} tokens: give one slot per token")
    slots = slots.to(torch.int64)
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= capacity):
        raise IndexError(
            f"token slots span {int(slots.min())}..{int(slots.max())} but the pool has slots 0..{capacity - 1}: "
            "a slot is page_id * page_size + offset of a page this pool holds (padding -1 is not a slot)"
        )
    return slots


def make_kv_codec(fmt: str, kv_lora_rank: int, rope_dim: int) -> Codec:
    """Codec for one layer's MLA cache: values are [latent (kv_lora_rank) | rope key (rope_dim)]."""
    KV_FORMAT_BYTES.check(fmt)
    codec = Codec(fmt, "kv", kv_lora_rank + rope_dim, kv_lora_rank, (kv_bytes_per_token(fmt, kv_lora_rank, rope_dim),))
    return codec


def make_index_codec(fmt: str, index_head_dim: int) -> Codec:
    """Codec for one producer layer's index-K: values are [index_head_dim]."""
    INDEX_FORMAT_BYTES.check(fmt)
    d = index_head_dim
    if fmt == "fp8-132":
        segments: tuple[int, ...] = (d, 4 * _groups(d))
    elif fmt == "fp4-68":
        index_bytes_per_token(fmt, d)  # validates an even dim
        segments = (d // 2, 4 * _groups(d))
    else:
        segments = (index_bytes_per_token(fmt, d),)
    codec = Codec(fmt, "index_k", d, d, segments)
    if codec.bytes_per_token != index_bytes_per_token(fmt, d):  # pragma: no cover - a layout/codec disagreement
        raise AssertionError(f"index codec {fmt!r} has {codec.bytes_per_token} B/token, layout says otherwise")
    return codec
