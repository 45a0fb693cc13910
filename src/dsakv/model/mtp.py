"""MTP (next-n) draft layer of GLM-5.x / DeepSeek-V3.x, reading and writing the paged pool like a main layer.

A checkpoint with `num_nextn_predict_layers` = n >= 1 stores draft layer j at index num_hidden_layers + j:

    model.layers.{N+j}.enorm / hnorm          RMSNorm of the next token's embedding / of the previous hidden
    model.layers.{N+j}.eh_proj                Linear(2H -> H) over [enorm(embed) | hnorm(hidden)]
    model.layers.{N+j}.self_attn / mlp / input_layernorm / post_attention_layernorm
                                              a full decoder layer: its own MLA, indexer (always a producer), MoE
    model.layers.{N+j}.shared_head.norm       its final norm; the head is the shared lm_head
    (model.layers.{N+j}.embed_tokens, shared_head.head: copies of the shared ones, ignored as transformers does)

Entry i of the draft layer pairs the target's final (normed) hidden state at position i with the embedding of
token i+1, at rope position i+1 (transformers' MtpModel and Megatron shift positions with the tokens), and
predicts token i+2. Its KV / INDEX_K row lives at token i's slot under BufferKey(N+j, ...), so a chunk of
target tokens [s, e) gives draft entries [s, e) in the same slots: the draft batch is the target batch with
input_ids shifted by one token and positions + 1. Reused K times (speculative steps), the draft chains its
own output (after shared_head.norm) as the next "previous hidden".
Imports torch and dsakv.model.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from dsakv.cache.device_pool import DevicePool
from dsakv.model.batch import ForwardBatch
from dsakv.model.config import DSAConfig
from dsakv.model.dsa_model import DecoderLayer, DSAModel
from dsakv.model.layers import RMSNorm

# checkpoint sub-names of a draft layer that are not part of its decoder block
MTP_OWN_PREFIXES = ("enorm.", "hnorm.", "eh_proj.", "shared_head.norm.")
# copies of the shared embedding / head some checkpoints store in the draft layer (DeepSeek-V3): ignored
MTP_SHARED_COPIES = ("embed_tokens.", "shared_head.head.")


def draft_mlp_type(cfg: DSAConfig) -> str:
    """MTP layers are MoE layers whenever the model has routed experts (as in GLM-5 and DeepSeek-V3)."""
    mtp = cfg.spec.raw.get("mtp_mlp_layer_types")
    if isinstance(mtp, list) and mtp and mtp[0] in ("dense", "sparse"):
        return str(mtp[0])
    return "sparse" if cfg.spec.n_routed_experts else "dense"


class _SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPLayer(nn.Module):
    """One draft layer: parameters named as in the checkpoint (block = the decoder layer's own names)."""

    def __init__(self, cfg: DSAConfig, layer_id: int) -> None:
        super().__init__()
        h = cfg.spec.hidden_size
        self.layer_id = layer_id
        self.enorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        # a decoder layer built as layer 0 (always a producer, 'full') with the draft's MLP type, then keyed by
        # its own layer id, so its KV / INDEX_K are BufferKey(layer_id, ...) in the pool
        n = cfg.spec.num_layers
        block_cfg = dataclasses.replace(cfg, mlp_layer_types=(draft_mlp_type(cfg),) * n)
        self.block = DecoderLayer(block_cfg, 0)
        self.block.self_attn.layer = layer_id
        self.shared_head = _SharedHead(h, cfg.rms_norm_eps)

    def forward(self, embeds: torch.Tensor, prev_hidden: torch.Tensor, ctx: object) -> torch.Tensor:
        """[T, H] embeddings of the next tokens and [T, H] previous hidden states -> [T, H] (after shared_head.norm)."""
        x = self.eh_proj(torch.cat((self.enorm(embeds), self.hnorm(prev_hidden.to(embeds.dtype))), dim=-1))
        x, _ = self.block(x, ctx, None)
        return self.shared_head.norm(x)


class MTPDraft(nn.Module):
    """The draft model: the checkpoint's MTP layers over the target's shared embedding and lm_head."""

    def __init__(self, cfg: DSAConfig, num_layers: int = 1) -> None:
        super().__init__()
        if num_layers < 1:
            raise ValueError(f"an MTP draft needs at least one layer, got {num_layers}")
        self.cfg = cfg
        n = cfg.spec.num_layers
        self.layers = nn.ModuleList(MTPLayer(cfg, n + j) for j in range(num_layers))
        self._layer_ids = tuple(n + j for j in range(num_layers))

    @property
    def layer_ids(self) -> tuple[int, ...]:
        """Pool layer ids of the draft layers (num_hidden_layers + j)."""
        return self._layer_ids

    def step(
        self,
        target: DSAModel,
        batch: ForwardBatch,
        prev_hidden: torch.Tensor,
        pool: DevicePool,
        depth: int = 0,
    ) -> torch.Tensor:
        """Run draft layer `depth` (0 for a reused single layer) on a draft batch; returns [T, H] hidden states.

        `batch` is the draft batch (input_ids = the next tokens, positions = target positions + 1, the target's
        slots); `prev_hidden` [T, H] the target's final normed hidden state (or the draft's own, chained).
        Writes the draft layer's KV and INDEX_K at batch.out_slots.
        """
        layer = self.layers[depth % len(self.layers)]
        with torch.inference_mode():
            ctx = target.make_context(batch, pool)
            embeds = target.model.embed_tokens(batch.input_ids.to(target.device))
            return layer(embeds, prev_hidden.to(target.device), ctx)

    @staticmethod
    def logits(target: DSAModel, hidden: torch.Tensor) -> torch.Tensor:
        """Draft logits (float32) of draft hidden states: the shared lm_head."""
        with torch.inference_mode():
            return target.lm_head(hidden.to(target.dtype)).float()


def checkpoint_name(name: str, num_layers: int) -> str:
    """MTPDraft parameter name ('layers.0.block.self_attn.q_a_proj.weight') -> checkpoint name
    ('model.layers.{N}.self_attn.q_a_proj.weight')."""
    parts = name.split(".", 2)
    if parts[0] != "layers" or len(parts) < 3:
        raise ValueError(f"{name!r} is not an MTPDraft parameter name")
    j, rest = int(parts[1]), parts[2]
    rest = rest.removeprefix("block.")
    return f"model.layers.{num_layers + j}.{rest}"


def draft_name(ckpt_name: str, num_layers: int, num_draft: int) -> str | None:
    """Checkpoint name of a draft-layer tensor -> MTPDraft parameter name; None for ignored shared copies and
    for names that are not draft-layer tensors."""
    if not ckpt_name.startswith("model.layers."):
        return None
    idx, _, rest = ckpt_name.removeprefix("model.layers.").partition(".")
    if not idx.isdigit() or not num_layers <= int(idx) < num_layers + num_draft:
        return None
    j = int(idx) - num_layers
    if rest.startswith(MTP_SHARED_COPIES):
        return None
    if rest.startswith(MTP_OWN_PREFIXES):
        return f"layers.{j}.{rest}"
    return f"layers.{j}.block.{rest}"
