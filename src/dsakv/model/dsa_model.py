"""DSAModel: a GLM-5.x / DeepSeek-V3.2 causal LM whose KV and index-K live in a paged DevicePool.

    logits = model.forward(batch, pool)   # float32 [B, vocab], last new token of each sequence
    carry = model.stage_forward(batch, stage_pool, carry)   # one PP stage: the layers its pool holds

Parameter names match transformers' GlmMoeDsaForCausalLM / DeepseekV32ForCausalLM, so
`load_state_dict` takes a checkpoint's tensors by name (see model/loader.py).
Layer i writes BufferKey(i, KV) for every new token, and BufferKey(i, INDEX_K) only if i is
a producer ("full"); shared layers reuse the producer's top-k and never touch an INDEX_K,
so the same step gives bitwise identical logits with a pool that elides them or not.
Imports torch, dsakv.spec, dsakv.cache and dsakv.model.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hisparse import HiSparsePool
from dsakv.cache.kv_access import PoolAccess
from dsakv.model.attention import MLA_PATHS, MLAttention, StepContext, TopK, choose_mla_path
from dsakv.model.batch import ForwardBatch
from dsakv.model.config import DSAConfig
from dsakv.model.decode_one import layer_one
from dsakv.model.gemv import compiled_gemv_on
from dsakv.model.layers import MLP, MoE, RMSNorm, linear, linear_add, rms_norm
from dsakv.model.moe_fused import moe_after_attention
from dsakv.model.quant import linear_dtype
from dsakv.model.rope import Rope, rope_inv_freq
from dsakv.spec.layout import DEFAULT_PAGE_SIZE, KVLayout
from dsakv.spec.model import ModelSpec


class Reduce(Protocol):
    """Sums a rank's partial output over its tensor-parallel group in place (model/parallel.py's TPGroup)."""

    lead: bool  # the rank that adds the residual

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class DecoderLayer(nn.Module):
    # tensor parallel: set by model/parallel.attach on a sharded model; None on a single rank
    reduce: Reduce | None = None

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
        ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
        red = self.reduce
        if red is None:
            attn = self.self_attn
            one = layer_one(self, x, ctx, prev_topk)  # --compile, a decode token: the layer as decode_one's plan
            if one is not None:
                return one
            if isinstance(self.mlp, MoE) and x.shape[0] == 1 and compiled_gemv_on() and attn.o_proj.bias is None:
                # --compile, one token: o_proj, residual, RMSNorm and the MoE layer as one compiled call
                o, topk = attn.forward(rms_norm(x, ln1.weight, ln1.eps), ctx, prev_topk, project=False)
                y = moe_after_attention(o, attn.o_proj.weight, x, ln2.weight, ln2.eps, self.mlp)
                if y is not None:
                    return y, topk
                x = linear_add(o, attn.o_proj, x)
            else:
                x, topk = attn.forward(rms_norm(x, ln1.weight, ln1.eps), ctx, prev_topk, residual=x)
            return self.mlp.forward(rms_norm(x, ln2.weight, ln2.eps), residual=x), topk
        # tensor parallel: partial o_proj / down-projection outputs, summed over the group; residual on the lead
        h, topk = self.self_attn.forward(
            rms_norm(x, ln1.weight, ln1.eps), ctx, prev_topk, residual=x if red.lead else None
        )
        x = red(h)
        return red(self.mlp.forward(rms_norm(x, ln2.weight, ln2.eps), residual=x if red.lead else None)), topk


class Backbone(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(s.num_layers))
        self.norm = RMSNorm(s.hidden_size, cfg.rms_norm_eps)


# the last pool checked (weakly), its layout and its codec access (weakly: the pool holds it)
_Checked = tuple["weakref.ref[DevicePool | HiSparsePool]", KVLayout, "weakref.ref[PoolAccess] | None"]


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
        # attention path: "auto" (per step, by attention.choose_mla_path), or force "absorbed" / "expanded"
        self.mla_path = "auto"
        self._checked: _Checked | None = None

    def set_mla_path(self, path: str) -> None:
        """Force the MLA attention path ("absorbed", "expanded") or let each step choose ("auto")."""
        if path not in MLA_PATHS:
            raise ValueError(f"mla path {path!r}: use one of {', '.join(MLA_PATHS)}")
        self.mla_path = path

    @property
    def spec(self) -> ModelSpec:
        return self.cfg.spec

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return linear_dtype(self.lm_head)  # the model's dtype, also with int8 weights (pack_int8)

    def layout_for(
        self,
        elide: bool = True,
        kv_format: str = "fp8-656",
        index_format: str = "fp8-132",
        page_size: int = DEFAULT_PAGE_SIZE,
        layer_start: int = 0,
        layer_end: int | None = None,
    ) -> KVLayout:
        """The layout of a pool this model can run on: all main layers, or one PP stage's range; no draft layers."""
        return KVLayout(
            self.spec,
            layer_start=layer_start,
            layer_end=layer_end,
            elide=elide,
            kv_format=kv_format,
            index_format=index_format,
            page_size=page_size,
        )

    def check_pool(self, pool: DevicePool | HiSparsePool) -> PoolAccess | None:
        """Raise ValueError unless the pool's layout was built for this model; the pool's codec access (None: a
        HiSparse pool). Threads may share one model, each stepping its own pool (PP stages, or prefill and decode
        roles, in one process): the memo is read once and the access returned is always `pool`'s."""
        last = self._checked  # one read: another thread's step may replace the memo at any moment
        if last is not None and last[0]() is pool and last[1] is pool.layout:
            return None if last[2] is None else last[2]()
        if pool.layout.spec.identity_hash() != self.spec.identity_hash():
            raise ValueError(
                f"the pool's layout is for model {pool.layout.spec.name!r} ({pool.layout.spec.identity_hash()}), "
                f"not this model {self.spec.name!r} ({self.spec.identity_hash()}): build it with model.layout_for()"
            )
        # the last pool checked, and its codec access (slots checked once per step in make_context)
        access = PoolAccess(pool, check_slots=False) if isinstance(pool, DevicePool) else None
        # the access lives on the pool (a cycle the collector frees with it) and the memo holds both weakly: a
        # model that outlives its engine (LLM(loaded_model=...), the benches) does not keep the engine's pool
        if isinstance(pool, DevicePool):
            pool.unchecked_access = access
        self._checked = (weakref.ref(pool), pool.layout, None if access is None else weakref.ref(access))
        return access

    def make_context(self, batch: ForwardBatch, pool: DevicePool | HiSparsePool) -> StepContext:
        """The step's shared tensors, built vectorised on the model's device (no loop over sequences).

        The slot table is checked against the pool once here, so the layers' reads and writes skip the check.
        """
        ext_l, pre_l = _check_batch(batch)
        access = self.check_pool(pool)  # never self._checked here: another thread may have replaced it
        dev = self.device
        b, t = batch.batch_size, batch.num_tokens
        ext = batch.extend_lens.to(dev)
        pre = batch.prefix_lens.to(dev)
        seq_lens = pre + ext
        s_max = max(p + e for p, e in zip(pre_l, ext_l, strict=True))
        table = batch.slot_table.to(dev)[:, :s_max]
        out_slots = batch.out_slots.to(dev)
        lo, hi = (int(v) for v in torch.aminmax(table)) if access is not None else (0, 0)
        if access is not None and (lo < -1 or hi >= access.capacity_slots):
            raise IndexError(
                f"token slots span {lo}..{hi} but the pool has slots 0..{access.capacity_slots - 1}: a slot is "
                "page_id * page_size + offset of a page this pool holds (padding -1 is not a slot)"
            )
        decode = t == b
        if decode:  # one new token per sequence, at its last position
            tok_seq = torch.arange(b, device=dev)
            first = tok_seq
            qpos = pre
            mismatch = table.gather(1, qpos[:, None]).squeeze(1) != out_slots
        else:
            tok_seq = torch.repeat_interleave(torch.arange(b, device=dev), ext, output_size=t)
            first = torch.cumsum(ext, 0) - ext
            qpos = pre[tok_seq] + torch.arange(t, device=dev) - first[tok_seq]
            mismatch = table[tok_seq, qpos] != out_slots
        if bool(mismatch.any()):
            bad = int(tok_seq[int(mismatch.nonzero()[0, 0])])
            p, e, t0 = int(pre[bad]), int(ext[bad]), int(first[bad])
            raise ValueError(
                f"sequence {bad}: out_slots {out_slots[t0 : t0 + e].tolist()} differ from its slot_table entries "
                f"{table[bad, p : p + e].tolist()} for the new tokens: the new tokens' slots must be both"
            )
        s = self.spec
        k = min(s.index_topk, s_max)
        rows = sum(pre_l) + t
        t_max = max(ext_l)
        path = choose_mla_path(
            self.mla_path, t, rows, k, s.num_attention_heads, s.kv_lora_rank,
            s.qk_rope_head_dim, s.qk_nope_head_dim, s.v_head_dim, seqs=b, s_max=s_max, t_max=t_max,
        )  # fmt: skip
        cos, sin = self.rope.cos_sin(batch.positions.to(dev), torch.float32)
        full = min(pre_l) + 1 >= k  # every token sits at or beyond its prefix: >= k causal keys each
        if access is None:  # HiSparse: logical slots; selected rows from the hot buffer (cache/hisparse.py)
            assert isinstance(pool, HiSparsePool)
            hs = pool.step_access(batch.extend_lens, batch.positions, dev)
            return StepContext(
                out_slots,
                cos,
                sin,
                hs,
                table,
                seq_lens,
                tok_seq,
                qpos,
                s_max,
                s.index_topk,
                path,
                decode,
                full,
                t_max=t_max,
                rows=hs,
            )
        return StepContext(
            out_slots,
            cos,
            sin,
            access,
            table,
            seq_lens,
            tok_seq,
            qpos,
            s_max,
            s.index_topk,
            path,
            decode,
            full,
            t_max=t_max,
        )

    def forward(self, batch: ForwardBatch, pool: DevicePool | HiSparsePool) -> torch.Tensor:  # type: ignore[override]
        """Write the new tokens' KV (and producers' index-K) at batch.out_slots; logits [B, vocab] float32.

        The pool must hold every main layer (layout layers 0..num_layers-1); see stage_forward for PP stages.
        """
        self.check_pool(pool)
        lay = pool.layout
        if lay.layer_start != 0 or lay.end != self.spec.num_layers:
            raise ValueError(
                f"forward() runs all {self.spec.num_layers} layers but the pool holds layers {lay.describe_range()}: "
                "use stage_forward() for a pipeline stage"
            )
        out = self.stage_forward(batch, pool)
        assert out.logits is not None
        return out.logits

    def stage_forward(
        self, batch: ForwardBatch, pool: DevicePool | HiSparsePool, carry: StageCarry | None = None
    ) -> StageCarry:
        """Run the layers the pool holds (pool.layout.layer_start..end) for one step: one pipeline stage.

        The first stage (layer_start 0) embeds batch.input_ids and takes no carry; a later stage takes the
        previous stage's carry (hidden states and the last producer's top-k, which its leading shared
        layers reuse). The last stage also returns logits.
        """
        lay = pool.layout
        with torch.inference_mode():
            ctx = self.make_context(batch, pool)
            topk: TopK | None = None
            if lay.layer_start == 0:
                if carry is not None:
                    raise ValueError("the first pipeline stage (layer 0) embeds the tokens itself: pass carry=None")
                x = self.model.embed_tokens(batch.input_ids.to(self.device))
            else:
                if carry is None:
                    raise ValueError(
                        f"stage {lay.describe_range()} starts after layer 0: pass the previous stage's StageCarry"
                    )
                x = carry.hidden.to(self.device, self.dtype)
                if carry.topk is not None:
                    topk = unpack_topk(carry.topk.to(self.device), ctx, self.spec.index_topk)
            layers = self.model.layers
            for i in lay.main_layers:
                x, topk = layers[i].forward(x, ctx, topk)
            logits = None
            if lay.end == self.spec.num_layers:
                last = torch.cumsum(batch.extend_lens.to(self.device), 0) - 1
                logits = linear(self.model.norm(x[last]), self.lm_head).float()  # no Module call: --compile's GEMV
            packed = pack_topk(topk, ctx, self.spec.index_topk) if topk is not None else None
            return StageCarry(hidden=x, topk=packed, logits=logits)


