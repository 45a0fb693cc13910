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
Imports torch, dsakv.spec, dsakv.cache.fingerprint and dsakv.model.
"""

from __future__ import annotations

import datetime as _dt
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from dsakv.cache.fingerprint import SHARD
from dsakv.errors import ConfigError
from dsakv.model.dsa_model import DecoderLayer, DSAModel
from dsakv.model.layers import MLP, MoE, Router
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)

INIT_TIMEOUT_S = 120.0  # every rank must join (and every collective finish) within this: the bound on a step's
# wait for a peer (a dead peer usually fails the collective at once: its sockets close; engine/ranks.py)

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
        self.on_error: Callable[[Exception], BaseException] | None = None  # what a failed reduce raises instead

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            try:
                dist.all_reduce(x, group=self.group)
            except Exception as e:  # engine/ranks.py: a rank died -> RankDown naming it, not the transport's error
                raise (self.on_error(e) if self.on_error else e) from e
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


def divide(what: str, value: int, size: int, flag: str = "--tp-size") -> int:
    if value % size:
        raise ConfigError(f"{what} = {value} is not divisible by {flag} {size}: pick a size dividing {value}")
    return value // size


def shard_config(cfg: dict[str, Any], size: int) -> dict[str, Any]:
    """The config of one rank's shard: heads and intermediates divided by `size` (the cache shape unchanged)."""
    out = dict(cfg)
    out["num_attention_heads"] = divide("num_attention_heads", int(cfg["num_attention_heads"]), size)
    if "num_key_value_heads" in cfg:
        out["num_key_value_heads"] = divide("num_key_value_heads", int(cfg["num_key_value_heads"]), size)
    if cfg.get("intermediate_size"):
        out["intermediate_size"] = divide("intermediate_size", int(cfg["intermediate_size"]), size)
    if cfg.get("moe_intermediate_size"):
        out["moe_intermediate_size"] = divide("moe_intermediate_size", int(cfg["moe_intermediate_size"]), size)
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
    setattr(model, SHARD, f"tp {group.rank}/{group.size}")
    log.info(
        "TP rank %d/%d: %.1fM parameters", group.rank, group.size, sum(p.numel() for p in model.parameters()) / 1e6
    )
    return spec, attach(model, group)


def load_tp_draft(
    path: str | Path, group: TPGroup, *, dtype: torch.dtype = torch.float32, weight_dtype: str = "model"
) -> Any:
    """This rank's shard of the checkpoint's MTP draft layer, split as the target layers are (q_b / kv_b rows and
    o_proj columns by head, every expert's intermediate; eh_proj, enorm / hnorm, shared_head.norm, router, q_a /
    kv_a, the indexer replicated), its block all-reducing like theirs: every rank writes the same draft KV /
    INDEX_K and gets the same (bitwise, all-reduced) draft hidden states, so every rank drafts the same tokens."""
    from dsakv.model.loader import load_draft

    draft = load_draft(
        path,
        dtype=dtype,
        weight_dtype=weight_dtype,
        shard=lambda cfg, sd: (shard_config(cfg, group.size), shard_state_dict(sd, group.rank, group.size)),
    )
    for layer in draft.layers:
        cast(DecoderLayer, cast(Any, layer).block).reduce = group
    return draft


# ---- expert parallel (with DP attention: every rank its own tokens) -----------------------------------------


