"""Weight quantisation: int8 weight-only (per output channel) and fp8 e4m3 block-scaled (128 x 128, as the
production DeepSeek-V3.2 / GLM-5.x checkpoints ship it, `weight_scale_inv`).

    q, scale = quantize_int8(w)            # int8 [N, K], float32 [N]:  w ~ q * scale[:, None]
    q, scale_inv = quantize_fp8_block(w)   # float8_e4m3fn [N, K], float32 [ceil(N/128), ceil(K/128)]
    quantize_weights(model, "int8")        # every projection of a DSAModel (or MTPDraft) on the int8 grid

`quantize_weights` replaces each projection weight (attention, indexer wq_b / wk, dense and expert MLPs,
lm_head) by its dequantised value in the model's dtype, so the model computes with exactly the quantised
model's weights (`--weight-dtype fp8`, and int8 on a sharded model: the quantised model's numerics and tokens,
matmuls streaming weights in the model's dtype). Embeddings, norms, the router and the indexer's weights_proj
(float32 in transformers too) are left as they are.

`pack_int8` keeps int8 storage instead (`--weight-dtype int8` on one rank): each projection's `weight` becomes the
int8 [N, K] tensor and a `weight_scale` buffer [N, 1] (float32) its per-channel scale, so the weights take a quarter
of their fp32 bytes. `qlinear(x, w, scale)` computes x @ (w * scale)^T for either form (scale None: plain F.linear,
or model/gemv.py's compiled GEMV for a few rows under `--compile`). With int8 it dequantises per call into x's dtype
(the same weights as quantize_weights, so the same results: any device) unless the int8 GEMV kernel is on
(`use_int8_gemv`) and the call has at most GEMV_ROWS rows: then one torch.compile'd reduction reads the int8 weights
directly (CPU; its sums run in another order than the BLAS's, ~1e-6 relative). A scale [N, nb] holds nb equal column
blocks' scales (the MoE's fused down weight: one block per expert). kv_b_proj stays in the model's dtype on the int8
grid: attention uses it as per-head views (W_UK, W_UV) in batched matmuls.
Imports torch only (and dsakv.errors, dsakv.model.gemv).
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.errors import ConfigError
from dsakv.model.gemv import gemv

WEIGHT_DTYPES = ("model", "int8", "fp8")
FP8_BLOCK = 128
INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# projections left in full precision: the router picks experts from tiny logit gaps; weights_proj is fp32 in
# transformers; embed_tokens is a table lookup, not a matmul
KEEP_FULL = ("mlp.gate.weight", "indexer.weights_proj.weight", "embed_tokens.weight")
# left on the int8 grid in the model's dtype by pack_int8: attention reads it as per-head views in batched matmuls
KEEP_UNPACKED = ("kv_b_proj.weight",)
GEMV_ROWS = 16  # the int8 GEMV kernel takes calls of at most this many rows (more: dequantise + BLAS matmul)
_GEMV: list = [None]  # the compiled kernel while use_int8_gemv(True)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (q int8 [N, K], scale float32 [N]) with w ~ q * scale[:, None];
    scale = max |row| / 127 (1 for an all-zero row), q = round(w / scale)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_int8 takes a 2-D weight [out, in], got shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, torch.ones_like(amax))
    q = torch.round(wf / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def _block_scale(scale: torch.Tensor, rows: int, cols: int, block: int) -> torch.Tensor:
    return scale.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]


def quantize_fp8_block(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn block-scaled: (q [N, K], scale_inv float32 [ceil(N/block), ceil(K/block)]) with
    w ~ q * scale_inv of its block; scale_inv = max |block| / 448 (1 for an all-zero block)."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8_block takes a 2-D weight [out, in], got shape {tuple(w.shape)}")
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    wf = torch.zeros(nr * block, nc * block, dtype=torch.float32, device=w.device)
    wf[:rows, :cols] = w.float()
    amax = wf.view(nr, block, nc, block).abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w.float() / _block_scale(scale_inv, rows, cols, block)).to(torch.float8_e4m3fn)
    return q, scale_inv


def dequantize_fp8_block(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.float32, block: int = FP8_BLOCK
) -> torch.Tensor:
    rows, cols = q.shape
    return (q.float() * _block_scale(scale_inv.float(), rows, cols, block)).to(dtype)


def round_trip(w: torch.Tensor, weight_dtype: str) -> torch.Tensor:
    """w on the `weight_dtype` grid, dequantised back to w's dtype ("model": w itself)."""
    if weight_dtype == "model":
        return w
    if weight_dtype == "int8":
        return dequantize_int8(*quantize_int8(w), dtype=w.dtype)
    if weight_dtype == "fp8":
        return dequantize_fp8_block(*quantize_fp8_block(w), dtype=w.dtype)
    raise ConfigError(f"weight dtype {weight_dtype!r} is unknown: use one of {', '.join(WEIGHT_DTYPES)}")


