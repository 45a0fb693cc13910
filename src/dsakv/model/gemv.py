"""The compiled float GEMV (`--compile`, EngineConfig.compile_decode): decode's few-row matmuls on one
torch.compile'd (inductor) reduction instead of the BLAS call.

A decode step at batch 1 is ~55 matmuls of one row against a weight read once (GEMVs); their time is the time
of reading the weights. On this project's CPU box the BLAS (MKL sgemm, M = 1) read them at ~10-16 GB/s, the
inductor reduction `(w[:, None, :] * x[None]).sum(-1)` at ~14-22 GB/s (a sum over 256 MiB: ~26 GB/s). Each weight
row is read once for all M rows of x (the output [N, M] is written N outer, M inner), so it also beats MKL's
small-M sgemm at 2-4 rows (x1.3-2.7: a decode batch's per-expert groups), but not at 8-16 rows (x0.6-1.5) where
the BLAS tiles for compute (bench/decode_compile.py measures the whole step). So only calls of at most ROWS rows
take it; every other call, and every call off CPU or in another dtype than float32, stays on F.linear / addmm:
the eager path is the reference, and the kernel's sums run in another order than the BLAS's (~1e-6 relative,
tests/inproc/test_decode_compile.py).

    use_compiled_gemv(True)          # process-wide, as quant.use_int8_gemv; each shape compiled on first use
    y = gemv(x, w)                   # x [M, K] @ w[N, K]^T, or None when the kernel does not apply

Whole decoder layers were not compiled: inductor leaves their matmuls to the same BLAS call (extern mm), so it
could only fuse the ~10% of the step outside them, and the per-expert MoE path's expert loop and the pool's
reads and writes are data-dependent graph breaks.
Imports torch only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

ROWS = 4  # calls of at most this many rows take the compiled kernel (more: the BLAS matmul)
_ON = [False]  # use_compiled_gemv
_KERNELS: dict[tuple[int, ...], Callable[..., Any]] = {}  # (rows, N, K, w strides, threads) -> compiled kernel
_LOCK = threading.Lock()


def _gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """(x [M, K] @ w[N, K]^T)^T = [N, M] as one reduction over K. Inductor writes the output in memory order, so
    with N outer and M inner each weight row is read from memory once and reused from L1 for the M rows of x."""
    return (w[:, None, :] * x[None, :, :]).sum(-1)


def use_compiled_gemv(on: bool) -> None:
    """Turn the compiled float GEMV on (each shape compiled on first use: seconds each, cached on disk by
    inductor) or off (every matmul on the BLAS: the reference)."""
    _ON[0] = on


def compiled_gemv_on() -> bool:
    return _ON[0]


def _kernel(
    rows: int, w: torch.Tensor, fn: Callable[..., Any] = _gemv, x_shape: tuple[int, ...] = ()
) -> Callable[..., Any]:
    """The kernel `fn` for x [rows, K] contiguous (or x of x_shape) and a weight of w's shape and strides (any
    storage offset).

    Compiled by inductor from the traced graph of one static shape, without dynamo: no guards are evaluated per
    call (a dynamo-compiled function spent ~20 us a call on them, and with the weights' varying strides and offsets
    it kept several guarded graphs per shape); the shape key is this dict's."""
    kind = _KINDS.index(fn)
    key = (kind, rows, *x_shape, *w.shape, *w.stride(), torch.get_num_threads())  # inductor parallelises for them
    f = _KERNELS.get(key)
    if f is None:
        import torch._inductor as inductor
        from torch.fx.experimental.proxy_tensor import make_fx

        with _LOCK, torch.inference_mode(False), torch.no_grad():
            f = _KERNELS.get(key)
            if f is None:
                x0 = torch.zeros(x_shape or (rows, int(w.shape[-1])), dtype=w.dtype, device=w.device)
                w0 = torch.empty_strided(tuple(w.shape), w.stride(), dtype=w.dtype, device=w.device)
                f = _KERNELS[key] = inductor.compile(make_fx(fn)(x0, w0), [x0, w0])
    return f


def _bgemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per batch entry b: x[b] [M, K] @ w[b] [N, K]^T, written [B, N, M] (each weight row read once, as _gemv)."""
    return (w[:, :, None, :] * x[:, None, :, :]).sum(-1)


def _bgemv_kn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per batch entry b: x[b] [M, K] @ w[b] [K, N] -> [B, M, N], a weight whose N dimension is contiguous."""
    return (x[:, :, :, None] * w[:, None, :, :]).sum(2)


_KINDS = (_gemv, _bgemv, _bgemv_kn)


def bmm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch.bmm(x [B, M, K], w [B, K, N]) -> [B, M, N]: on a compiled kernel when it is on and applies (float32
    on CPU, at most ROWS rows, w a view with its K or its N dimension contiguous: the absorbed attention's per-head
    W_UK and W_UV^T at decode), else torch.bmm itself (the reference). The result may be a non-contiguous view."""
    if (
        not _ON[0]
        or x.dtype != torch.float32
        or w.dtype != torch.float32
        or x.device.type != "cpu"
        or w.device != x.device
        or x.dim() != 3
        or w.dim() != 3
        or not 0 < x.shape[1] <= ROWS
    ):
        return torch.bmm(x, w)
    xc = x.contiguous()
    if w.stride(1) == 1:  # a transposed [B, N, K] weight (W_UV^T): rows of K contiguous, read once each
        wt = w.transpose(1, 2)
        y: torch.Tensor = _kernel(0, wt, _bgemv, tuple(xc.shape))(xc, wt.detach())  # [B, N, M]
        return y.transpose(1, 2)
    if w.stride(2) == 1:  # [B, K, N] rows of N contiguous (W_UK)
        out: torch.Tensor = _kernel(0, w, _bgemv_kn, tuple(xc.shape))(xc, w.detach())
        return out
    return torch.bmm(x, w)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] @ w [N, K]^T on the compiled kernel ([..., N]), or None unless it is on and applies: float32 x
    and w on CPU, at most ROWS rows, w's last dimension contiguous (the caller then runs its BLAS matmul)."""
    if not _ON[0] or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
        return None
    k = x.shape[-1]
    rows = x.numel() // max(1, k)
    if rows > ROWS or rows == 0 or w.dim() != 2 or w.stride(1) != 1 or w.device != x.device:
        return None
    y: torch.Tensor = _kernel(rows, w)(x.reshape(rows, k).contiguous(), w.detach())  # [N, M]
    return y.t().contiguous().view(*x.shape[:-1], w.shape[0])  # one row: already contiguous, no copy