class EPMoE(nn.Module):
    """The MoE of one rank of an expert-parallel group of P ranks: experts [r*E/P, (r+1)*E/P) held here (its home
    experts), router and shared expert replicated. Per call (every rank calls it once per MoE layer and step, an
    idle rank with 0 rows):

        route locally -> rows sorted by (owner rank, expert id), stable -> all-to-all counts
        -> all-to-all rows (dispatch) -> each local expert on its rows -> all-to-all back (combine)
        -> out = index_add(rows x routing weights, in (expert id, token) order) + shared expert (+ residual)

    The combine adds in the single-rank grouped path's order (expert id, then token); an expert's batch is its rows
    from every rank (rank order, token order) wherever the expert runs, so the output does not depend on the
    placement. `place` re-places the experts over a re-formed group (engine/elastic.py): `owner` maps each expert
    to its rank's index in the group; experts a rank owns beyond its home ones are `guests` (loaded by the caller
    from the checkpoint, dropped when their home rank is back). Collectives: all_to_all_single over the EP group
    (none in a group of one)."""

    def __init__(self, moe: MoE, rank: int, size: int, group: Any = None) -> None:
        super().__init__()
        n = len(moe.experts)
        per = divide("n_routed_experts", n, size, "--ep-size")
        self.gate = moe.gate
        self.shared_experts = moe.shared_experts
        self.first, self.per, self.size, self.group = rank * per, per, size, group
        self.experts = nn.ModuleList(moe.experts[self.first + i] for i in range(per))
        self.owner = torch.arange(n) // per  # expert id -> the group index of the rank that runs it
        self.mine = list(range(self.first, self.first + per))  # the expert ids this rank runs, ascending
        self.guests: dict[int, nn.Module] = {}  # experts of a dead rank run here (not in the state dict)
        self.calls = 0
        self.on_error: Callable[[Exception], BaseException] | None = None  # a broken all-to-all raises this instead

    def place(self, owner: list[int], me: int, size: int, guests: dict[int, nn.Module]) -> None:
        """Run expert e on group index owner[e]; this rank is index `me` of `size` and runs its home experts it
        owns plus `guests` (exactly the other experts owner gives it)."""
        self.owner = torch.tensor(owner, dtype=torch.int64)
        self.size = size
        self.mine = [e for e, o in enumerate(owner) if o == me]
        self.guests = dict(guests)

    def _expert(self, e: int) -> MLP:
        home = e - self.first
        return cast(MLP, self.experts[home] if 0 <= home < self.per else self.guests[e])

    def _a2a(self, x: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        out = x.new_empty((sum(recv), *x.shape[1:]))
        self._coll(out, x.contiguous(), recv, send)
        return out

    def _coll(self, out: torch.Tensor, x: torch.Tensor, recv: list[int] | None, send: list[int] | None) -> None:
        if self.size == 1:
            out.copy_(x)
            return
        try:
            dist.all_to_all_single(out, x, recv, send, group=self.group)
        except Exception as e:  # engine/dp.py: a rank died -> RankDown naming it, not the transport's error
            raise (self.on_error(e) if self.on_error else e) from e

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The layer (pure in x); run again from the start when `on_error` re-formed the group (EPReformed)."""
        for _ in range(MAX_REFORMS):
            try:
                return self._forward(x, residual)
            except EPReformed:
                continue
        return self._forward(x, residual)

    def _forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1
        n = x.shape[0]
        gate = cast(Router, self.gate)
        weights, ids = gate.route(F.linear(x.to(gate.weight.dtype), gate.weight).float())
        k = ids.shape[1] if n else gate.top_k
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (expert id, token): the combine's order
        dest = self.owner.to(flat.device)[flat[order]]
        perm = torch.argsort(dest, stable=True)  # -> (owner, expert id, token): the dispatch's order
        sent = order[perm]
        send_t = torch.bincount(dest, minlength=self.size)
        recv_t = torch.empty_like(send_t)
        self._coll(recv_t, send_t, None, None)
        send, recv = send_t.tolist(), recv_t.tolist()
        rows = self._a2a(x[torch.div(sent, k, rounding_mode="floor")], send, recv)
        eids = self._a2a(flat[sent], send, recv)
        y = rows.new_zeros(rows.shape)
        for e in self.mine:
            sel = (eids == e).nonzero().squeeze(1)
            if sel.numel():
                xe = rows[sel]
                expert = self._expert(e)
                g, u, d = expert.gate_proj.weight, expert.up_proj.weight, expert.down_proj.weight
                y[sel] = F.linear(F.silu(F.linear(xe, g)) * F.linear(xe, u), d)
        back = y.new_empty((len(sent), *y.shape[1:]))
        back[perm] = self._a2a(y, recv, send)  # back in (expert id, token) order
        back = back * weights.reshape(-1)[order, None]
        tok = torch.div(order, k, rounding_mode="floor")
        out = torch.zeros_like(x).index_add_(0, tok, back.to(x.dtype))
        sh = cast(MLP, self.shared_experts)
        out.add_(
            F.linear(F.silu(F.linear(x, sh.gate_proj.weight)) * F.linear(x, sh.up_proj.weight), sh.down_proj.weight)
        )
        return out if residual is None else out.add_(residual)


class EPReformed(Exception):
    """What an EPMoE's `on_error` returns once it re-formed the group over the ranks still up and re-placed the
    experts (disagg/prefill/dp_pp.py): the layer runs again over the new group (every survivor failed the same
    all-to-all, so every survivor runs the same layer again)."""


MAX_REFORMS = 8  # an EPMoE layer runs again at most this often (each re-form drops at least one dead rank)


def ep_owners(n_experts: int, size: int, members: list[int]) -> list[int]:
    """The DP rank that runs each expert when only `members` (DP ranks of a group of `size`) are up: an expert's
    home rank r (experts [r E/size, (r+1) E/size)) while it is up, else the survivors round robin over the orphaned
    experts in id order (each survivor gets at most ceil(orphans / survivors) more)."""
    per = divide("n_routed_experts", n_experts, size, "--ep-size")
    up = sorted(members)
    out, orphans = [], 0
    for e in range(n_experts):
        home = e // per
        if home in up:
            out.append(home)
        else:
            out.append(up[orphans % len(up)])
            orphans += 1
    return out


def attach_ep(model: DSAModel, rank: int, size: int, group: Any = None) -> DSAModel:
    """Replace every MoE layer of a (whole) model by this rank's EPMoE; the other ranks' experts are dropped."""
    for layer in model.model.layers:
        dl = cast(DecoderLayer, layer)
        if isinstance(dl.mlp, MoE):
            dl.mlp = EPMoE(dl.mlp, rank, size, group)
    setattr(model, SHARD, f"ep {rank}/{size}")
    return model


def idle_forward(model: DSAModel, layers: Iterable[int] | None = None) -> int:
    """An idle DP rank's share of one step: every EPMoE layer (of `layers`, a pipeline stage's; default all) with 0
    rows (its peers' dispatch needs it)."""
    hidden = model.spec.hidden_size
    x = torch.empty((0, hidden), dtype=model.dtype, device=model.device)
    n = 0
    every = model.model.layers
    with torch.inference_mode():
        for layer in every if layers is None else (every[i] for i in layers):
            mlp = cast(DecoderLayer, layer).mlp
            if isinstance(mlp, EPMoE):
                mlp.forward(x)
                n += 1
    return n


def any_rank(flag: bool, device: str = "cpu") -> bool:
    """True on every rank iff `flag` is True on some rank (one all-reduce)."""
    if not dist.is_initialized():
        return flag
    t = torch.tensor([1 if flag else 0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())
