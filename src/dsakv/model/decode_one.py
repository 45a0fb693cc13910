"""`--compile`'s batch-1 decode layer (`layer_one`): a decoder layer (MoE or dense MLP) of a one-token decode step as
two native calls, its inputs bound once per layer.

The generic layer at one token already runs its pieces fused (attn_fused.attn_in, native.bgemv_kn / mla_decode,
moe_fused.moe_after_attention), but each goes through the general code around it: the layer's and the
attention's branches, the step context's selections and masks, each kernel's applicability checks and its key
built from every input's shape and strides: ~0.4 ms of Python a layer beside ~1.7 ms of reading its weights, a
fifth of a batch-1 step on this machine. Here a layer is

    head (native)  native.decode_head: rms_norm(x), q_a | kv_a (| the index key), their norms and ropes, the KV row
                   (and a producer's index key) written into the pool's fp32 rows at the token's slot, q_b, q_nope .
                   W_UK per head, then the absorbed attention over the sequence's rows read in place (every causal
                   key: top-k covers them all)
    tail (native)  native.decode_tail: o_lat . W_UV per head, o_proj onto the residual stream, the post-attention
                   RMSNorm, the MoE (router, picked experts, shared expert) or the dense MLP, plus the stream

each one OpenMP parallel region whose GEMVs split their rows over the threads (x1.27 / x1.23 tokens per CPU-second
at 1 / 2 threads against the compiled chain, bench/decode_ops.py). Where a native call does not apply (sizes,
dtypes) the plan runs the earlier chain:

    A  (compiled)  rms_norm(x) -> attn_in's chain: the query's nope and roped parts, the KV row, the index key
       (writes)    the KV row (and a producer's index key) into the pool's fp32 rows at the token's slot
    W_UK (native)  q_nope . W_UK per head (bgemv_kn), the query [1, H, r + rope]
    core (native)  mla_decode over the sequence's rows read in place
    B  (compiled)  o_lat . W_UV per head, o_proj, the post-attention RMSNorm, moe_fused's one-token MoE or the dense
                   MLP, plus the stream (or the native tail where that applies)

with the kernels and their weight inputs looked up once per layer (`_Plan`, rebuilt when the thread count or a
weight changes; it holds no pool: the pool's rows are looked up per call). Applies with `--compile` on, one float32
token on CPU, no tensor parallelism, a decode step reading every causal key (index_topk >= S: the indexer need not
score), the pool's plain fp32 rows, a MoE layer that moe_fused takes (not its dense path) or a dense MLP, float
weights without bias; `layer_one` returns None otherwise (nothing written) and the caller runs the generic layer.
Its sums run in another order than the generic path's (~1e-6 relative; tokens equal: tests/inproc/test_decode_compile).
Imports torch, dsakv.cache, dsakv.spec, dsakv.model's layers and fused kernels only.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F

from dsakv.cache.kv_access import PoolAccess
from dsakv.model import gemv, native
from dsakv.model.attn_fused import _attn_in_fn
from dsakv.model.layers import MLP, MoE
from dsakv.model.moe_fused import _moe_one_fn
from dsakv.spec.layout import BufferKey, Kind


@functools.cache
def _a_fn(spec: tuple[Any, ...], eps: float):  # type: ignore[no-untyped-def]
    inner = _attn_in_fn(spec)

    def layer_in(x: torch.Tensor, ln: torch.Tensor, *a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = inner(F.rms_norm(x, (int(x.shape[1]),), ln, eps), *a)
        # q_nope [1, H, nope] as [H, 1, nope] (bgemv_kn's x), q_rot, the KV row (, the index key)
        return (out[0].transpose(0, 1).contiguous(), out[1], out[2], *((out[7],) if len(out) > 4 else ()))

    return layer_in


@functools.cache
def _b_fn(spec: tuple[Any, ...]):  # type: ignore[no-untyped-def]
    inner = _moe_one_fn(spec)

    def layer_out(o_lat: torch.Tensor, w_uv: torch.Tensor, *a: torch.Tensor) -> torch.Tensor:
        o = (w_uv[None] * o_lat[:, :, None, :]).sum(-1)  # [1, H, v]: o_lat . W_UV per head
        w_o, stream, norm_w = a[-3:]
        return inner(stream, *a[:-3], stream, o.reshape(1, -1), w_o, stream, norm_w)

    return layer_out


@functools.cache
def _b_dense_fn(eps: float):  # type: ignore[no-untyped-def]
    def layer_out(
        o_lat: torch.Tensor, w_uv: torch.Tensor, w_o: torch.Tensor, w_gu: torch.Tensor, w_down: torch.Tensor,
        stream: torch.Tensor, norm_w: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        o = (w_uv[None] * o_lat[:, :, None, :]).sum(-1).reshape(-1)  # [H * v]: o_lat . W_UV per head
        h = (w_o * o).sum(-1) + stream[0]  # [hidden]: the residual stream after attention
        xn = F.rms_norm(h, (int(h.shape[0]),), norm_w, eps)
        gu = (w_gu * xn).sum(-1)  # [2I]: gate | up
        inter = int(w_gu.shape[0]) // 2
        act = F.silu(gu[:inter]) * gu[inter:]
        return ((w_down * act).sum(-1) + h)[None]

    return layer_out


class _Plan:
    """One layer's bound kernels and weight inputs for `layer_one` (see the module docstring)."""

    def __init__(self, layer: Any, sig: tuple[Any, ...], f: Any, w_x: torch.Tensor, w_q: torch.Tensor) -> None:
        attn, moe = layer.self_attn, layer.mlp
        qn, kn, ix = attn.q_a_layernorm, attn.kv_a_layernorm, attn.indexer
        ln1, ln2 = layer.input_layernorm, layer.post_attention_layernorm
        self.sig = sig  # (threads, the weights): no pool (a plan outlives an engine; the rows are looked up per call)
        self.kv_key = BufferKey(attn.layer, Kind.KV)
        self.ix_key = BufferKey(attn.layer, Kind.INDEX_K) if ix is not None else None
        self.rope = (attn.rope_dim, ix.head_dim if ix is not None else 0, ix is not None and ix.interleaved)
        self.w_uk, w_uv_t = attn._w_uk_uv(torch.float32)
        self.scaling, self.r, self.heads = float(attn.scaling), int(attn.kv_lora_rank), int(attn.num_heads)
        hidden = int(w_x.shape[1])
        ix_spec: tuple[Any, ...] = () if ix is None else (ix.n_heads, ix.head_dim, float(ix.k_norm.eps))
        spec = (attn.num_heads, attn.nope, attn.rope_dim, attn.kv_lora_rank, int(qn.weight.shape[0]),
                float(qn.eps), float(kn.eps), ix is not None, ix_spec)  # fmt: skip
        self.a_static = [ln1.weight, w_x, qn.weight, kn.weight, w_q]
        self.ix_static = [] if ix is None else [ix.k_norm.weight, ix.k_norm.bias]
        x1 = torch.empty((1, hidden))
        rot = torch.empty((1, attn.rope_dim, attn.rope_dim))
        ix_rot = [] if ix is None else [torch.empty((1, ix.head_dim, ix.head_dim))]
        like_a = [x1, *self.a_static, rot, *ix_rot, *self.ix_static]
        key_a = ("layer_one.a", float(ln1.eps), *spec, *(s for t in like_a for s in (*t.shape, *t.stride())))
        self.w_uv = w_uv_t.transpose(1, 2)  # [H, v, r]: each head's W_UV rows, r contiguous
        self.ln2 = ln2.weight
        o_lat = torch.empty((1, self.heads, self.r))
        b_spec: tuple[Any, ...]
        if type(f) is tuple:  # a dense MLP: (its gate | up weight, its down weight); MoEWeights is a NamedTuple
            self.b_static = [attn.o_proj.weight, *f]
            fn, b_spec = _b_dense_fn(float(ln2.eps)), ("dense", float(ln2.eps))
        else:
            gate = moe.gate
            b_spec = (f.router_rows, gate.top_k, gate.n_group, gate.topk_group, bool(gate.norm_topk_prob),
                      float(gate.routed_scaling_factor), True, float(ln2.eps))  # fmt: skip
            self.b_static = [f.tail, gate.e_score_correction_bias, f.gate_up, f.down, f.shared_down]
            self.b_static.append(attn.o_proj.weight)
            fn = _b_fn(b_spec)
        like_b = [o_lat, self.w_uv, *self.b_static, x1, self.ln2]
        key_b = ("layer_one.b", *b_spec, *(s for t in like_b for s in (*t.shape, *t.stride())))
        # B as one native call where it applies (its GEMVs' rows split over the threads in one parallel region)
        tail_mlp: native.TailMoE | tuple[torch.Tensor, torch.Tensor] = f
        if type(f) is not tuple:
            n, tg, norm, scale = (
                gate.n_group,
                gate.topk_group,
                bool(gate.norm_topk_prob),
                float(gate.routed_scaling_factor),
            )
            bias = gate.e_score_correction_bias
            tail_mlp = native.TailMoE(f.tail, bias, gate.top_k, n, tg, norm, scale, f.gate_up, f.down, f.shared_down)
        self.tail = native.decode_tail(self.w_uv, attn.o_proj.weight, self.ln2, float(ln2.eps), tail_mlp)
        ha = native.HeadAttn(attn.num_heads, attn.nope, attn.rope_dim, self.r, int(qn.weight.shape[0]), qn.weight,
                             float(qn.eps), kn.weight, float(kn.eps), self.scaling)  # fmt: skip
        if ix is not None:
            ha = ha._replace(ix_dim=ix.head_dim, k_w=ix.k_norm.weight, k_b=ix.k_norm.bias, k_eps=float(ix.k_norm.eps))
        self.head = native.decode_head(ha, ln1.weight, float(ln1.eps), w_x, w_q, self.w_uk)
        # the compiled kernels only where a native call does not apply (inductor compiles each shape: seconds)
        self.kern_a = None if self.head else gemv._compiled(key_a, _a_fn(spec, float(ln1.eps)), lambda: tuple(like_a))
        self.kern_b = None if self.tail else gemv._compiled(key_b, fn, lambda: tuple(like_b))

    def run(
        self, x: torch.Tensor, ctx: Any, slots: torch.Tensor, kv: torch.Tensor, ix: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The layer for x [1, hidden]; kv / ix: the pool's fp32 rows of its KV / index keys (ix None: a shared
        layer)."""
        rot = ctx.rope(self.rope[0], True, torch.float32).contiguous()
        ix_rot = None if ix is None else ctx.rope(self.rope[1], self.rope[2], torch.float32).contiguous()
        o_lat = (
            self.head(x, rot, ix_rot, kv, ix, ctx.out_slots, slots)
            if self.head is not None
            else self._compiled_head(x, rot, ix_rot, ctx.out_slots, slots, kv, ix)
        )
        if o_lat is None:
            return None
        if self.tail is not None:
            return self.tail(o_lat, x)
        assert self.kern_b is not None
        y: torch.Tensor = self.kern_b([o_lat, self.w_uv, *self.b_static, x, self.ln2])[0]
        return y

    def _compiled_head(
        self, x: torch.Tensor, rot: torch.Tensor, ix_rot: torch.Tensor | None, out_slots: torch.Tensor,
        slots: torch.Tensor, kv: torch.Tensor, ix: torch.Tensor | None,
    ) -> torch.Tensor | None:  # fmt: skip
        """decode_head's work on the compiled A kernel, bgemv_kn and mla_decode (where decode_head does not apply)."""
        assert self.kern_a is not None
        ins = [x, *self.a_static, rot] + ([] if ix_rot is None else [ix_rot, *self.ix_static])
        out = self.kern_a(ins)
        q_nope, q_rot, kv_row = out[0], out[1], out[2]
        query = native.bgemv_kn(q_nope, self.w_uk)  # [H, 1, r]
        if query is None:
            return None
        kv.index_copy_(0, out_slots, kv_row)
        if ix is not None:
            ix.index_copy_(0, out_slots, out[3])
        q = torch.cat((query.view(1, self.heads, self.r), q_rot), dim=-1)
        return native.mla_decode(q, kv, slots, None, self.scaling, self.r)


