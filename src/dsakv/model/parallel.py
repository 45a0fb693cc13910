"""Tensor parallelism for the reference model: one rank's shard of a checkpoint, and the sum over the TP group.

Rank r of T holds (T divides the heads H, the dense intermediate I and the expert intermediate Ie):

    q_b_proj, kv_b_proj   rows of heads [r*H/T, (r+1)*H/T)          column parallel
    o_proj                the same heads' input columns             row parallel    -> partial sum
    dense MLP             gate/up rows, down columns of slice r     col / row       -> partial sum
    MoE                   slice r of every routed and shared expert's intermediate; router replicated
                                                                                    -> partial sum
    replicated            embeddings, q_a / kv_a projections and their norms, the whole indexer, final norm, LM head

The shard is a smaller model built by the ordinary loader (config heads H/T, intermediates I/T, Ie/T; the cache
identity of ModelSpec does not depend on them), so the model's code has no TP branches except the hook in
DecoderLayer: one all-reduce after o_proj and one after the MLP/MoE down projection, the residual added on rank
0 only (T = 1 is the single-rank arithmetic). Every rank writes the same MLA latent KV and index-K (computed from
replicated weights on the same hidden states): each rank's pool holds the full keys, as the production engines'.
Collectives: torch.distributed, gloo for CPU tensors, nccl for CUDA ones; nothing here assumes a device.
Imports torch, dsakv.spec and dsakv.model.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from dsakv.errors import ConfigError
from dsakv.model.dsa_model import DecoderLayer, DSAModel
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0  # every rank must join (and every collective finish) within this

_ROW = re.compile(
    r"\.(self_attn\.(q_b_proj|kv_b_proj)|mlp(\.shared_experts|\.experts\.\d+)?\.(gate_proj|up_proj))\.weight$"
)
_COL = re.compile(r"\.(self_attn\.o_proj|mlp(\.shared_experts|\.experts\.\d+)?\.down_proj)\.weight$")
_O_BIAS = re.compile(r"\.self_attn\.o_proj\.bias$")


class TPGroup:
    """One rank's view of its tensor-parallel group: `reduce(x)` sums x over the group in place (the hook
    DecoderLayer calls); `lead` is rank 0, the rank that adds the residual."""

    def __init__(self, rank: int, size: int, group: Any = None) -> None:
        if not 0 <= rank < size:
            raise ConfigError(f"TP rank {rank} is outside the group of {size} ranks (0..{size - 1})")
        self.rank, self.size, self.group = rank, size, group
        self.lead = rank == 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def __repr__(self) -> str:
        return f"TPGroup(rank={self.rank}, size={self.size})"


def init_group(rank: int, size: int, addr: str, port: int, device: str = "cpu") -> TPGroup:
    """Join the TP group at tcp://addr:port (rank 0 listens): gloo for a CPU model, nccl for a CUDA one."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend,
            init_method=f"tcp://{addr}:{port}",
            rank=rank,
            world_size=size,
            timeout=_dt.timedelta(seconds=INIT_TIMEOUT_S),
        )
    return TPGroup(rank, size)


def _divide(what: str, value: int, size: int) -> int:
    if value % size:
        raise ConfigError(f"{what} = {value} is not divisible by --tp-size {size}: pick a TP size dividing {value}")
    return value // size


def shard_config(cfg: dict[str, Any], size: int) -> dict[str, Any]:
    """The config of one rank's shard: heads and intermediates divided by `size` (the cache shape unchanged)."""
    out = dict(cfg)
    out["num_attention_heads"] = _divide("num_attention_heads", int(cfg["num_attention_heads"]), size)
    if "num_key_value_heads" in cfg:
        out["num_key_value_heads"] = _divide("num_key_value_heads", int(cfg["num_key_value_heads"]), size)
    if cfg.get("intermediate_size"):
        out["intermediate_size"] = _divide("intermediate_size", int(cfg["intermediate_size"]), size)
    if cfg.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = _divide("moe_intermediate_size", int(cfg["moe_intermediate_size"]), size)
    return out


def shard_state_dict(sd: dict[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s tensors of a (transformers-named) state dict; replicated tensors are passed through."""
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if _ROW.search(name):
            t = t.chunk(size, dim=0)[rank].contiguous()
        elif _COL.search(name):
            t = t.chunk(size, dim=1)[rank].contiguous()
        elif _O_BIAS.search(name) and rank != 0:
            t = torch.zeros_like(t)  # o_proj's bias is added once, by rank 0
        out[name] = t
    return out


def attach(model: DSAModel, group: TPGroup) -> DSAModel:
    """Set the all-reduce hook on every decoder layer of a sharded model."""
    for layer in model.model.layers:
        cast(DecoderLayer, layer).reduce = group
    return model


def load_tp_model(
    path: str | Path, group: TPGroup, *, dtype: torch.dtype = torch.float32
) -> tuple[ModelSpec, DSAModel]:
    """(full spec, this rank's sharded model) of the checkpoint in `path`: the spec is the checkpoint's own (the
    pool's layout and every peer see the whole model), the model holds this rank's shard."""
    from dsakv.model.loader import load_config, load_model

    spec = ModelSpec.from_dict(load_config(path), name=Path(path).name)
    _, model = load_model(
        path,
        dtype=dtype,
        shard=lambda cfg, sd: (shard_config(cfg, group.size), shard_state_dict(sd, group.rank, group.size)),
    )
    if model.spec.identity_hash() != spec.identity_hash():  # the shard's cache shape is the whole model's
        raise AssertionError("a TP shard changed the cache identity")
    log.info(
        "TP rank %d/%d: %.1fM parameters", group.rank, group.size, sum(p.numel() for p in model.parameters()) / 1e6
    )
    return spec, attach(model, group)
