"""Weight quantisation: int8 weight-only (per output channel) and fp8 e4m3 block-scaled (128 x 128, as the
production DeepSeek-V3.2 / GLM-5.x checkpoints ship it, `weight_scale_inv`).

    q, scale = quantize_int8(w)            # int8 [N, K], float32 [N]:  w ~ q * scale[:, None]
    q, scale_inv = quantize_fp8_block(w)   # float8_e4m3fn [N, K], float32 [ceil(N/128), ceil(K/128)]
    quantize_weights(model, "int8")        # every projection of a DSAModel (or MTPDraft) on the int8 grid

`quantize_weights` replaces each projection weight (attention, indexer wq_b / wk, dense and expert MLPs,
lm_head) by its dequantised value in the model's dtype, so the model computes with exactly the quantised
model's weights (what `--weight-dtype int8|fp8` gives: the quantised model's numerics and tokens). It does not
keep the narrow storage: matmuls still stream weights in the model's dtype. Embeddings, norms, the router and
the indexer's weights_proj (float32 in transformers too) are left as they are.
Imports torch only (and dsakv.errors).
"""

from __future__ import annotations

import torch
from torch import nn

from dsakv.errors import ConfigError

WEIGHT_DTYPES = ("model", "int8", "fp8")
FP8_BLOCK = 128
INT8_MAX = 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn

# projections left in full precision: the router picks experts from tiny logit gaps; weights_proj is fp32 in
# transformers; embed_tokens is a table lookup, not a matmul
KEEP_FULL = ("mlp.gate.weight", "indexer.weights_proj.weight", "embed_tokens.weight")


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
