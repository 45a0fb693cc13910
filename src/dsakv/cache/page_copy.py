"""Page rows: every buffer of one page laid end to end, and vectorised copies to and from a DevicePool.

A *page row* is the `page_first` format a storage tier or a transfer wants: the
pages of all buffers of one page id, one after the other in `layout.buffers`
order (with elision, a shared layer simply has no INDEX_K segment):

    | L0/kv page | L0/index_k page | L1/kv page | L1/index_k page | ... | L3/kv page | L4/kv page | ...
    ^ 0          ^ offset(L0/index_k)                                  (layer 3 is shared: no index_k)

Copies are one index_select / index_copy_ per buffer, never a Python loop per page.
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


def gather_rows(pool: DevicePool, ids: npt.ArrayLike | torch.Tensor) -> torch.Tensor:
    """Pages `ids` of every buffer of `pool` as page rows: uint8 [len(ids), bytes_per_page] on the pool's device."""
    idx = as_index(ids, pool.device)
    rows = torch.empty((idx.numel(), pool.layout.bytes_per_page), dtype=torch.uint8, device=pool.device)
    for key, (off, nbytes) in row_offsets(pool.layout).items():
        rows[:, off : off + nbytes] = pool.tensor(key).index_select(0, idx)
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
        pool.tensor(key).index_copy_(0, idx, rows[:, off : off + nbytes])
