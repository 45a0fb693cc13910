"""Page rows: every buffer of one page laid end to end, and vectorised copies to and from a DevicePool.

A *page row* is the `page_first` format a storage tier or a transfer wants: the
pages of all buffers of one page id, one after the other in `layout.buffers`
order (with elision, a shared layer simply has no INDEX_K segment):

    | L0/kv page | L0/index_k page | L1/kv page | L1/index_k page | ... | L3/kv page | L4/kv page | ...
    ^ 0          ^ offset(L0/index_k)                                  (layer 3 is shared: no index_k)

Copies are one index_select / index_copy_ per buffer, never a Python loop per page, on the widest integer
view the byte layout allows (a uint8 index_copy_ moves one byte per element and is ~7x slower on CPU).
Imports torch and dsakv.spec/cache only; must not import model or engine.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.spec.layout import BufferKey, KVLayout


@lru_cache(maxsize=64)
def row_offsets(layout: KVLayout) -> dict[BufferKey, tuple[int, int]]:
    """{key: (byte offset in a page row, page bytes)} for every buffer of `layout`, in layout order."""
    out: dict[BufferKey, tuple[int, int]] = {}
    off = 0
    for b in layout.buffers:
        out[b.key] = (off, b.page_bytes)
        off += b.page_bytes
    assert off == layout.bytes_per_page
    return out


def as_index(ids: npt.ArrayLike | torch.Tensor, device: torch.device | str = "cpu") -> torch.Tensor:
    """Page ids (numpy array, list or tensor) as an int64 tensor on `device`."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device=device, dtype=torch.int64)
    return torch.as_tensor(np.asarray(ids, dtype=np.int64), device=device)


def _widest(*ts: torch.Tensor) -> torch.dtype:
    for dtype, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if all(
            t.shape[-1] % size == 0
            and (t.dim() < 2 or t.stride(0) % size == 0)
            and t.storage_offset() % size == 0
            and t.data_ptr() % size == 0
            for t in ts
        ):
            return dtype
    return torch.uint8


def take(src: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """src[idx] for a uint8 [pages, bytes] tensor (possibly a strided column slice): a contiguous uint8 copy."""
    dtype = _widest(src)
    if dtype is torch.uint8:
        return src.index_select(0, idx)
    return src.view(dtype).index_select(0, idx).view(torch.uint8)


def put(dst: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> None:
    """dst[idx] = src for uint8 [pages, bytes] tensors (dst possibly a strided column slice), in place."""
    dtype = _widest(dst, src)
    if dtype is torch.uint8:
        dst.index_copy_(0, idx, src)
    else:
        dst.view(dtype).index_copy_(0, idx, src.view(dtype))


def run_start(idx: torch.Tensor) -> int | None:
    """The first id when `idx` (a CPU index) is a run of consecutive page ids, else None."""
    n = idx.numel()
    if n == 0 or idx.device.type != "cpu":
        return None
    first = int(idx[0])
    if int(idx[-1]) - first != n - 1 or (n > 1 and not bool(torch.all(idx[1:] - idx[:-1] == 1))):
        return None
    return first


def copy_pages(dst: torch.Tensor, dst_idx: torch.Tensor, src: torch.Tensor, src_idx: torch.Tensor) -> None:
    """dst[dst_idx] = src[src_idx] for uint8 [pages, bytes] tensors, on one device or across devices (host <->
    GPU); `dst_idx` / `src_idx` are CPU int64 indices. A side that is a run of consecutive pages is copied as one
    slice (one copy, straight into or out of pinned host memory), otherwise pages are gathered and scattered."""
    n = src_idx.numel()
    if n != dst_idx.numel():
        raise ValueError(f"copy_pages: {n} source pages but {dst_idx.numel()} destination pages")
    if n == 0:
        return
    s0, d0 = run_start(src_idx), run_start(dst_idx)
    if s0 is not None:
        rows = src[s0 : s0 + n]
    elif d0 is not None and dst.device == src.device and dst[d0 : d0 + n].is_contiguous():
        out = dst[d0 : d0 + n]
        dtype = _widest(out, src)
        torch.index_select(src.view(dtype), 0, src_idx.to(src.device), out=out.view(dtype))
        return
    else:
        rows = take(src, src_idx.to(src.device))
    if d0 is not None:
        dst[d0 : d0 + n].copy_(rows)
    else:
        put(dst, dst_idx.to(dst.device), rows.to(dst.device))


def gather_rows(pool: DevicePool, ids: npt.ArrayLike | torch.Tensor) -> torch.Tensor:
    """Pages `ids` of every buffer of `pool` as page rows: uint8 [len(ids), bytes_per_page] on the pool's device."""
    idx = as_index(ids, pool.device)
    rows = torch.empty((idx.numel(), pool.layout.bytes_per_page), dtype=torch.uint8, device=pool.device)
    for key, (off, nbytes) in row_offsets(pool.layout).items():
        rows[:, off : off + nbytes] = take(pool.tensor(key), idx)
    return rows


def scatter_rows(pool: DevicePool, ids: npt.ArrayLike | torch.Tensor, rows: torch.Tensor) -> None:
    """Write page rows [len(ids), bytes_per_page] into pages `ids` of every buffer of `pool`."""
    idx = as_index(ids, pool.device)
    if rows.shape != (idx.numel(), pool.layout.bytes_per_page):
        raise ValueError(
            f"page rows of shape {tuple(rows.shape)} do not match {idx.numel()} pages x "
            f"{pool.layout.bytes_per_page} bytes per page"
        )
    rows = rows.to(pool.device)
    for key, (off, nbytes) in row_offsets(pool.layout).items():
        put(pool.tensor(key), idx, rows[:, off : off + nbytes])