def _applies(layer: Any, x: torch.Tensor, ctx: Any) -> bool:
    attn = layer.self_attn
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.dtype == torch.float32
        and x.device.type == "cpu"
        and x.is_contiguous()
        and ctx.rows is None
        and ctx.decode_only
        and ctx.mla_path == "absorbed"
        and ctx.full_topk
        and ctx.index_topk >= ctx.s_max
        and isinstance(ctx.pool, PoolAccess)
        and attn.o_proj.bias is None
        and attn.o_proj.weight.dtype == torch.float32
    )


def layer_one(layer: Any, x: torch.Tensor, ctx: Any, prev_topk: Any) -> tuple[torch.Tensor, Any] | None:
    """DecoderLayer `layer`'s forward(x, ctx, prev_topk) for one decode token as the plan above (the new stream,
    the top-k), or None where it does not apply (nothing written: the caller runs the generic layer)."""
    if not gemv.compiled_gemv_on() or not _applies(layer, x, ctx) or native.lib() is None:
        return None
    attn, moe = layer.self_attn, layer.mlp
    topk = ctx.all_causal_topk() if attn.indexer is not None else prev_topk
    if topk is None:
        return None
    f = _mlp_weights(moe)
    w_x, w_q = attn._x_proj.plain_weight(), attn._q_proj.plain_weight()
    if f is None or w_x is None or w_q is None:
        return None
    plan: _Plan | None = getattr(layer, "_one_plan", None)
    # (a dense MLP's weights as their own entries: its tuple is made anew each call)
    sig = (torch.get_num_threads(), *(f if type(f) is tuple else (f,)), w_x, w_q, attn.kv_b_proj.weight,
           attn.o_proj.weight)  # fmt: skip
    if plan is None or any(a is not b for a, b in zip(plan.sig, sig, strict=True)):
        if not _weights_apply(layer, f, w_x, w_q):
            return None
        plan = layer._one_plan = _Plan(layer, sig, f, w_x, w_q)
    kv = ctx.pool.rows_in_place(plan.kv_key)
    ix = None if plan.ix_key is None else ctx.pool.rows_in_place(plan.ix_key)
    if kv is None or (plan.ix_key is not None and ix is None):
        return None
    y = plan.run(x, ctx, ctx.selection(topk, torch.float32)[3], kv, ix)
    return None if y is None else (y, topk)


