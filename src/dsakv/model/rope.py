"""Rotary position embedding for the rope slices of MLA and the indexer, as transformers computes it.

    interleaved (MLA of both archs, GLM indexer): pairs (x0, x1), (x2, x3), ... rotate by one
        frequency each and come out as [x_even', x_odd'] halves.
    half split (DeepSeek-V3.2 indexer): x * cos + rotate_half(x) * sin.

inv_freq for rope_type 'default' is computed here; other rope types (yarn, ...)
take transformers' ROPE_INIT_FUNCTIONS (imported lazily). Imports torch only
(and transformers for non-default rope types).
"""

from __future__ import annotations

from typing import Any

import torch


def rope_inv_freq(rope_parameters: dict[str, Any], dim: int, raw_config: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention_scaling) for the rope slice of width `dim`."""
    rope_type = rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        base = float(rope_parameters["rope_theta"])
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = {k: v for k, v in raw_config.items() if k not in ("model_type", "architectures", "_name_or_path")}
    hf_config = AutoConfig.for_model(raw_config["model_type"], **cfg)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
    return inv_freq.float(), float(scaling)


class Rope:
    """cos/sin tables for positions, computed on demand (no max-length cache)."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float) -> None:
        self.inv_freq = inv_freq
        self.attention_scaling = attention_scaling

    def to(self, device: torch.device) -> Rope:
        self.inv_freq = self.inv_freq.to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, dim/2] (the per-pair angles; transformers' cat(f, f) first half)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def apply_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., dim]; cos/sin [T, dim/2] broadcast over the middle dims."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb with cos = cat(freqs, freqs)."""
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (2 * cos.shape[1],)
    c = torch.cat((cos, cos), dim=-1).view(shape)
    s = torch.cat((sin, sin), dim=-1).view(shape)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * c) + (rotated * s)


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor, width: int, interleaved: bool) -> torch.Tensor:
    """[T, width, width] R with x @ R == rope(x) on the first 2 * cos.shape[1] values, identity on the rest.

    One batched matmul per rope application instead of slicing, four products and a cat: built once
    per step, on cos's device, by one scatter of [cos | -sin | cos | sin | 1] into a zero matrix at entries
    cached per (width, pairs, layout, device). interleaved: apply_interleaved's layout; else apply_half_split's.
    """
    t, h = cos.shape
    flat = _rotation_entries(width, h, interleaved, cos.device)
    values = [cos, -sin, cos, sin]
    if width > 2 * h:
        values.append(cos.new_ones(t, width - 2 * h))
    rot = cos.new_zeros(t, width * width)
    rot.index_copy_(1, flat, torch.cat(values, dim=1))
    return rot.view(t, width, width)


_ENTRIES: dict[tuple[int, int, bool, torch.device], torch.Tensor] = {}


def _rotation_entries(width: int, h: int, interleaved: bool, device: torch.device) -> torch.Tensor:
    """Flat indices into a [width, width] matrix of R's (cos, -sin, cos, sin, identity) entries, in that order."""
    key = (width, h, interleaved, device)
    if key not in _ENTRIES:
        i = torch.arange(h)
        even, odd = (2 * i, 2 * i + 1) if interleaved else (i, h + i)
        rest = torch.arange(2 * h, width)
        rows = torch.cat((even, odd, odd, even, rest))
        cols = torch.cat((i, i, h + i, h + i, rest))
        _ENTRIES[key] = (rows * width + cols).to(device)
    return _ENTRIES[key]
