"""DSAModel: a GLM-5.x / DeepSeek-V3.2 causal LM whose KV and index-K live in a paged DevicePool.

    logits = model.forward(batch, pool)   # float32 [B, vocab], last new token of each sequence

Parameter names match transformers' GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM, so
`load_state_dict` takes a checkpoint's tensors by name (see model/loader.py).
Layer i writes BufferKey(i, KV) for every new token, and BufferKey(i, INDEX_K) only if i is
a producer ("full"); shared layers reuse the producer's top-k and never touch an INDEX_K,
so the same step gives bitwise identical logits with a pool that elides them or not.
Imports torch, dsakv.spec, dsakv.cache and dsakv.model.
"""

from __future__ import annotations

import torch
from torch import nn

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.kv_access import PoolAccess
from dsakv.model.attention import MLAttention, SeqView, StepContext, TopK
from dsakv.model.batch import ForwardBatch
from dsakv.model.config import DSAConfig
from dsakv.model.layers import MLP, MoE, RMSNorm
from dsakv.model.rope import Rope, rope_inv_freq
from dsakv.spec.layout import DEFAULT_PAGE_SIZE, KVLayout
from dsakv.spec.model import ModelSpec


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DSAConfig, layer: int) -> None:
        super().__init__()
        s = cfg.spec
        self.self_attn = MLAttention(cfg, layer)
        self.mlp: nn.Module = (
            MoE(cfg) if cfg.mlp_layer_types[layer] == "sparse" else MLP(s.hidden_size, s.intermediate_size)
        )
        self.input_layernorm = RMSNorm(s.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(s.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, ctx: StepContext, prev_topk: TopK | None) -> tuple[torch.Tensor, TopK]:
        attn, topk = self.self_attn(self.input_layernorm(x), ctx, prev_topk)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), topk


class Backbone(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, cfg.rms_norm_eps)


class DSAModel(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        self.cfg = cfg
        s = cfg.spec
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        with torch.device("cpu"):  # rope tables are plain tensors, also when the weights are built on meta
            inv_freq, scaling = rope_inv_freq(cfg.rope_parameters, s.qk_rope_head_dim, s.raw)
        self.rope = Rope(inv_freq, scaling)

    @property
    def spec(self) -> ModelSpec:
        return self.cfg.spec

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def layout_for(
        self,
        elide: bool = True,
        kv_format: str = "fp8-656",
        index_format: str = "fp8-132",
        page_size: int = DEFAULT_PAGE_SIZE,
    ) -> KVLayout:
        """The layout of a pool this model can run on (all main layers, no draft layers)."""
        return KVLayout(self.spec, elide=elide, kv_format=kv_format, index_format=index_format, page_size=page_size)

    def make_context(self, batch: ForwardBatch, pool: DevicePool) -> StepContext:
        _check_batch(batch)
        if pool.layout.spec.identity_hash() != self.spec.identity_hash():
            raise ValueError(
                f"the pool's layout is for model {pool.layout.spec.name!r} ({pool.layout.spec.identity_hash()}), "
                f"not this model {self.spec.name!r} ({self.spec.identity_hash()}): build it with model.layout_for()"
            )
        dev = self.device
        ext = batch.extend_lens.tolist()
        pre = batch.prefix_lens.tolist()
        seqs, t0 = [], 0
        table = batch.slot_table.to(dev)
        out_slots = batch.out_slots.to(dev)
        for b, (p, e) in enumerate(zip(pre, ext, strict=True)):
            seqs.append(SeqView(t0, t0 + e, p, table[b, : p + e]))
            if not torch.equal(table[b, p : p + e], out_slots[t0 : t0 + e]):
                raise ValueError(
                    f"sequence {b}: out_slots {out_slots[t0 : t0 + e].tolist()} differ from its slot_table entries "
                    f"{table[b, p : p + e].tolist()} for the new tokens: the new tokens' slots must be both"
                )
            t0 += e
        cos, sin = self.rope.cos_sin(batch.positions.to(dev), torch.float32)
        return StepContext(seqs, out_slots, cos, sin, PoolAccess(pool))

    def forward(self, batch: ForwardBatch, pool: DevicePool) -> torch.Tensor:  # type: ignore[override]
        """Write the new tokens' KV (and producers' index-K) at batch.out_slots; logits [B, vocab] float32."""
        with torch.inference_mode():
            ctx = self.make_context(batch, pool)
            x = self.model.embed_tokens(batch.input_ids.to(self.device))
            topk: TopK | None = None
            for layer in self.model.layers:
                x, topk = layer(x, ctx, topk)
            last = torch.cumsum(batch.extend_lens.to(self.device), 0) - 1
            return self.lm_head(self.model.norm(x[last])).float()


def _check_batch(batch: ForwardBatch) -> None:
    b = batch.batch_size
    t = batch.num_tokens
    if batch.prefix_lens.shape != (b,) or batch.slot_table.dim() != 2 or batch.slot_table.shape[0] != b:
        raise ValueError(
            f"batch shapes disagree: extend_lens {tuple(batch.extend_lens.shape)}, prefix_lens "
            f"{tuple(batch.prefix_lens.shape)}, slot_table {tuple(batch.slot_table.shape)}: want [B], [B], [B, S]"
        )
    if batch.positions.shape != (t,) or batch.out_slots.shape != (t,):
        raise ValueError(
            f"input_ids has {t} tokens but positions {tuple(batch.positions.shape)} and out_slots "
            f"{tuple(batch.out_slots.shape)}: give one position and one slot per new token"
        )
    if b == 0 or int(batch.extend_lens.min()) < 1 or int(batch.extend_lens.sum()) != t:
        raise ValueError(f"extend_lens {batch.extend_lens.tolist()} must be >= 1 each and sum to the {t} new tokens")
    if int(batch.seq_lens.max()) > batch.slot_table.shape[1]:
        raise ValueError(
            f"slot_table has {batch.slot_table.shape[1]} columns but a sequence holds {int(batch.seq_lens.max())} "
            "tokens after this step: widen the table to max(prefix_lens + extend_lens)"
        )
