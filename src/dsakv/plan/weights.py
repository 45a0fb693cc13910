"""Estimate of weight bytes per layer from a ModelSpec and a weight format.

An estimate, and reported as one: it counts the linear projections, experts,
norms and embeddings of a DeepSeek-V3.2 / GLM-5 style model. No torch.
"""

from __future__ import annotations

from dsakv.errors import ConfigError
from dsakv.plan.ranks import SINGLE, RankGrid
from dsakv.spec.model import ModelSpec

# bytes per parameter of quantised linear weights, scales included
WEIGHT_FORMATS: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp8": 1.0 + 4.0 / (128 * 128),  # block-scaled fp8, one fp32 per 128x128 block
    "int8": 1.0 + 4.0 / 1024,  # int8 weight-only (--weight-dtype int8): one fp32 scale per output row of >= 1024
    "nvfp4": 0.5 + 1.0 / 16 + 4.0 / (16 * 4096),  # fp4 + fp8 scale per 16, global fp32
}
_HIGH = 2.0  # embeddings, norms, router stay in bf16


def weight_format_for(spec: ModelSpec, override: str | None) -> str:
    if override is not None:
        if override not in WEIGHT_FORMATS:
            raise ConfigError(f"weight format {override!r} is unknown: use one of {', '.join(WEIGHT_FORMATS)}")
        return override
    q = spec.quantization.lower()
    if "fp4" in q or "modelopt" in q:
        return "nvfp4"
    if "fp8" in q:
        return "fp8"
    if q in ("float32", "fp32"):
        return "fp32"
    return "bf16"


def _attention_params(spec: ModelSpec, with_indexer: bool) -> tuple[int, int, int]:
    """(replicated linear params, head-split linear params, high-precision params) of one attention block.

    Head-split: q_b (or q) and kv_b (column parallel), o_proj (row parallel); the rest (q_a, kv_a, norms, the
    whole indexer) is replicated on every attention-TP rank.
    """
    h, nh = spec.hidden_size, spec.num_attention_heads
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    rep = split = 0
    high = 2 * h  # input + post-attention norms
    if spec.q_lora_rank:
        rep += h * spec.q_lora_rank
        split += spec.q_lora_rank * nh * qk
        high += spec.q_lora_rank
    else:
        split += h * nh * qk
    rep += h * (spec.kv_lora_rank + spec.qk_rope_head_dim)
    high += spec.kv_lora_rank
    split += spec.kv_lora_rank * nh * (spec.qk_nope_head_dim + spec.v_head_dim)
    split += nh * spec.v_head_dim * h
    if with_indexer and spec.has_indexer:
        q_in = spec.q_lora_rank or h
        rep += q_in * spec.index_n_heads * spec.index_head_dim + h * spec.index_head_dim
        high += h * spec.index_n_heads + 2 * spec.index_head_dim
    return rep, split, high


def _mlp_params(spec: ModelSpec, moe: bool) -> tuple[int, int, int]:
    """(dense-or-shared-expert linear params, routed-expert linear params, high-precision params)."""
    h = spec.hidden_size
    if not moe or spec.n_routed_experts == 0:
        return 3 * h * spec.intermediate_size, 0, 0
    shared = spec.n_shared_experts * 3 * h * spec.moe_intermediate_size
    routed = spec.n_routed_experts * 3 * h * spec.moe_intermediate_size
    return shared, routed, h * spec.n_routed_experts + spec.n_routed_experts


def layer_weight_bytes(spec: ModelSpec, layer: int, weight_format: str, grid: RankGrid = SINGLE) -> int:
    """Estimated bytes of one layer's weights (main or draft) on one rank of `grid` (the whole layer by default)."""
    qb = WEIGHT_FORMATS[weight_format]
    atp = grid.attention_tp
    draft = layer >= spec.num_layers
    owns = draft or (not spec.has_indexer) or spec.indexer_types[layer] == "full"
    rep_a, split_a, high_a = _attention_params(spec, with_indexer=owns)
    dense_m, routed_m, high_m = _mlp_params(spec, moe=draft or layer >= spec.first_k_dense_replace)
    # the routed experts split over the MoE group's tp ranks; an MTP draft layer under DP attention is whole on every
    # DP rank (each drafts for its own requests with no collective in the draft: disagg/decode/dp.py)
    lin = rep_a + split_a / atp + dense_m / atp + routed_m / (1 if draft and grid.dp_attention else grid.tp)
    total = lin * qb + (high_a + high_m) * _HIGH
    if draft:  # MTP block: enorm, hnorm, eh_proj, its own final norm
        total += (2 * spec.hidden_size * spec.hidden_size) * _HIGH + 3 * spec.hidden_size * _HIGH
    return int(total)


def reform_headroom_bytes(spec: ModelSpec, start: int, end: int, weight_format: str, grid: RankGrid) -> int:
    """Routed-expert bytes one surviving rank of an elastic EP group (DP attention, engine/elastic.py) loads on
    top of its weights after one rank died: ceil((E/ep) / (ep-1)) of the dead rank's experts per MoE layer of
    layers [start, end) (0 without DP attention or EP)."""
    if not grid.dp_attention or grid.ep < 2 or not spec.n_routed_experts:
        return 0
    extra = -(-(spec.n_routed_experts // grid.ep) // (grid.ep - 1))
    one = 3 * spec.hidden_size * spec.moe_intermediate_size * WEIGHT_FORMATS[weight_format] / grid.moe_tp
    return int(sum(extra * one for i in range(start, min(end, spec.num_layers)) if i >= spec.first_k_dense_replace))


def embedding_bytes(spec: ModelSpec, grid: RankGrid = SINGLE) -> int:
    """Embedding bytes on one rank (vocab-parallel over the attention-TP ranks)."""
    return int(spec.vocab_size * spec.hidden_size * _HIGH / grid.attention_tp)


def lm_head_bytes(spec: ModelSpec, grid: RankGrid = SINGLE) -> int:
    """LM head (vocab-parallel over the attention-TP ranks) + final norm bytes on one rank."""
    head = 0 if spec.tie_word_embeddings else spec.vocab_size * spec.hidden_size
    return int(head * _HIGH / grid.attention_tp + spec.hidden_size * _HIGH)


def stage_weight_bytes(
    spec: ModelSpec,
    start: int,
    end: int,
    draft_layers: int,
    weight_format: str,
    *,
    first: bool,
    last: bool,
    grid: RankGrid = SINGLE,
) -> int:
    """Weights one rank of a PP stage holds: its layers, its draft layers, embeddings on the first, head on the
    last (the whole stage with the default single-rank grid)."""
    total = sum(layer_weight_bytes(spec, i, weight_format, grid) for i in range(start, end))
    total += sum(layer_weight_bytes(spec, spec.num_layers + j, weight_format, grid) for j in range(draft_layers))
    if first or draft_layers:
        total += embedding_bytes(spec, grid)
    if last or draft_layers:
        total += lm_head_bytes(spec, grid)
    return total


def model_weight_bytes(spec: ModelSpec, weight_format: str) -> int:
    return stage_weight_bytes(spec, 0, spec.num_layers, spec.num_draft_layers, weight_format, first=True, last=True)