@dataclass
class StageCarry:
    """What one pipeline stage hands the next for one step."""

    hidden: torch.Tensor  # [T, hidden_size], model dtype: residual stream after the stage's last layer
    topk: torch.Tensor | None  # int64 [T, index_topk]: last producer's top-k key indices per token, -1 padded
    logits: torch.Tensor | None = None  # float32 [B, vocab], last stage only


def pack_topk(topk: TopK, ctx: StepContext, index_topk: int) -> torch.Tensor:
    """The step's top-k as a PP stage carries it: int64 [T, index_topk], -1 beyond each token's picks."""
    assert topk.shape == (ctx.num_tokens, index_topk)
    return topk


def unpack_topk(packed: torch.Tensor, ctx: StepContext, index_topk: int) -> TopK:
    if packed.shape != (ctx.num_tokens, index_topk):
        raise ValueError(
            f"carried top-k has shape {tuple(packed.shape)} but this step has {ctx.num_tokens} tokens "
            f"and index_topk {index_topk}: the carry must come from the same step's previous stage"
        )
    return packed.to(torch.int64)


def _check_batch(batch: ForwardBatch) -> tuple[list[int], list[int]]:
    """Raise ValueError unless the batch's shapes agree; (extend_lens, prefix_lens) as host lists."""
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
    ext, pre = batch.extend_lens.tolist(), batch.prefix_lens.tolist()  # host lists: B ints, one call each
    if b == 0 or min(ext) < 1 or sum(ext) != t:
        raise ValueError(f"extend_lens {ext} must be >= 1 each and sum to the {t} new tokens")
    seq_max = max(p + e for p, e in zip(pre, ext, strict=True))
    if seq_max > batch.slot_table.shape[1]:
        raise ValueError(
            f"slot_table has {batch.slot_table.shape[1]} columns but a sequence holds {seq_max} "
            "tokens after this step: widen the table to max(prefix_lens + extend_lens)"
        )
    return ext, pre
