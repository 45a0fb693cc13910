"""MLA attention with the DSA lightning indexer, reading and writing the paged pool by BufferKey.

Per layer and step (T new tokens of B sequences):

    x ─ q_a_proj ─ q_a_layernorm ─ q_resid ─ q_b_proj ─ [q_nope | q_rope] (rope: interleaved)
    x ─ kv_a_proj_with_mqa ─ [kv | k_rope] ; latent = kv_a_layernorm(kv) ; k_rope: interleaved rope
      -> pool KV row   = [latent (kv_lora_rank) | k_rope (qk_rope_head_dim)]   at out_slots
    producer layers only ("full"):
    x ─ wk ─ k_norm ─ rope on the first qk_rope_head_dim values (GLM: interleaved, V3.2: half split)
      -> pool INDEX_K = index key (index_head_dim)                              at out_slots
      score[t, s] = sum_h w[t, h] * relu(q_idx[t, h] . k_idx[s] / sqrt(index_head_dim)),
      w = weights_proj(x) / sqrt(index_n_heads); causal; top index_topk per query token.
    shared layers reuse their producer's top-k and never touch an INDEX_K buffer.
    attention: key = [kv_b_proj(latent)_nope | k_rope], value = kv_b_proj(latent)_v, over the
      top-k ∩ causal cached tokens, softmax scale qk_head_dim^-0.5 (x yarn mscale^2).

This is what transformers' GlmMoeDsaAttention / DeepseekV32Attention compute (eager path),
with the cache in the pool instead of a DynamicCache.
Imports torch, dsakv.cache and dsakv.model.{config,layers,rope}.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.cache.kv_access import PoolAccess
from dsakv.model.config import DSAConfig
from dsakv.model.layers import RMSNorm
from dsakv.model.rope import apply_half_split, apply_interleaved
from dsakv.spec.layout import BufferKey, Kind

# Bound on elements of one [heads, queries, keys] score block; longer prefills are split by query.
SCORE_BLOCK_ELEMS = 1 << 24
# Read and expand only the KV rows some query selected (False: every cached row, as a dense baseline).
SPARSE_KV_READS = True


@dataclass
class SeqView:
    """One sequence of a step: its new tokens are rows t0:t1 of the step, its cache is `slots` (S of them)."""

    t0: int
    t1: int
    prefix: int
    slots: torch.Tensor  # int64 [S]

    @property
    def num_new(self) -> int:
        return self.t1 - self.t0

    @property
    def seq_len(self) -> int:
        return int(self.slots.numel())


@dataclass
class StepContext:
    """What every layer of one step shares: token ranges per sequence, rope tables, the pool."""

    seqs: list[SeqView]
    out_slots: torch.Tensor  # int64 [T]
    cos: torch.Tensor  # [T, rope_dim / 2]
    sin: torch.Tensor
    pool: PoolAccess


TopK = list[torch.Tensor]  # per sequence: int64 [num_new, k] top-k key indices (into the sequence's slots)


def _query_blocks(num_new: int, seq_len: int, heads: int) -> list[tuple[int, int]]:
    step = max(1, SCORE_BLOCK_ELEMS // max(1, heads * seq_len))
    return [(i, min(i + step, num_new)) for i in range(0, num_new, step)]


def _causal(prefix: int, q0: int, q1: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """[q1 - q0, seq_len] bool: key j is visible to new token i iff j <= prefix + i."""
    qpos = torch.arange(prefix + q0, prefix + q1, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= qpos[:, None]


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

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rope_dim], x[..., self.rope_dim :]
        rot = apply_interleaved(rot, cos, sin) if self.interleaved else apply_half_split(rot, cos, sin)
        return torch.cat([rot, rest], dim=-1)

    def forward(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: StepContext, layer: int) -> TopK:
        t = x.shape[0]
        cos, sin = ctx.cos.to(x.dtype), ctx.sin.to(x.dtype)
        q = self._rope(self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), cos, sin)
        k = self._rope(self.k_norm(self.wk(x)), cos, sin)
        key = BufferKey(layer, Kind.INDEX_K)
        ctx.pool.write(key, ctx.out_slots, k)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * (self.n_heads**-0.5)
        out: TopK = []
        for sq in ctx.seqs:
            keys = ctx.pool.read(key, sq.slots)  # float32 [S, D]
            s_len = sq.seq_len
            k_sel = min(self.topk, s_len)
            picks = []
            for q0, q1 in _query_blocks(sq.num_new, s_len, self.n_heads):
                qb = q[sq.t0 + q0 : sq.t0 + q1].float()  # [E, H, D]
                scores = F.relu(torch.matmul(qb, keys.t()) * self.softmax_scale)  # [E, H, S]
                idx = torch.matmul(w[sq.t0 + q0 : sq.t0 + q1].unsqueeze(-2), scores).squeeze(-2)  # [E, S]
                idx = idx.masked_fill(~_causal(sq.prefix, q0, q1, s_len, idx.device), float("-inf"))
                picks.append(idx.topk(k_sel, dim=-1).indices)
            out.append(torch.cat(picks, dim=0))
        return out


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

    def forward(self, x: torch.Tensor, ctx: StepContext, prev_topk: TopK | None) -> tuple[torch.Tensor, TopK]:
        t = x.shape[0]
        h = self.num_heads
        cos, sin = ctx.cos.to(x.dtype), ctx.sin.to(x.dtype)
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, h, self.qk_head_dim)
        q_rot = apply_interleaved(q[..., self.nope :], cos, sin)
        query = torch.cat((q[..., : self.nope], q_rot), dim=-1)  # [T, H, qk]
        kv, k_rot = torch.split(self.kv_a_proj_with_mqa(x), [self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(kv)
        k_rot = apply_interleaved(k_rot, cos, sin)
        kv_key = BufferKey(self.layer, Kind.KV)
        ctx.pool.write(kv_key, ctx.out_slots, torch.cat((latent, k_rot), dim=-1))

        if self.indexer is not None:
            topk = self.indexer(x, q_resid, ctx, self.layer)
        else:
            if prev_topk is None:
                raise ValueError(
                    f"layer {self.layer} is a shared DSA layer but no producer layer ran before it in this step: "
                    "run the model from its first layer (or pass the producer's top-k to this stage)"
                )
            topk = prev_topk

        out = x.new_empty(t, h, self.v_dim)
        for sq, sel in zip(ctx.seqs, topk, strict=True):
            s_len = sq.seq_len
            # read and expand only the cached tokens some query selected (decode reads <= index_topk rows)
            cols = torch.unique(sel) if SPARSE_KV_READS and sel.numel() < s_len else None
            slots = sq.slots if cols is None else sq.slots[cols]
            n = int(slots.numel())
            cached = ctx.pool.read(kv_key, slots).to(x.dtype)  # [n, r + d]
            kvb = self.kv_b_proj(cached[:, : self.kv_lora_rank]).view(n, h, self.nope + self.v_dim)
            key = torch.empty(n, h, self.qk_head_dim, dtype=x.dtype, device=x.device)
            key[..., : self.nope] = kvb[..., : self.nope]
            key[..., self.nope :] = cached[:, None, self.kv_lora_rank :]
            key_t = key.permute(1, 2, 0)  # [H, qk, n]
            value_h = kvb[..., self.nope :].transpose(0, 1)  # [H, n, v]
            for q0, q1 in _query_blocks(sq.num_new, s_len, h):
                qb = query[sq.t0 + q0 : sq.t0 + q1].transpose(0, 1)  # [H, E, qk]
                scores = torch.matmul(qb, key_t) * self.scaling  # [H, E, n]
                allowed = torch.zeros(q1 - q0, s_len, dtype=torch.bool, device=x.device)
                allowed.scatter_(1, sel[q0:q1], True)
                allowed &= _causal(sq.prefix, q0, q1, s_len, x.device)
                if cols is not None:
                    allowed = allowed[:, cols]
                scores = scores.masked_fill(~allowed.unsqueeze(0), float("-inf"))
                probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
                out[sq.t0 + q0 : sq.t0 + q1] = torch.matmul(probs, value_h).transpose(0, 1)
        return self.o_proj(out.reshape(t, h * self.v_dim)), topk