def quantize_weights(model: nn.Module, weight_dtype: str) -> int:
    """Put every projection weight of `model` (nn.Linear weights, named as in transformers) on the
    `weight_dtype` grid in place; returns how many were quantised ("model": none)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ConfigError(f"weight dtype {weight_dtype!r} is unknown: use one of {', '.join(WEIGHT_DTYPES)}")
    if weight_dtype == "model":
        return 0
    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or f"{name}.weight".endswith(KEEP_FULL):
                continue
            mod.weight.data = round_trip(mod.weight.data, weight_dtype).contiguous()
            n += 1
    return n


def pack_int8(model: nn.Module) -> int:
    """Every projection of `model` (as quantize_weights, less KEEP_UNPACKED) stored as int8: its `weight` the
    int8 [N, K] tensor, a `weight_scale` buffer [N, 1] float32 beside it; KEEP_UNPACKED ones on the int8 grid in
    the model's dtype. Returns how many were packed."""
    n = 0
    with torch.no_grad():
        for name, mod in model.named_modules():
            if not isinstance(mod, nn.Linear) or f"{name}.weight".endswith(KEEP_FULL):
                continue
            if f"{name}.weight".endswith(KEEP_UNPACKED):
                mod.weight.data = round_trip(mod.weight.data, "int8").contiguous()
                continue
            dtype = mod.weight.dtype
            q, scale = quantize_int8(mod.weight.data) if mod.weight.numel() else _empty_int8(mod.weight)
            mod.weight = nn.Parameter(q.contiguous(), requires_grad=False)
            mod.register_buffer("weight_scale", scale[:, None].contiguous())
            mod.__class__ = Int8Linear  # forward through qlinear; still an nn.Linear
            cast(Int8Linear, mod).model_dtype = dtype
            n += 1
    return n


def _empty_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An empty projection's (no shared expert: [hidden, 0]) int8 form: scale 1 per row."""
    return w.to(torch.int8), torch.ones(w.shape[0], dtype=torch.float32, device=w.device)


class Int8Linear(nn.Linear):
    """An nn.Linear after pack_int8: int8 `weight` [N, K], `weight_scale` [N, 1] float32; calls go through
    qlinear in the input's dtype; model_dtype is the dtype its weight had (the model's)."""

    weight_scale: torch.Tensor
    model_dtype: torch.dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return qlinear(x, self.weight, self.weight_scale, self.bias)


def linear_dtype(m: nn.Module) -> torch.dtype:
    """The dtype a projection computes in: its weight's, or the model's for an int8 one."""
    if isinstance(m, Int8Linear):
        return m.model_dtype
    return cast(torch.Tensor, m.weight).dtype


def weight_scale(m: nn.Module) -> torch.Tensor | None:
    """A projection's int8 scale [N, 1] (pack_int8), None if its weight is not int8."""
    s = getattr(m, "weight_scale", None)
    return s if isinstance(s, torch.Tensor) else None


def dequantize(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 w [N, K] with scale [N, nb] (nb equal column blocks) -> w * scale in `dtype`, computed in float32 as
    dequantize_int8 (the weights quantize_weights gives)."""
    n, k = w.shape
    nb = scale.shape[1]
    return (w.reshape(n, nb, k // nb).float() * scale.float()[:, :, None]).reshape(n, k).to(dtype)


def _gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    m, k = x.shape
    n, nb = scale.shape
    part = (x.view(m, 1, nb, k // nb) * w.view(1, n, nb, k // nb).to(x.dtype)).sum(-1)  # [M, N, nb]
    return (part * scale.to(x.dtype)).sum(-1)


def use_int8_gemv(on: bool) -> None:
    """Turn the compiled int8 GEMV kernel on (compiled on first use: tens of seconds) or off (dequantise + BLAS
    matmul for every call, the reference)."""
    if on:
        import torch._dynamo

        # one graph per input kind (1 or more rows, one or several scale blocks, contiguous or a column slice):
        # more than dynamo's default 8, and past its limit it would run _gemv eagerly ([M, N, K] products)
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    _GEMV[0] = torch.compile(_gemv, dynamic=True) if on else None


def qlinear(
    x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [..., K] @ (w * scale)^T (+ bias): F.linear when scale is None; int8 w [N, K] with scale [N, nb]
    otherwise (the compiled GEMV on CPU for at most GEMV_ROWS rows when on, else dequantised per call)."""
    if scale is None:
        y = gemv(x, w)  # the compiled float GEMV (--compile) for a few rows, else None
        if y is None:
            return F.linear(x, w, bias)
        return y if bias is None else y.add_(bias)
    kernel = _GEMV[0]
    if kernel is not None and gemv_applies(x):
        y = kernel(x.reshape(-1, x.shape[-1]), w.detach(), scale).view(*x.shape[:-1], w.shape[0])  # a Tensor
        return y if bias is None else y.add_(bias)
    return F.linear(x, dequantize(w, scale, x.dtype), bias)


def gemv_applies(x: torch.Tensor) -> bool:
    """Whether qlinear runs the int8 GEMV kernel for input x (on, CPU, float32, at most GEMV_ROWS rows)."""
    rows = x.numel() // max(1, x.shape[-1])
    return _GEMV[0] is not None and rows <= GEMV_ROWS and x.device.type == "cpu" and x.dtype == torch.float32
