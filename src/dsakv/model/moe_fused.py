"""The MoE router's choice as one function (`route`: Router.route's eager path and the fused kernel's), and
`--compile`'s one-call MoE for a batch-1 decode (`moe_one`).

A batch-1 MoE layer on the eager per-expert path is ~35 framework calls (the fused tail GEMV, a split, ~10 routing
ops, two host reads of the picked experts, then per expert a gate|up GEMV, chunk, silu, multiply, down GEMV, scale
and add; the shared down and the residual): ~0.2 ms of Python and dispatch per layer against ~1.3 ms of reading
its weights. `moe_one` runs all of it as one inductor-compiled call, static shapes, no host read: the picked
experts' weights are read through their ids inside the kernel (indirect loads from the stacked [E, 2I, hidden]
gate|up and [E, hidden, I] down weights; nothing gathered or copied), each weight row read once.

    y = moe_one(x, residual, f, gate)   # MoE.forward(x, residual) for x [1, hidden], or None where it does not apply
    y = moe_after_attention(o, o_proj, stream, norm_weight, eps, moe)  # + the o_proj, residual and RMSNorm before it

Applies with `--compile` on (gemv.compiled_gemv_on), one float32 token on CPU, float weights (not int8) and the
router fused into w_in; every other call takes the eager path (the reference). Sums in another order than eager
(its experts and the GEMVs' K; ~1e-6 relative, tests/inproc/test_decode_fused.py). Imports torch and
dsakv.model.gemv only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from dsakv.model import gemv


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores + the correction bias for the choice, group-limited top-k, the picked scores renormalised
    (norm) and scaled: (weights float32 [N, top_k], expert ids int64 [N, top_k]) of logits float32 [N, E].
    Out-of-place ops only (the fused kernel traces it)."""
    scores = logits.sigmoid()
    choice = scores + bias
    if topk_group < n_group:
        e = int(logits.shape[-1])
        per_group = e // n_group
        group_scores = choice.view(-1, n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter(1, group_idx, 1.0)
        score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, per_group).reshape(-1, e)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scaling, ids


@functools.cache
def _moe_one_fn(spec: tuple[Any, ...]):  # type: ignore[no-untyped-def]
    r, top_k, n_group, topk_group, norm, scaling, with_residual = spec[:7]
    after_attention = spec[7] if len(spec) > 7 else None  # moe_after_attention: the norm's eps

    def moe_one(*a: torch.Tensor) -> torch.Tensor:
        if after_attention is not None:  # o_proj + residual, then the post-attention RMSNorm, all in the call
            o, w_o, stream, norm_w = a[-4:]
            h = (w_o * o[0]).sum(-1) + stream[0]  # [hidden]: the residual stream after attention
            a = (F.rms_norm(h, (int(h.shape[0]),), norm_w, after_attention)[None], *a[1:6], h[None])
        x, tail, bias, gate_up, down, shared_down = a[:6]
        xv = x[0]  # [hidden]
        t = (tail * xv).sum(-1)  # router | shared gate | shared up: one reduction over hidden
        i_s = (int(t.shape[0]) - r) // 2
        weights, ids = route(t[None, :r], bias, top_k, n_group, topk_group, norm, scaling)
        inter = int(gate_up.shape[1]) // 2
        gu = (gate_up[ids[0]] * xv).sum(-1)  # [k, 2I]: each picked expert's gate | up, its weights read by id
        act = F.silu(gu[:, :inter]) * gu[:, inter:]
        y = (down[ids[0]] * act[:, None, :]).sum(-1)  # [k, hidden]
        routed = (y * weights[0][:, None]).sum(0)
        shared = F.silu(t[r : r + i_s]) * t[r + i_s :]
        out = (shared_down * shared).sum(-1) + routed  # the shared expert's down, plus the routed sum
        if with_residual:
            out = out + a[6][0]
        return out[None]

    return moe_one


def moe_after_attention(
    o: torch.Tensor, o_proj: torch.Tensor, stream: torch.Tensor, norm_weight: torch.Tensor, eps: float, moe: Any
) -> torch.Tensor | None:
    """A batch-1 decoder layer's tail as one compiled call: h = stream + o . o_proj^T (the attention's output
    projection onto the residual stream), then MoE.forward(rms_norm(h, norm_weight, eps), residual=h); or None
    unless moe_one applies (and o_proj is a float32 weight without bias). o [1, H * v]; stream [1, hidden]."""
    f = moe.one_token_weights()
    if (
        f is None
        or o.dim() != 2
        or o.shape[0] != 1
        or o.dtype != torch.float32
        or o_proj.dtype != torch.float32
        or norm_weight.dtype != torch.float32
        or stream.shape != (1, o_proj.shape[0])
        or o.device != o_proj.device
        or o_proj.stride(1) != 1
    ):
        return None
    tail = [o if o.is_contiguous() else o.contiguous(), o_proj, stream.contiguous(), norm_weight]
    return moe_one(stream, stream, f, moe.gate, (float(eps), tail))


def moe_one(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    f: Any,
    gate: Any,
    after_attention: tuple[float, list[torch.Tensor]] | None = None,
) -> torch.Tensor | None:
    """MoE.forward(x, residual) for one float32 token as one compiled call (see the module docstring), or None
    unless `--compile` is on and it applies. `f`: the MoE's MoEWeights; `gate`: its Router."""
    if (
        not gemv.compiled_gemv_on()
        or x.dim() != 2
        or x.shape[0] != 1
        or x.dtype != torch.float32
        or x.device.type != "cpu"
        or f.in_scale is not None
        or not f.router_rows
        or f.w_in.dtype != torch.float32
        or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype))
    ):
        return None
    bias = gate.e_score_correction_bias
    if bias.dtype != torch.float32 or bias.device != x.device:
        return None
    spec: tuple[Any, ...] = (
        f.router_rows,
        gate.top_k,
        gate.n_group,
        gate.topk_group,
        bool(gate.norm_topk_prob),
        float(gate.routed_scaling_factor),
        residual is not None,
    )
    xc = x if x.is_contiguous() else x.contiguous()
    ins = [xc, f.tail, bias, f.gate_up, f.down, f.shared_down]
    if residual is not None:
        ins.append(residual if residual.is_contiguous() else residual.contiguous())
    if after_attention is not None:  # (x and residual are placeholders of the stream: computed in the call)
        spec = (*spec, after_attention[0])
        ins += after_attention[1]
    key = ("moe_one", *spec, *(s for t in ins for s in (*t.shape, *t.stride())))
    y: torch.Tensor = gemv._compiled(key, _moe_one_fn(spec), lambda: tuple(ins))(ins)[0]
    return y
