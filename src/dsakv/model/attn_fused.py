"""`--compile`'s attention input as one compiled call at decode (`attn_in`): MLAttention.forward's projections
from the normed hidden state up to the query, the new KV row and the new index key.

Eager, that chain is ~25 framework calls a layer (the fused x projection q_a | kv_a (| indexer wk | weights_proj),
two RMSNorms, the q projection q_b (| indexer wq_b), the views and splits, two rope products, the cat of the KV
row, the indexer's LayerNorm and rope): ~0.1 ms of Python and dispatch per layer beside ~0.3 ms of reading its
weights at batch 1. `attn_in` runs all of it as one inductor-compiled call over static shapes, each projection a
reduction that reads its weight rows once (as gemv.py's kernel).

    out = attn_in(attn, x, ctx)   # AttnIn for x [T <= gemv.ROWS, hidden], or None where it does not apply

Applies with `--compile` on (gemv.compiled_gemv_on), float32 on CPU, at most gemv.ROWS rows, float weights fused
without bias (LinearGroup.plain_weight); every other call takes the eager path (the reference). Sums in another
order than eager (~1e-6 relative, tests/inproc/test_decode_fused.py). Imports torch and dsakv.model.gemv only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dsakv.model import gemv


@dataclass
class AttnIn:
    q_nope: torch.Tensor  # [T, H, nope]
    q_rot: torch.Tensor  # [T, H, rope]: roped
    kv_row: torch.Tensor  # [T, r + rope]: the pool's KV row, [latent | roped k]
    q_resid: torch.Tensor  # [T, q_lora_rank]: the normed q_a output (the indexer's input)
    index: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # producers: (wq_b(q_resid), wk(x), weights_proj(x))
    index_key: torch.Tensor | None  # producers: [T, index_head_dim], normed and roped


def _rope(v: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """v [T, N, W] @ rot [T, W, W] per token (torch.bmm's product) as one reduction."""
    return (v[:, :, :, None] * rot[:, None, :, :]).sum(-2)


@functools.cache
def _attn_in_fn(spec: tuple[Any, ...]):  # type: ignore[no-untyped-def]
    heads, nope, rope, rank, q_rank, q_eps, kv_eps, producer, ix = spec

    def attn_in(*a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x, w_x, q_norm, kv_norm, w_q, rot = a[:6]
        y = (w_x[None, :, :] * x[:, None, :]).sum(-1)  # [T, Nx]: q_a | kv_a (| wk | weights_proj)
        q_resid = F.rms_norm(y[:, :q_rank], (q_rank,), q_norm, q_eps)
        kv = y[:, q_rank : q_rank + rank + rope]
        latent = F.rms_norm(kv[:, :rank], (rank,), kv_norm, kv_eps)
        k_rot = _rope(kv[:, None, rank:], rot)[:, 0]
        z = (w_q[None, :, :] * q_resid[:, None, :]).sum(-1)  # [T, Nq]: q_b (| wq_b)
        t = int(x.shape[0])
        q = z[:, : heads * (nope + rope)].view(t, heads, nope + rope)
        q_rot = _rope(q[:, :, nope:], rot)
        out = (q[:, :, :nope].contiguous(), q_rot, torch.cat((latent, k_rot), dim=-1), q_resid)
        if not producer:
            return out
        ix_heads, ix_dim, k_eps = ix
        ix_rot, k_w, k_b = a[6:9]
        base = q_rank + rank + rope
        k_raw, w_raw = y[:, base : base + ix_dim], y[:, base + ix_dim : base + ix_dim + ix_heads]
        key = _rope(F.layer_norm(k_raw, (ix_dim,), k_w, k_b, k_eps)[:, None, :], ix_rot)[:, 0]
        q_raw = z[:, heads * (nope + rope) :]
        return (*out, q_raw, k_raw, w_raw, key)

    return attn_in


def attn_in(attn: Any, x: torch.Tensor, ctx: Any) -> AttnIn | None:
    """MLAttention `attn`'s input chain for x [T, hidden] as one compiled call (see the module docstring), or None
    unless `--compile` is on and it applies."""
    if (
        not gemv.compiled_gemv_on()
        or x.dim() != 2
        or not 0 < x.shape[0] <= gemv.ROWS
        or x.dtype != torch.float32
        or x.device.type != "cpu"
    ):
        return None
    w_x, w_q = attn._x_proj.plain_weight(), attn._q_proj.plain_weight()
    qn, kn = attn.q_a_layernorm, attn.kv_a_layernorm
    ins = [
        x if x.is_contiguous() else x.contiguous(),
        w_x,
        qn.weight,
        kn.weight,
        w_q,
        ctx.rope(attn.rope_dim, True, x.dtype),
    ]
    ix = attn.indexer
    ix_spec: tuple[Any, ...] = ()
    if ix is not None:
        ins += [ctx.rope(ix.head_dim, ix.interleaved, x.dtype), ix.k_norm.weight, ix.k_norm.bias]
        ix_spec = (ix.n_heads, ix.head_dim, float(ix.k_norm.eps))
    if any(t is None or t.dtype != torch.float32 or t.device != x.device for t in ins):
        return None
    spec = (
        attn.num_heads,
        attn.nope,
        attn.rope_dim,
        attn.kv_lora_rank,
        int(qn.weight.shape[0]),
        float(qn.eps),
        float(kn.eps),
        ix is not None,
        ix_spec,
    )
    key = ("attn_in", *spec, *(s for t in ins for s in (*t.shape, *t.stride())))
    out = gemv._compiled(key, _attn_in_fn(spec), lambda: tuple(ins))(ins)
    if ix is None:
        return AttnIn(out[0], out[1], out[2], out[3], None, None)
    return AttnIn(out[0], out[1], out[2], out[3], (out[4], out[5], out[6]), out[7])