def _mlp_weights(mlp: Any) -> Any:
    """The layer's MLP weights the plan binds: a MoE's fused MoEWeights when moe_fused takes one token (not its
    dense path), a dense MLP's (gate | up, down) weights (float, no bias), else None (an expert-parallel MoE, ...)."""
    if type(mlp) is MoE:
        return mlp.one_token_weights()
    if type(mlp) is not MLP or mlp._gate_up is None:
        return None
    w_gu, down = mlp._gate_up.plain_weight(), mlp.down_proj
    if w_gu is None or down.bias is not None or down.weight.stride(1) != 1:
        return None
    return (w_gu, down.weight)


def _weights_apply(layer: Any, f: Any, w_x: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Every weight input float32 on CPU (what the compiled kernels were traced for); the router fused."""
    attn, moe = layer.self_attn, layer.mlp
    ix = attn.indexer
    ts = [w_x, w_q, attn.q_a_layernorm.weight, attn.kv_a_layernorm.weight, layer.input_layernorm.weight,
          layer.post_attention_layernorm.weight, attn.kv_b_proj.weight, attn.o_proj.weight]  # fmt: skip
    if ix is not None:
        if ix.k_norm.bias is None:
            return False
        ts += [ix.k_norm.weight, ix.k_norm.bias]
    if type(f) is tuple:  # a dense MLP (MoEWeights is a NamedTuple)
        ts += list(f)
    elif f.in_scale is not None or not f.router_rows:
        return False
    else:
        ts += [f.w_in, moe.gate.e_score_correction_bias]
    return all(t.dtype == torch.float32 and t.device.type == "cpu" for t in ts)


__all__ = ["layer_one"]
