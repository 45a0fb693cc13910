"""Page rows: every buffer of one page laid end to end, and vectorised copies to and from a DevicePool.

A *page row* is the `page_first` format a storage tier or a transfer wants: the
pages of all buffers of one page id, one after the other in `layout.buffers`
order (with elision, a shared layer simply has no INDEX_K segment):

    | L0/kv page | L0/index_k page | L1/kv page | L1/index_k page | ... | L3/kv page | L4/kv page | ...
    ^ 0          ^ offset(L0/index_k)                                  (layer 3 is shared: no index_k)

Copies are one index_select / index_copy_ per buffer, never a Python loop per page, on the widest integer
view the byte layout allows (a uint8 index_copy_ moves one byte per element and is ~7x slower on CPU).

Host <-> host-memory copies of many buffers (`copy_page_set`: a HostPool's offload / load with a CPU
DevicePool) go straight from source to destination in one pass: the page-id pairs are coalesced once into
runs consecutive on both sides, and each run of each buffer is one memmove (a run of rows that are
contiguous on both sides is one memmove of run x page bytes; a strided column slice moves page by page).
An index_select + index_copy_ pair reads and writes everything twice; this runs at memcpy speed
(bench/hicache.py). Page ids are bounds-checked first: nothing is copied for an id outside either tensor.

The memmoves run in C (cache/native.py's copy_runs, compiled on first use), called once per copy_page_set
with two int64 tables, one row per buffer (dst address, dst row stride, src address, src row stride, row bytes)
and one row per run (dst page, src page, pages). Python costs ~1 us per (buffer, run) with ctypes.memmove
(99 buffers x 16 runs ~ 2 ms per 53 MiB copy); the C loop costs nothing measurable. Without a compiler (or
with DSAKV_NO_NATIVE=1) the same loop runs in Python after one warning: same bytes, slower. A copy of at least
STREAM_BYTES (8 MiB, beyond what caches keep) uses non-temporal stores (SSE2 streaming, as glibc's memcpy does for
one large copy): a plain store of a ~35 KiB page slice reads the destination line first, which costs ~25% of the
bandwidth (0.75x of a plain copy with memmove, 0.85-0.9x streaming; bench/hicache.py).
With `threads` > 1 the buffers are split over a thread pool (ctypes releases the GIL); it pays only for
copies of several MiB on a machine with idle cores, so the default is 1 (COPY_THREADS).
Imports torch and dsakv.spec/cache only; must not import model or engine.
"""

from __future__ import annotations

import ctypes
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache import native
from dsakv.cache.device_pool import DevicePool
from dsakv.spec.layout import BufferKey, KVLayout

COPY_THREADS = 1  # threads for copy_page_set (see the module docstring)
STREAM_BYTES = 8 << 20  # copies at least this large use non-temporal stores (see the module docstring)
_POOL: ThreadPoolExecutor | None = None
_memmove = ctypes.memmove


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


def page_runs(dst_idx: npt.ArrayLike, src_idx: npt.ArrayLike) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst starts, src starts, lengths) of the maximal runs consecutive in both id lists (same length)."""
    d = np.asarray(dst_idx, dtype=np.int64).reshape(-1)
    s = np.asarray(src_idx, dtype=np.int64).reshape(-1)
    if d.size != s.size:
        raise ValueError(f"copy: {s.size} source pages but {d.size} destination pages")
    if d.size == 0:
        return d, s, d
    brk = np.flatnonzero((np.diff(d) != 1) | (np.diff(s) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [d.size])))
    return d[starts], s[starts], lens


def _check_ids(ids: np.ndarray, t: torch.Tensor, side: str) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= t.shape[0]):
        raise IndexError(
            f"{side} page ids span {int(ids.min())}..{int(ids.max())} but the {side} buffer has pages "
            f"0..{t.shape[0] - 1}: nothing was copied"
        )


def _row_geometry(t: torch.Tensor) -> tuple[int, int, int]:
    """(base address, row stride bytes, row bytes) of a CPU uint8 [pages, bytes] tensor with unit column stride."""
    if t.device.type != "cpu" or t.dtype != torch.uint8 or t.dim() != 2 or (t.shape[1] > 1 and t.stride(1) != 1):
        raise ValueError(f"copy_page_set copies CPU uint8 [pages, bytes] row tensors, got {t.dtype} {t.shape}")
    return t.data_ptr(), t.stride(0), t.shape[1]


def copy_page_set(
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    dst_idx: npt.ArrayLike | torch.Tensor,
    src_idx: npt.ArrayLike | torch.Tensor,
    threads: int | None = None,
) -> int:
    """For every (dst, src) in `pairs`: dst[dst_idx] = src[src_idx] (CPU uint8 [pages, bytes]); returns bytes.

    One pass, source to destination: runs consecutive on both sides are found once and each is one memmove
    per buffer (see the module docstring).
    """
    d_ids = dst_idx.cpu().numpy() if isinstance(dst_idx, torch.Tensor) else np.asarray(dst_idx, dtype=np.int64)
    s_ids = src_idx.cpu().numpy() if isinstance(src_idx, torch.Tensor) else np.asarray(src_idx, dtype=np.int64)
    d0, s0, lens = page_runs(d_ids, s_ids)
    if lens.size == 0:
        return 0
    geo = np.empty((len(pairs), 5), dtype=np.int64)
    for i, (dst, src) in enumerate(pairs):
        if dst.shape[1] != src.shape[1]:
            raise ValueError(f"copy: destination pages of {dst.shape[1]} bytes but source pages of {src.shape[1]}")
        _check_ids(d_ids, dst, "destination")
        _check_ids(s_ids, src, "source")
        (da, ds, w), (sa, ss, _) = _row_geometry(dst), _row_geometry(src)
        geo[i] = (da, ds, sa, ss, w)
    runs = np.ascontiguousarray(np.stack([d0, s0, lens], axis=1), dtype=np.int64)
    n = int(lens.sum())
    ext = native.lib()
    stream = int(n * sum(dst.shape[1] for dst, _ in pairs) >= STREAM_BYTES)

    def move(g: np.ndarray) -> None:
        if g.shape[0] == 0:
            return
        if ext is not None:
            g = np.ascontiguousarray(g)
            ext.dsakv_copy_runs(g.shape[0], g.ctypes.data, runs.shape[0], runs.ctypes.data, stream)
            return
        run_list = runs.tolist()
        for da, ds, sa, ss, w in g.tolist():
            if ds == w and ss == w:  # rows contiguous on both sides: a run is one block
                for d, s, k in run_list:
                    _memmove(da + d * w, sa + s * w, k * w)
            else:
                for d, s, k in run_list:
                    for i in range(k):
                        _memmove(da + (d + i) * ds, sa + (s + i) * ss, w)

    threads = COPY_THREADS if threads is None else threads
    if threads > 1 and len(pairs) > 1:
        global _POOL
        if _POOL is None or _POOL._max_workers != threads:
            _POOL = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dsakv-copy")
        list(_POOL.map(move, [geo[i::threads] for i in range(threads)]))
    else:
        move(geo)
    return n * sum(dst.shape[1] for dst, _ in pairs)
