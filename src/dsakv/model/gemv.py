"""The compiled float GEMV (`--compile`, EngineConfig.compile_decode): decode's few-row matmuls on one
torch.compile'd (inductor) reduction instead of the BLAS call.

A decode step at batch 1 is ~55 matmuls of one row against a weight read once (GEMVs); their time is the time
of reading the weights. On this project's CPU box the BLAS (MKL sgemm, M = 1) read them at ~10-16 GB/s, the
inductor reduction `(w[:, None, :] * x[None]).sum(-1)` at ~14-22 GB/s (a sum over 256 MiB: ~26 GB/s). Each weight
row is read once for all M rows of x (the output [N, M] is written N outer, M inner), so it also beats MKL's
small-M sgemm at 2-4 rows (x1.3-2.7: a decode batch's per-expert groups), but not at 8-16 rows (x0.6-1.5) where
the BLAS tiles for compute (bench/decode_compile.py measures the whole step). So calls of 2 to ROWS rows take it,
one row and ROWS + 1 .. 16 rows the C kernel (model/native: at one row 8 weight rows streamed side by side, x1.2
inductor's reduction cold on a 8192 x 1024 lm_head, bench/small_gemm.py --rows 1); every other call, and every
call off CPU or in another dtype than float32, stays on F.linear / addmm:
the eager path is the reference, and the kernel's sums run in another order than the BLAS's (~1e-6 relative,
tests/inproc/test_decode_compile.py).

    use_compiled_gemv(True)          # process-wide, as quant.use_int8_gemv; each shape compiled on first use
    y = gemv(x, w)                   # x [M, K] @ w[N, K]^T, or None when the kernel does not apply
    y = bmm(x, w)                    # torch.bmm(x [B, M, K], w [B, K, N]): the absorbed attention's per-head W_UK
                                     # and W_UV^T (weight views, ~2x MKL's per-head M=1 calls); torch.bmm elsewhere
    y = rms_norm(x, weight, eps)     # one kernel for F.rms_norm's ~7 ATen ops (~5 us a call against ~10), or None

Each kernel is inductor's generated module called directly (compile_fx_inner's `call([inputs])`: ~2 us a call,
against ~5.5 through inductor.compile's AOT runtime wrapper); its inputs always have the traced shapes and
strides (the kernel's key), which the generated call asserts.

Whole decoder layers were not compiled: inductor leaves their matmuls to the same BLAS call (extern mm), so it
could only fuse the ~10% of the step outside them, and the per-expert MoE path's expert loop and the pool's
reads and writes are data-dependent graph breaks.
Imports torch and dsakv.model.native (a CPU-only kernel: every entry point returns the eager result or None off CPU).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from dsakv.model.native import MAX_ROWS, bgemv_kn, small_gemm

ROWS = 4  # calls of 2 to this many rows take the compiled kernel (1 and 5-16: model/native's; more: the BLAS)
_ON = [False]  # use_compiled_gemv
_KERNELS: dict[tuple[Any, ...], Callable[..., Any]] = {}  # (kernel, shapes, strides, threads) -> compiled
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


def _compiled(
    key: tuple[Any, ...], fn: Callable[..., Any], like: Callable[[], tuple[torch.Tensor, ...]]
) -> Callable[..., Any]:
    """fn compiled for inputs of exactly the shapes, strides, dtype and device of like()'s (any storage offset;
    like is called on a miss only), called as kernel([inputs...])[i] (fn's i-th output; [0] of one); `key` names
    fn and those shapes (this dict's key; with the thread count: inductor parallelises for the threads it sees).

    Compiled by inductor from the traced graph of one static shape, without dynamo: no guards are evaluated per
    call (a dynamo-compiled function spent ~20 us a call on them, and with the weights' varying strides and offsets
    it kept several guarded graphs per shape)."""
    key = (*key, torch.get_num_threads())
    f = _KERNELS.get(key)
    if f is None:
        from torch._inductor.compile_fx import compile_fx_inner
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        with _LOCK, torch.inference_mode(False), torch.no_grad():
            f = _KERNELS.get(key)
            if f is None:
                ex = [torch.empty_strided(tuple(t.shape), t.stride(), dtype=t.dtype, device=t.device) for t in like()]
                for t in ex:
                    t.zero_()  # (the trace reads no values; deterministic inputs all the same)
                # (inductor's decompositions, as torch.compile traces: silu and the like lower to its own kernels)
                traced = make_fx(lambda *a: _outputs(fn(*a)), decomposition_table=select_decomp_table())(*ex)
                graph = compile_fx_inner(traced, ex)
                # the generated module's call([inputs]) itself: no AOT runtime wrapper (~4 us a call less); the
                # inputs always have the traced shapes and strides (the key), the kernel reads them unaligned
                f = _KERNELS[key] = getattr(graph, "current_callable", graph)
    return f


def _outputs(y: torch.Tensor | tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """A kernel's outputs as the flat tuple the compiled call returns (one tensor: a 1-tuple)."""
    return y if isinstance(y, tuple) else (y,)


def _kernel(rows: int, w: torch.Tensor, fn: Callable[..., torch.Tensor] = _gemv, x: torch.Tensor | None = None):
    """The kernel `fn` for x [rows, K] contiguous (or x's shape) and a weight of w's shape and strides."""
    xs = (rows, int(w.shape[-1])) if x is None else tuple(x.shape)
    return _compiled((fn.__name__, *xs, *w.shape, *w.stride()), fn, lambda: (w.new_empty(xs), w))


def _bgemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per batch entry b: x[b] [M, K] @ w[b] [N, K]^T, written [B, N, M] (each weight row read once, as _gemv)."""
    return (w[:, :, None, :] * x[:, None, :, :]).sum(-1)


def _bgemv_kn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per batch entry b: x[b] [M, K] @ w[b] [K, N] -> [B, M, N], a weight whose N dimension is contiguous."""
    return (x[:, :, :, None] * w[:, None, :, :]).sum(2)


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
        or x.shape[0] != w.shape[0]  # (the kernel would broadcast where torch.bmm raises)
        or x.shape[2] != w.shape[1]
    ):
        return torch.bmm(x, w)
    if w.stride(1) == 1:  # a transposed [B, N, K] weight (W_UV^T): rows of K contiguous, read once each
        xc, wt = x.contiguous(), w.transpose(1, 2)
        y: torch.Tensor = _kernel(0, wt, _bgemv, xc)([xc, wt])[0]  # [B, N, M]
        return y.transpose(1, 2)
    if w.stride(2) == 1:  # [B, K, N] rows of N contiguous (W_UK): the C kernel reads them in memory order
        out = bgemv_kn(x, w)  # (x as strided as it comes; inductor's reduction over K read w at ~7 GB/s)
        if out is None:
            xc = x.contiguous()
            out = _kernel(0, w, _bgemv_kn, xc)([xc, w])[0]
        return out
    return torch.bmm(x, w)


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] @ w [N, K]^T on the compiled kernel ([..., N]), or None unless it is on and applies: float32 x
    and w on CPU, at most ROWS rows (one row and ROWS + 1 .. native.MAX_ROWS: the C kernel), w's last
    dimension contiguous (the caller then runs its BLAS matmul)."""
    if not _ON[0] or x.dtype != torch.float32 or w.dtype != torch.float32 or x.device.type != "cpu":
        return None
    k = x.shape[-1]
    rows = x.numel() // max(1, k)
    if rows > MAX_ROWS or rows == 0 or w.dim() != 2 or w.stride(1) != 1 or w.device != x.device:
        return None
    xc = x if x.dim() == 2 and x.is_contiguous() else x.reshape(rows, k).contiguous()
    if rows > ROWS or rows == 1:  # 1 and 5-16 rows: the C kernel (model/native), or None (the BLAS)
        z = small_gemm(xc, w)
        return None if z is None else z.view(*x.shape[:-1], w.shape[0])
    y: torch.Tensor = _kernel(rows, w)([xc, w])[0]  # [N, M]
    return y.t().contiguous().view(*x.shape[:-1], w.shape[0])


@functools.cache
def _rms(eps: float) -> Callable[..., torch.Tensor]:
    def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), w, eps)

    return rms_norm


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """F.rms_norm(x, weight, eps) as one compiled kernel, or None unless it is on and applies (float32 on CPU, at
    most ROWS rows: decode; eager, it is ~7 ATen ops a call). Its sum of squares runs in another order than eager's
    (~1e-7 relative)."""
    if not _ON[0] or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return None
    if x.dim() != 2 or not 0 < x.shape[0] <= ROWS or weight.device != x.device:
        return None
    key = ("rms_norm", eps, *x.shape, *x.stride(), *weight.shape, *weight.stride())
    y: torch.Tensor = _compiled(key, _rms(eps), lambda: (x, weight))([x, weight])[0]
    return y
