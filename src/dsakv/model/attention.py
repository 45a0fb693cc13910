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
(S_max = longest sequence), scores all query tokens against their sequence's keys in one batched matmul
(decode: one block of B tokens; prefill: blocks of flat rows bounded by SCORE_BLOCK_ELEMS), masks keys
beyond each token's position and takes the top-k. Attention then runs on one of two equivalent paths:

    absorbed (as DeepSeek's inference / FlashMLA): W_UK folds into the query, q_lat = q_nope . W_UK
      [T, H, kv_lora_rank]; the selected [latent | k_rope] rows are read from the pool as stored (only those,
      dequantised in one op) as [T, k, r + d]; scores = [q_lat | q_rope] . row; o_lat = probs . latent;
      out = o_lat . W_UV. Nothing is expanded through kv_b_proj.
    expanded (as transformers): every cached row of the step (R = sum of sequence lengths) goes through
      kv_b_proj once, giving per-head keys [k_nope | k_rope] and values; each token gathers its k rows.

The rule (`choose_mla_path`), from multiply-adds per step with k = min(index_topk, S_max), H heads,
r = kv_lora_rank, d = rope dim, n = qk_nope_head_dim, v = v_head_dim:
    absorbed = T * H * (n*r + k*(2r + d) + r*v)
    expanded = R * H * r*(n + v) + T * H * k*(n + d + v)
expanded is taken iff it is smaller: long prefill chunks, where every expanded row serves many queries;
decode (T = B, R = B * context) is always absorbed. `MLA_PATH` ("auto" | "absorbed" | "expanded", or
DSAModel.mla_path) forces one. Both give transformers' logits within float rounding.

This is what transformers' GlmMoeDsaAttention / DeepseekV32Attention compute (eager path),
with the cache in the pool instead of a DynamicCache. Nothing here is CPU-only: every tensor is
made on the input's device.
Imports torch, dsakv.cache and dsakv.model.{config,layers,rope}.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.cache.kv_access import TokenAccess
from dsakv.model.config import DSAConfig
from dsakv.model.layers import LinearGroup, RMSNorm, linear_add, rms_norm
from dsakv.model.rope import rotation_matrix
from dsakv.spec.layout import BufferKey, Kind

# Bound on the elements of one score (or gathered-row) block; longer prefills are split into query blocks.
SCORE_BLOCK_ELEMS = 1 << 24
MLA_PATHS = ("auto", "absorbed", "expanded")

TopK = torch.Tensor  # int64 [T, index_topk]: selected key positions per token, ascending, -1 padded


class RowSource(Protocol):
    """Where the absorbed path reads the selected KV rows instead of pool-by-slot (HiSparse: a hot device buffer,
    dsakv.cache.hisparse.HiSparseStep): told each producer's top-k first, then asked for the rows."""

    def on_topk(self, producer: int, topk: TopK, mla_path: str) -> None: ...

    def read_selected(
        self, layer: int, sel: torch.Tensor, valid: torch.Tensor, table: torch.Tensor, tok_seq: torch.Tensor, q0: int
    ) -> torch.Tensor: ...


@dataclass
class StepContext:
    """What every layer of one step shares: where each token sits, the slot table, rope tables, the pool.

    Whatever several layers derive from the same inputs (padded slots, the causal mask, the slots and mask
    of a top-k selection, rope matrices) is built once per step and memoised here.
    """

    out_slots: torch.Tensor  # int64 [T]
    cos: torch.Tensor  # [T, rope_dim / 2]
    sin: torch.Tensor
    pool: TokenAccess
    table: torch.Tensor  # int64 [B, S_max] token slots of each sequence (-1 beyond its length)
    seq_lens: torch.Tensor  # int64 [B]
    tok_seq: torch.Tensor  # int64 [T] sequence of each new token
    qpos: torch.Tensor  # int64 [T] position of each new token in its sequence
    s_max: int
    index_topk: int
    mla_path: str  # "absorbed" or "expanded", chosen once per step
    decode_only: bool  # every sequence has one new token (T == B, tok_seq == arange(B))
    # every token has at least min(index_topk, S_max) causal keys (no top-k pick can be non-causal); False
    # when unknown
    full_topk: bool = False
    _memo: dict[str, torch.Tensor] = field(default_factory=dict)
    _ropes: dict[tuple[int, bool, torch.dtype], torch.Tensor] = field(default_factory=dict)
    rows: RowSource | None = None  # None: selected rows are read from `pool` by slot
    _selections: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=list
    )

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.shape[0])

    @property
    def k_sel(self) -> int:
        """Top-k columns any token of the step can fill: min(index_topk, S_max)."""
        return min(self.index_topk, self.s_max)

    def padded_slots(self) -> torch.Tensor:
        """int64 [B * S_max] slots of the padded table, padding read as slot 0 (masked by every user)."""
        if "padded" not in self._memo:
            self._memo["padded"] = self.table.clamp(min=0).reshape(-1)
        return self._memo["padded"]

    def causal_mask(self) -> torch.Tensor:
        """bool [T, S_max]: True where key position s lies beyond token t's position (masked)."""
        if "causal" not in self._memo:
            cols = torch.arange(self.s_max, device=self.qpos.device)
            self._memo["causal"] = cols[None, :] > self.qpos[:, None]
        return self._memo["causal"]

    def selection(
        self, topk: TopK, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [T, k] (-1 read as 0), valid [T, k], additive mask [T, 1, k] of dtype (0 or -inf), slots
        [T, k]) of a top-k, k = k_sel; built once per top-k tensor (a producer's, reused by its shared layers)."""
        for t, sel in self._selections:
            if t is topk and sel[2].dtype == dtype:
                return sel
        pos = topk[:, : self.k_sel]
        n, k = int(pos.shape[0]), int(pos.shape[1])
        if self.full_topk:  # every token has k causal picks: no -1 to mask
            valid = torch.ones((n, k), dtype=torch.bool, device=pos.device)
            bias = torch.zeros((n, 1, k), dtype=dtype, device=pos.device)
        else:
            invalid = pos < 0
            pos = pos.clamp(min=0)
            bias = torch.zeros((n, 1, k), dtype=dtype, device=pos.device).masked_fill_(invalid[:, None], float("-inf"))
            valid = ~invalid
        if self.decode_only:
            slots = self.table.gather(1, pos)
        else:
            slots = self.table[self.tok_seq[:, None], pos]
        out = (pos, valid, bias, slots)
        self._selections.append((topk, out))  # holds topk, so `is` cannot match a recycled tensor
        return out

    def row_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots of every cached row of the step, concatenated by sequence [R]; first row of each sequence [B])."""
        if "rows" not in self._memo:
            valid = self.table >= 0
            self._memo["rows"] = self.table[valid]
            self._memo["row0"] = torch.cumsum(self.seq_lens, 0) - self.seq_lens
        return self._memo["rows"], self._memo["row0"]

    def rope(self, width: int, interleaved: bool, dtype: torch.dtype) -> torch.Tensor:
        """The step's rope as [T, width, width] rotation matrices (see rope.rotation_matrix), built once."""
        key = (width, interleaved, dtype)
        rot = self._ropes.get(key)
        if rot is None:
            rot = self._ropes[key] = rotation_matrix(self.cos, self.sin, width, interleaved).to(dtype)
        return rot

    def query_blocks(self, per_token: int) -> list[tuple[int, int]]:
        """Flat token ranges whose per_token elements each stay under SCORE_BLOCK_ELEMS (decode: one block)."""
        t = self.num_tokens
        step = max(1, SCORE_BLOCK_ELEMS // max(1, per_token))
        return [(i, min(i + step, t)) for i in range(0, t, step)]


def choose_mla_path(
    forced: str, num_tokens: int, num_rows: int, k: int, heads: int, rank: int, rope: int, nope: int, v: int
) -> str:
    """The attention path of a step: `forced` unless "auto", else the one with fewer multiply-adds (see above)."""
    if forced not in MLA_PATHS:
        raise ValueError(f"mla path {forced!r}: use one of {', '.join(MLA_PATHS)}")
    if forced != "auto":
        return forced
    absorbed = num_tokens * heads * (nope * rank + k * (2 * rank + rope) + rank * v)
    expanded = num_rows * heads * rank * (nope + v) + num_tokens * heads * k * (nope + rope + v)
    return "expanded" if expanded < absorbed else "absorbed"


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
    ) -> TopK:
        """Top-k of every token of the step; writes the new tokens' index keys. `proj`: (wq_b(q_resid), wk(x),
        weights_proj(x)) when the caller ran them fused with its own projections."""
        t = x.shape[0]
        if proj is None:
            proj = (self.wq_b(q_resid), self.wk(x), self.weights_proj(x.to(self.weights_proj.weight.dtype)))
        q_raw, k_raw, w_raw = proj
        rot = ctx.rope(self.head_dim, self.interleaved, x.dtype)  # rope on the first rope_dim values
        q = torch.bmm(q_raw.view(t, self.n_heads, self.head_dim), rot)
        if q.dtype != torch.float32:
            q = q.float()
        kn = self.k_norm
        k = torch.bmm(F.layer_norm(k_raw, kn.normalized_shape, kn.weight, kn.bias, kn.eps).unsqueeze(1), rot)
        k = k.squeeze(1)
        key = BufferKey(layer, Kind.INDEX_K)
        ctx.pool.write(key, ctx.out_slots, k)
        # relu(s * q.k) = s * relu(q.k) for the softmax scale s > 0: s folds into the head weights, [T, H, 1]
        w = (w_raw.float() * (self.n_heads**-0.5 * self.softmax_scale)).unsqueeze(-1)
        b, s_max = ctx.table.shape
        keys = ctx.pool.read(key, ctx.padded_slots()).view(b, s_max, self.head_dim)  # [B, S, D] as read
        qt = q.transpose(1, 2)  # [T, D, H]
        k_sel = ctx.k_sel
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
            picks.append(idx.topk(k_sel, dim=-1).indices)
        sel = picks[0] if len(picks) == 1 else torch.cat(picks, dim=0)
        return canonical_topk(sel, ctx)


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
        self, x: torch.Tensor, ctx: StepContext, prev_topk: TopK | None, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, TopK]:
        """(attention output [T, hidden], plus `residual` when given, added inside o_proj's matmul; the top-k)."""
        t = x.shape[0]
        h = self.num_heads
        rot = ctx.rope(self.rope_dim, True, x.dtype)
        r = self.kv_lora_rank
        x_out = self._x_proj(x)  # q_a | kv_a (| indexer wk | weights_proj): views of one matmul
        qn, kn = self.q_a_layernorm, self.kv_a_layernorm
        q_resid = rms_norm(x_out[0], qn.weight, qn.eps)
        latent = rms_norm(x_out[1][:, :r], kn.weight, kn.eps)
        q_out = self._q_proj(q_resid)
        q = q_out[0].view(t, h, self.qk_head_dim)
        q_nope = q[..., : self.nope]
        q_rot = torch.bmm(q[..., self.nope :], rot)
        k_rot = torch.bmm(x_out[1][:, None, r:], rot).squeeze(1)
        kv_key = BufferKey(self.layer, Kind.KV)
        ctx.pool.write(kv_key, ctx.out_slots, torch.cat((latent, k_rot), dim=-1))

        if self.indexer is not None:
            topk = self.indexer.forward(x, q_resid, ctx, self.layer, (q_out[1], x_out[2], x_out[3]))
            if ctx.rows is not None:
                ctx.rows.on_topk(self.layer, topk, ctx.mla_path)
        else:
            if prev_topk is None:
                raise ValueError(
                    f"layer {self.layer} is a shared DSA layer but no producer layer ran before it in this step: "
                    "run the model from its first layer (or pass the producer's top-k to this stage)"
                )
            topk = prev_topk

        sel, valid, mask, slots = ctx.selection(topk, x.dtype)
        if ctx.mla_path == "absorbed":
            out = self._absorbed(x, q_nope, q_rot, sel, valid, ctx, kv_key, mask, slots)
        else:
            out = self._expanded(x, q_nope, q_rot, sel, valid, ctx, kv_key, mask)
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
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, r]
        query = torch.cat((q_lat, q_rot), dim=-1)  # [T, H, r + d]
        k = slots.shape[1]
        blocks = ctx.query_blocks(k * max(r + self.rope_dim, h))
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
        return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # [T, H, v]

    def _expanded(
        self,
        x: torch.Tensor,
        q_nope: torch.Tensor,
        q_rot: torch.Tensor,
        sel: torch.Tensor,
        valid: torch.Tensor,
        ctx: StepContext,
        kv_key: BufferKey,
        mask: torch.Tensor,
    ) -> torch.Tensor:
        t, h, r = x.shape[0], self.num_heads, self.kv_lora_rank
        slots, row0 = ctx.row_slots()
        n = int(slots.numel())
        cached = ctx.pool.read(kv_key, slots).to(x.dtype)  # [R, r + d]
        kvb = self.kv_b_proj(cached[:, :r]).view(n, h, self.nope + self.v_dim)
        key = torch.cat((kvb[..., : self.nope], cached[:, None, r:].expand(n, h, self.rope_dim)), dim=-1)
        value = kvb[..., self.nope :]  # [R, H, v]
        query = torch.cat((q_nope, q_rot), dim=-1).unsqueeze(2)  # [T, H, 1, qk]
        out = x.new_empty(t, h, self.v_dim)
        k = sel.shape[1]
        for q0, q1 in ctx.query_blocks(k * h * max(self.qk_head_dim, self.v_dim)):
            rows = row0[ctx.tok_seq[q0:q1], None] + sel[q0:q1]  # [E, k] into the step's rows
            kb = key[rows].permute(0, 2, 3, 1)  # [E, H, qk, k]
            scores = torch.matmul(query[q0:q1], kb).squeeze(2) * self.scaling + mask[q0:q1]  # [E, H, k]
            probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
            vb = value[rows].transpose(1, 2)  # [E, H, k, v]
            out[q0:q1] = torch.matmul(probs.unsqueeze(2), vb).squeeze(2)
        return out
