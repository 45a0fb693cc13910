"""MLA attention with the DSA lightning indexer over every sequence of a step at once, on the paged pool.

Per layer and step (T new tokens of B sequences, flat rows; token t belongs to sequence tok_seq[t] and
sits at position qpos[t] of it):

    x ─ q_a_proj ─ q_a_layernorm ─ q_resid ─ q_b_proj ─ [q_nope | q_rope] (rope: interleaved)
    x ─ kv_a_proj_with_mqa ─ [kv | k_rope] ; latent = kv_a_layernorm(kv) ; k_rope: interleaved rope
      -> pool KV row   = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]   at out_slots
    producer layers only ("full"):
    x ─ wk ─ k_norm ─ rope on the first qk_rope_head_dim values (GLM: interleaved, V3.2: half split)
      -> pool INDEX_K = index key (index_head_dim)                              at out_slots
      score[t, s] = sum_h w[t, h] * relu(q_idx[t, h] . k_idx[s] / sqrt(index_head_dim)),
      w = weights_proj(x) / sqrt(index_n_heads); causal; top index_topk per query token.
    shared layers reuse their producer's top-k and never touch an INDEX_K buffer.
    attention over the top-k ∩ causal cached tokens, softmax scale qk_head_dim^-0.5 (x yarn mscale^2).

Top-k is one int64 tensor [T, index_topk] per step: the selected positions of each token's sequence, sorted
ascending, -1 where a token has fewer than index_topk causal keys (it is also what a PP stage carries).

Batched form. The indexer reads every cached index key of the step once, as a padded [B, S_max, D] block
(S_max = longest sequence), and scores the query tokens against their sequence's keys: decode in one batched
matmul of B tokens; prefill with each sequence's queries padded to [B, t_max] (t_max = most new tokens of one
sequence) as one batched matmul per query block (a ragged step, which that would pad over twice, reads each
token's sequence's keys per block instead); it masks keys beyond each token's position and takes the top-k.
Attention then runs on one of two equivalent paths:

    absorbed (as DeepSeek's inference / FlashMLA): W_UK folds into the query, q_lat = q_nope . W_UK
      [T, H, kv_lora_rank]; the selected [latent | k_rope] rows are read from the pool as stored (only those,
      dequantised in one op) as [T, k, r + d]; scores = [q_lat | q_rope] . row; o_lat = probs . latent;
      out = o_lat . W_UV. Nothing is expanded through kv_b_proj.
    expanded (dense masked, as transformers' SDPA path): every cached row of the step goes through kv_b_proj
      once, giving per-head keys [k_nope | k_rope] and values [B, H, S_max, .]; each sequence's queries attend
      to all its keys in one scaled_dot_product_attention with an additive mask that is -inf off each token's
      top-k picks (built once per top-k, shared layers reuse it). No per-query copy of any key or value. Chunks
      of more than ATTN_QUERY_BLOCK (128) queries run block by block, each against its causal key prefix only
      (keys past the block's last position are -inf for all of it): ~t^2/2 scores for a t-token chunk, not t^2.

When index_topk >= S_max (every prompt up to index_topk tokens: 2,048 on DeepSeek-V3.2 / GLM-5.x) every causal
key is picked whatever the scores: the indexer writes its keys and returns that top-k without scoring
(StepContext.all_causal_topk, the same tensor the scored top-k would be).

The rule (`choose_mla_path` / `mla_path_costs`), in multiply-add equivalents: multiply-adds plus ELEM_MACS per
element a path writes and reads back, with k = min(index_topk, S_max), H heads, r = kv_lora_rank,
d = rope dim, n = qk_nope_head_dim, v = v_head_dim, B sequences, padded rows R' = B*S_max, padded queries
T' = B*t_max:
    absorbed = T*H*(n*r + k*(2r + d) + r*v)           + ELEM_MACS * 2*T*k*(r + d + H)   (gathered rows, scores)
    expanded = R'*H*r*(n + v) + T'*S_max*H*(n + d + v) + ELEM_MACS * (2*R'*H*(2(n+v) + d) + 2*T'*S_max)
expanded is taken iff it is cheaper: prefill chunks whose top-k covers much of their context; decode
(T = B) and chunks whose top-k is a small part of a long context gather (absorbed). `MLA_PATH` ("auto" |
"absorbed" | "expanded", or DSAModel.mla_path) forces one. Both give transformers' logits within float rounding.

This is what transformers' GlmMoeDsaAttention / DeepseekV32Attention compute (eager path),
with the cache in the pool instead of a DynamicCache. Nothing here is CPU-only: every tensor is
made on the input's device.
StepContext, RowSource and TopK live in model/step_context.py (re-exported here).
Imports torch, dsakv.spec and dsakv.model.{config,gemv,layers,step_context}.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.cache.kv_access import PoolAccess
from dsakv.model.attn_fused import attn_in
from dsakv.model.config import DSAConfig
from dsakv.model.gemv import bmm, compiled_gemv_on
from dsakv.model.layers import LinearGroup, RMSNorm, linear_add, rms_norm
from dsakv.model.native import mla_decode
from dsakv.model.step_context import SCORE_BLOCK_ELEMS, StepContext, TopK
from dsakv.model.step_context import RowSource as RowSource  # re-exported: HiSparseStep implements it
from dsakv.spec.layout import BufferKey, Kind

MLA_PATHS = ("auto", "absorbed", "expanded")
# One fp32 element written to memory and read back costs about as long as this many multiply-adds: ~45 G
# multiply-adds/s of matmul against ~23 GB/s of streaming reads on one core of the CI box (bench/engine.py
# measures both), i.e. ~2 multiply-adds a byte; gathers and copies move each element twice.
ELEM_MACS = 8


def choose_mla_path(
    forced: str,
    num_tokens: int,
    num_rows: int,
    k: int,
    heads: int,
    rank: int,
    rope: int,
    nope: int,
    v: int,
    seqs: int = 1,
    s_max: int | None = None,
    t_max: int | None = None,
) -> str:
    """The attention path of a step: `forced` unless "auto", else the cheaper by mla_path_costs (see above)."""
    if forced not in MLA_PATHS:
        raise ValueError(f"mla path {forced!r}: use one of {', '.join(MLA_PATHS)}")
    if forced != "auto":
        return forced
    absorbed, expanded = mla_path_costs(num_tokens, num_rows, k, heads, rank, rope, nope, v, seqs, s_max, t_max)
    return "expanded" if expanded < absorbed else "absorbed"


def mla_path_costs(
    num_tokens: int,
    num_rows: int,
    k: int,
    heads: int,
    rank: int,
    rope: int,
    nope: int,
    v: int,
    seqs: int = 1,
    s_max: int | None = None,
    t_max: int | None = None,
) -> tuple[int, int]:
    """(absorbed, expanded) cost of a step in multiply-add equivalents: multiply-adds plus ELEM_MACS per element
    the path writes to memory and reads back (gathered rows, expanded keys and values, masks, scores).
    `seqs`, `s_max`, `t_max`: sequences, longest sequence, most new tokens of one sequence (the dense path pads
    a ragged step to [seqs, t_max] queries over [seqs, s_max] rows); default one sequence."""
    t, h, r, d = num_tokens, heads, rank, rope
    s = num_rows if s_max is None else s_max
    tm = num_tokens if t_max is None else t_max
    rows, queries = seqs * s, seqs * tm  # padded
    absorbed = t * h * (nope * r + k * (2 * r + d) + r * v) + ELEM_MACS * 2 * t * k * (r + d + h)
    dense_macs = rows * h * r * (nope + v) + queries * s * h * (nope + d + v)
    dense_elems = 2 * rows * h * (2 * (nope + v) + d) + 2 * queries * s
    return absorbed, dense_macs + ELEM_MACS * dense_elems


class Indexer(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.n_heads = s.index_n_heads
        self.head_dim = s.index_head_dim
        self.rope_dim = s.qk_rope_head_dim
        self.topk = s.index_topk
        self.interleaved = cfg.index_rope_interleaved
        assert s.q_lora_rank is not None
        self.wq_b = nn.Linear(s.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(s.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(s.hidden_size, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        ctx: StepContext,
        layer: int,
        proj: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        new_key: torch.Tensor | None = None,
    ) -> TopK:
        """Top-k of every token of the step; writes the new tokens' index keys. `proj`: (wq_b(q_resid), wk(x),
        weights_proj(x)) when the caller ran them fused with its own projections; `new_key`: the new tokens'
        normed and roped index keys when the caller computed them (attn_fused.attn_in)."""
        t = x.shape[0]
        if proj is None:
            proj = (self.wq_b(q_resid), self.wk(x), self.weights_proj(x.to(self.weights_proj.weight.dtype)))
        q_raw, k_raw, w_raw = proj
        rot = ctx.rope(self.head_dim, self.interleaved, x.dtype)  # rope on the first rope_dim values
        if new_key is None:
            kn = self.k_norm
            k = torch.bmm(F.layer_norm(k_raw, kn.normalized_shape, kn.weight, kn.bias, kn.eps).unsqueeze(1), rot)
            k = k.squeeze(1)
        else:
            k = new_key
        key = BufferKey(layer, Kind.INDEX_K)
        ctx.pool.write(key, ctx.out_slots, k)
        every = ctx.all_causal_topk()
        if every is not None:  # index_topk >= S_max: every causal key is picked, no scores can change that
            return every
        q = torch.bmm(q_raw.view(t, self.n_heads, self.head_dim), rot)
        if q.dtype != torch.float32:
            q = q.float()
        # relu(s * q.k) = s * relu(q.k) for the softmax scale s > 0: s folds into the head weights, [T, H, 1]
        w = (w_raw.float() * (self.n_heads**-0.5 * self.softmax_scale)).unsqueeze(-1)
        b, s_max = ctx.table.shape
        keys = ctx.pool.read(key, ctx.padded_slots()).view(b, s_max, self.head_dim)  # [B, S, D] as read
        if not ctx.decode_only and b * ctx.t_max <= 2 * t:
            picks = self._prefill_picks(q, keys, w, ctx)
        else:
            picks = self._gathered_picks(q, keys, w, ctx)
        sel = picks[0] if len(picks) == 1 else torch.cat(picks, dim=0)
        return canonical_topk(sel, ctx)

    def _gathered_picks(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, ctx: StepContext) -> list:
        """Decode (one block: every sequence's one token against its keys), or a ragged prefill: each query
        block reads its tokens' sequences' keys."""
        t, s_max = q.shape[0], ctx.s_max
        qt = q.transpose(1, 2)  # [T, D, H]
        masked = ctx.causal_mask()
        picks = []
        for q0, q1 in ctx.query_blocks(s_max * max(self.n_heads, self.head_dim)):
            if ctx.decode_only and q1 - q0 == t:  # one block of every sequence's one token: no slicing
                kb, qb, wb, mb = keys, qt, w, masked
            else:
                kb = keys[q0:q1] if ctx.decode_only else keys[ctx.tok_seq[q0:q1]]  # [E, S, D]
                qb, wb, mb = qt[q0:q1], w[q0:q1], masked[q0:q1]
            scores = torch.bmm(kb, qb).relu_()  # [E, S, H]
            idx = torch.bmm(scores, wb).squeeze(-1).masked_fill_(mb, float("-inf"))  # [E, S]
            picks.append(idx.topk(ctx.k_sel, dim=-1).indices)
        return picks

    def _prefill_picks(self, q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor, ctx: StepContext) -> list:
        """Prefill: each sequence's queries (padded to [B, t_max]) against its keys [B, S, D] as read, one batched
        matmul per query block, no per-query copy of the keys."""
        b, tm, s_max, h = int(keys.shape[0]), ctx.t_max, ctx.s_max, self.n_heads
        qp = ctx.pad_queries(q)  # [B, t_max, H, D]
        wp = ctx.pad_queries(w.transpose(1, 2))  # [B, t_max, 1, H]
        mp = ctx.pad_queries(ctx.causal_mask())  # [B, t_max, S]
        kt = keys.transpose(1, 2)  # [B, D, S]
        step = max(1, SCORE_BLOCK_ELEMS // max(1, b * s_max * h))
        picks = []
        for j0 in range(0, tm, step):
            j1 = min(j0 + step, tm)
            e = j1 - j0
            scores = torch.bmm(qp[:, j0:j1].reshape(b, e * h, self.head_dim), kt).relu_()  # [B, E*H, S]
            idx = torch.bmm(wp[:, j0:j1].reshape(b * e, 1, h), scores.view(b * e, h, s_max))  # [B*E, 1, S]
            idx = idx.view(b, e, s_max).masked_fill_(mp[:, j0:j1], float("-inf"))
            picks.append(idx.topk(ctx.k_sel, dim=-1).indices)  # [B, E, k]
        sel = picks[0] if len(picks) == 1 else torch.cat(picks, dim=1)
        return [ctx.unpad_queries(sel)]


def canonical_topk(sel: torch.Tensor, ctx: StepContext) -> TopK:
    """Top-k picks [T, k] -> [T, index_topk]: causal ones ascending, then -1 (non-causal picks dropped)."""
    if ctx.full_topk:  # every pick is causal: sorting is all there is to do
        sel = sel.sort(dim=-1).values
    else:
        beyond = ctx.s_max
        sel = torch.where(sel <= ctx.qpos[:, None], sel, beyond).sort(dim=-1).values
        sel = sel.masked_fill(sel == beyond, -1)
    if sel.shape[1] < ctx.index_topk:
        sel = F.pad(sel, (0, ctx.index_topk - sel.shape[1]), value=-1)
    return sel


class MLAttention(nn.Module):
    def __init__(self, cfg: DSAConfig, layer: int) -> None:
        super().__init__()
        s = cfg.spec
        self.layer = layer
        self.num_heads = s.num_attention_heads
        self.nope = s.qk_nope_head_dim
        self.rope_dim = s.qk_rope_head_dim
        self.v_dim = s.v_head_dim
        self.kv_lora_rank = s.kv_lora_rank
        self.qk_head_dim = cfg.qk_head_dim
        self.scaling = cfg.softmax_scale
        bias = cfg.attention_bias
        assert s.q_lora_rank is not None
        self.q_a_proj = nn.Linear(s.hidden_size, s.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(s.q_lora_rank, 1e-6)
        self.q_b_proj = nn.Linear(s.q_lora_rank, self.num_heads * self.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(s.hidden_size, s.kv_lora_rank + s.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(s.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(s.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, s.hidden_size, bias=bias)
        self.is_producer = s.indexer_types[layer] == "full"
        self.indexer = Indexer(cfg) if self.is_producer else None
        # projections that read the same input run as one matmul: x -> q_a | kv_a (| indexer wk | weights_proj),
        # q_resid -> q_b (| indexer wq_b); see layers.LinearGroup
        ix = self.indexer
        x_in: list[nn.Module] = [self.q_a_proj, self.kv_a_proj_with_mqa]
        self._x_proj = LinearGroup(x_in + ([ix.wk, ix.weights_proj] if ix is not None else []))
        self._q_proj = LinearGroup([self.q_b_proj] + ([ix.wq_b] if ix is not None else []))
        self._w_uk_uv_cache: tuple[int, torch.dtype, torch.Tensor, torch.Tensor] | None = None

    def _w_uk_uv(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's weight split per head: W_UK [H, nope, r] and W_UV^T [H, r, v] (views, no copy)."""
        weight = self.kv_b_proj.weight
        c = self._w_uk_uv_cache
        if c is not None and c[0] == weight.data_ptr() and c[1] == dtype:
            return c[2], c[3]
        w = weight.to(dtype).view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv_t = w[:, : self.nope], w[:, self.nope :].transpose(1, 2)
        self._w_uk_uv_cache = (weight.data_ptr(), dtype, w_uk, w_uv_t)
        return w_uk, w_uv_t

    def forward(
        self,
        x: torch.Tensor,
        ctx: StepContext,
        prev_topk: TopK | None,
        residual: torch.Tensor | None = None,
        project: bool = True,
    ) -> tuple[torch.Tensor, TopK]:
        """(attention output [T, hidden], plus `residual` when given, added inside o_proj's matmul; the top-k).
        project=False: the heads' output [T, H * v] before o_proj (the caller projects it; residual unused)."""
        t = x.shape[0]
        h = self.num_heads
        r = self.kv_lora_rank
        fused = attn_in(self, x, ctx)  # --compile at decode: the chain below as one compiled call, else None
        new_index_key = None
        if fused is not None:
            q_nope, q_rot, kv_row, q_resid = fused.q_nope, fused.q_rot, fused.kv_row, fused.q_resid
            index_proj, new_index_key = fused.index, fused.index_key
        else:
            rot = ctx.rope(self.rope_dim, True, x.dtype)
            x_out = self._x_proj(x)  # q_a | kv_a (| indexer wk | weights_proj): views of one matmul
            qn, kn = self.q_a_layernorm, self.kv_a_layernorm
            q_resid = rms_norm(x_out[0], qn.weight, qn.eps)
            latent = rms_norm(x_out[1][:, :r], kn.weight, kn.eps)
            q_out = self._q_proj(q_resid)
            q = q_out[0].view(t, h, self.qk_head_dim)
            q_nope = q[..., : self.nope]
            q_rot = torch.bmm(q[..., self.nope :], rot)
            k_rot = torch.bmm(x_out[1][:, None, r:], rot).squeeze(1)
            kv_row = torch.cat((latent, k_rot), dim=-1)
            index_proj = (q_out[1], x_out[2], x_out[3]) if self.indexer is not None else None
        kv_key = BufferKey(self.layer, Kind.KV)
        ctx.pool.write(kv_key, ctx.out_slots, kv_row)

        if self.indexer is not None:
            topk = self.indexer.forward(x, q_resid, ctx, self.layer, index_proj, new_index_key)
            if ctx.rows is not None:
                ctx.rows.on_topk(self.layer, topk, ctx.mla_path)
        else:
            if prev_topk is None:
                raise ValueError(
                    f"layer {self.layer} is a shared DSA layer but no producer layer ran before it in this step: "
                    "run the model from its first layer (or pass the producer's top-k to this stage)"
                )
            topk = prev_topk

        if ctx.mla_path == "absorbed":
            sel, valid, mask, slots = ctx.selection(topk, x.dtype)
            out = self._absorbed(x, q_nope, q_rot, sel, valid, ctx, kv_key, mask, slots)
        else:
            out = self._expanded(x, q_nope, q_rot, topk, ctx, kv_key)
        if not project:
            return out.reshape(t, h * self.v_dim), topk
        return linear_add(out.reshape(t, h * self.v_dim), self.o_proj, residual), topk

    def _absorbed(
        self,
        x: torch.Tensor,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        sel: torch.Tensor,
        valid: torch.Tensor,
        ctx: StepContext,
        kv_key: BufferKey,
        mask: torch.Tensor,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """sel/valid [T, k]: each token's selected positions; mask [T, 1, k] (0, or -inf where not valid); slots
        [T, k]: their pool slots (read unless the step has a row source)."""
        t, h, r = x.shape[0], self.num_heads, self.kv_lora_rank
        w_uk, w_uv_t = self._w_uk_uv(x.dtype)
        q_lat = bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r] (gemv.bmm: --compile's kernel)
        query = torch.cat((q_lat, q_rot), dim=-1)  # [T, H, r + d]
        k = slots.shape[1]
        blocks = ctx.query_blocks(k * max(r + self.rope_dim, h))
        if ctx.rows is None and ctx.decode_only and len(blocks) == 1 and compiled_gemv_on():
            # --compile at decode: scores, softmax and values in one native call that reads the selected rows
            # in place from the pool's fp32 rows (no gathered copy); None where it does not apply
            plain = ctx.pool.rows_in_place(kv_key) if isinstance(ctx.pool, PoolAccess) else None
            if plain is not None:
                o_nat = mla_decode(query, plain, slots, None if ctx.full_topk else mask, self.scaling, r)
                if o_nat is not None:
                    return bmm(o_nat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, H, v]
        o_lat = x.new_empty(t, h, r) if len(blocks) > 1 else None
        for q0, q1 in blocks:
            one = q1 - q0 == t  # a single block (decode): the step's tensors as they are, no slicing
            if ctx.rows is None:
                rows = ctx.pool.read(kv_key, (slots if one else slots[q0:q1]).reshape(-1))
            else:
                rows = ctx.rows.read_selected(
                    self.layer, sel if one else sel[q0:q1], valid if one else valid[q0:q1], ctx.table, ctx.tok_seq, q0
                )
            if rows.dtype != x.dtype:
                rows = rows.to(x.dtype)
            rows = rows.view(q1 - q0, k, r + self.rope_dim)
            qb, mb = (query, mask) if one else (query[q0:q1], mask[q0:q1])
            scores = torch.baddbmm(mb, qb, rows.transpose(1, 2), alpha=self.scaling)  # [E, H, k]
            probs = F.softmax(scores, dim=-1, dtype=torch.float32)
            if probs.dtype != x.dtype:
                probs = probs.to(x.dtype)
            o = torch.bmm(probs, rows[..., :r])  # [E, H, r]
            if o_lat is None:
                o_lat = o
            else:
                o_lat[q0:q1] = o
        assert o_lat is not None
        return bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, H, v]

    def _expanded(
        self,
        x: torch.Tensor,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        topk: TopK,
        ctx: StepContext,
        kv_key: BufferKey,
    ) -> torch.Tensor:
        """Dense masked attention over each sequence's cached rows (as transformers' SDPA path): every row goes
        through kv_b_proj once, each query attends to all its sequence's keys with -inf off its top-k picks. No
        per-query copy of any key or value; queries padded to [B, t_max] only when the step is ragged."""
        h, r, d = self.num_heads, self.kv_lora_rank, self.rope_dim
        b, s = (int(v) for v in ctx.table.shape)
        slots, row0 = ctx.row_slots()
        cached = ctx.pool.read(kv_key, slots)  # [R, r + d]
        if cached.dtype != x.dtype:
            cached = cached.to(x.dtype)
        if int(slots.numel()) != b * s:  # ragged: each sequence's rows padded to S_max (its last row, masked)
            cols = torch.arange(s, device=row0.device)
            pad = torch.minimum(cols[None, :], (ctx.seq_lens - 1)[:, None]) + row0[:, None]
            cached = cached.index_select(0, pad.reshape(-1))
        cached = cached.view(b, s, r + d)
        kvb = F.linear(cached[..., :r], self.kv_b_proj.weight).view(b, s, h, self.nope + self.v_dim)
        rope = cached[:, None, :, r:].expand(b, h, s, d)
        key = torch.cat((kvb[..., : self.nope].transpose(1, 2), rope), dim=-1)  # [B, H, S, qk]
        value = kvb[..., self.nope :].transpose(1, 2)  # [B, H, S, v]
        query = ctx.pad_queries(torch.cat((q_nope, q_rot), dim=-1)).transpose(1, 2)  # [B, H, t_max, qk]
        mask = ctx.topk_mask(topk, x.dtype)  # [B, 1, t_max, S]
        blocks = ctx.query_key_blocks()
        if len(blocks) == 1:
            out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=self.scaling)
        else:  # each query block against its causal key prefix only (keys beyond are -inf for the whole block)
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(
                        query[:, :, j0:j1],
                        key[:, :, :ke],
                        value[:, :, :ke],
                        attn_mask=mask[:, :, j0:j1, :ke],
                        scale=self.scaling,
                    )  # fmt: skip
                    for j0, j1, ke in blocks
                ],
                dim=2,
            )
        return ctx.unpad_queries(out.transpose(1, 2))  # [T, H, v]
