"""The per-request and per-step row records of a HiSparse pool, and the byte-row views its copies go through."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dsakv.cache.formats import Codec

RequestId = Hashable


@dataclass
class _Request:
    block: int
    pages: np.ndarray
    length: int


@dataclass
class _StepRows:
    """The rows `prepare` was given for one step, as arrays: request ids, hot blocks, token counts after the
    step, and their logical pages (a padded page table)."""

    rids: list[RequestId]
    blocks: np.ndarray  # int64 [B]
    lengths: np.ndarray  # int64 [B]
    pages: np.ndarray  # int64 [B, max pages] (-1 beyond a request's pages)


@dataclass
class SwapRows:
    """The requests of one swap-in, as int64 tensors on the pool's device (built once per step by
    HiSparsePool.swap_rows_of, in one host -> device copy, and used by every producer group): hot blocks [D], token
    counts [D] (and as a column [D, 1]), logical pages [D, max pages] (-1 padding); derived: the first position of
    each newest page [D, 1], that minus the block column of its first row [D, 1], the first hot row of each block
    [D, 1], the first logical slot of each page [D, max pages]. `rids` names them for errors."""

    rids: Sequence[RequestId]
    blocks: torch.Tensor
    lengths: torch.Tensor
    lengths_col: torch.Tensor
    pages: torch.Tensor
    newest: torch.Tensor
    newest_shift: torch.Tensor
    base: torch.Tensor
    page_starts: torch.Tensor


def _row_dtype(codec: Codec) -> torch.dtype:
    """The dtype a single-segment codec's byte rows are viewed as: float32 for fp32 (values as stored), else the
    widest word that divides the row."""
    if codec.fmt == "fp32":
        return torch.float32
    w = codec.bytes_per_token
    return torch.int64 if w % 8 == 0 else torch.int32 if w % 4 == 0 else torch.uint8


def _encode_rows(codec: Codec, values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [N, dim] -> rows [N, w] of `dtype` (see _row_dtype) for a single-segment codec."""
    if dtype is torch.float32 and codec.fmt == "fp32":
        return values if values.dtype is torch.float32 else values.float()
    return codec.encode(values)[0].view(dtype)


def _decode_rows(codec: Codec, rows: torch.Tensor) -> torch.Tensor:
    """Rows gathered from a _row_dtype view -> float32 values [N, dim]."""
    if rows.dtype is torch.float32 and codec.fmt == "fp32":
        return rows
    return codec.decode([rows.view(torch.uint8)])
