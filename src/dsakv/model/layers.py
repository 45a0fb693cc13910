"""Per-token building blocks of a DSA decoder layer: RMSNorm, dense MLP, MoE (sigmoid noaux_tc router).

Parameter names follow transformers' GlmMoeDsa / DeepseekV32 modules so a checkpoint's
state dict loads by name. Experts are a ModuleList of MLPs (`experts.{e}.gate_proj`, ...),
the layout real checkpoints and transformers' save_pretrained use.

Linear layers that read the same input run as one matmul (LinearGroup): their weights become row views of
one fused tensor, so nothing is stored twice and the state dict keeps transformers' names.
Imports torch and dsakv.model.{config, gemv, moe_fused, native, quant}.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.model.config import DSAConfig
from dsakv.model.gemv import compiled_gemv_on, gemv
from dsakv.model.gemv import rms_norm as compiled_rms_norm
from dsakv.model.moe_fused import moe_one, route
from dsakv.model.native import moe_experts
from dsakv.model.quant import dequantize, gemv_applies, qlinear, weight_scale

# MoE path rule (MoE.choose_path): one framework op on a small expert slice costs about as long as this many
# multiply-adds of batched expert work. Measured on the 2-core CI box (bench/engine.py's tiny checkpoint,
# 1 torch thread): a per-expert gate/up/down iteration (5 ops) took as long as 250-1000 rows of the padded
# batched form (6144 multiply-adds a row), i.e. 60K-300K multiply-adds per op depending on load.
MOE_OP_MACS = 100_000
MOE_LOOP_OPS = 6  # ops per hit expert on the per-expert path (slice, 3 linears, silu, mul)
MOE_SORT_OPS = 12  # bookkeeping ops the grouped paths (padded, per expert) run and the dense path does not


class LinearGroup:
    """nn.Linear layers that read the same input, run as one F.linear over a fused [sum of outputs, in] weight.

    The fused weight (and bias, zeros for members without one) is built on first use and each member's
    parameters are re-pointed as row views into it, so nothing is stored twice and a state dict loaded in place
    updates both. It is rebuilt if the members' storage moved (`.to(device)`, a reassigned parameter).
    Members whose dtype or device differs from the first member's (float32 router or indexer weights in a bf16
    model) run on their own. Not a Module: it holds no parameters of its own.
    """

    def __init__(self, linears: Sequence[nn.Module]) -> None:
        self.linears = list(linears)  # nn.Linear, or any module with .weight [out, in] and an optional .bias
        self.sizes = [int(_w(m).shape[0]) for m in self.linears]
        self._fused: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int]] | None = None
        self._ptrs: tuple[int, int] = (0, 0)
        self._ends: tuple[nn.Module, nn.Module] = (self.linears[0], self.linears[-1])

    def _current(self) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, list[int]]:
        f = self._fused
        if f is not None:
            head, tail = self._ends
            if (_w(head).data_ptr(), _w(tail).data_ptr()) == self._ptrs:
                return f
        first = _w(self.linears[0])
        members = [i for i, m in enumerate(self.linears) if _w(m).dtype == first.dtype and _w(m).device == first.device]
        with torch.inference_mode(False), torch.no_grad():
            w = torch.cat([_w(self.linears[i]) for i in members])
            scales = [weight_scale(self.linears[i]) for i in members]
            scale = torch.cat(cast(list[torch.Tensor], scales)) if scales[0] is not None else None  # int8 members
            biases = [_bias(self.linears[i]) for i in members]
            bias = None
            if any(b is not None for b in biases):
                sizes = [self.sizes[i] for i in members]
                bias = torch.cat([w.new_zeros(n) if b is None else b for b, n in zip(biases, sizes, strict=True)])
            start = 0
            for i, b in zip(members, biases, strict=True):
                n = self.sizes[i]
                _w(self.linears[i]).data = w[start : start + n]
                if scale is not None:
                    self.linears[i].weight_scale = scale[start : start + n]
                if b is not None:
                    assert bias is not None
                    b.data = bias[start : start + n]
                start += n
        self._fused = (w, scale, bias, members)
        self._ends = (self.linears[members[0]], self.linears[members[-1]])  # whose storage _current watches
        self._ptrs = (_w(self._ends[0]).data_ptr(), _w(self._ends[1]).data_ptr())
        return self._fused

    def plain_weight(self) -> torch.Tensor | None:
        """The fused [sum of outputs, in] weight when every member is in it, unscaled (not int8) and without a
        bias (what a compiled kernel can take as one input), else None."""
        w, scale, bias, members = self._current()
        return w if scale is None and bias is None and len(members) == len(self.linears) else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """[..., in] -> one [..., out_i] tensor per member (views of one result for the fused members)."""
        w, scale, bias, members = self._current()
        y = qlinear(x if scale is not None or x.dtype == w.dtype else x.to(w.dtype), w, scale, bias)
        if len(members) == len(self.linears):
            return list(y.split_with_sizes(self.sizes, dim=-1)) if len(members) > 1 else [y]
        parts = iter(torch.split(y, [self.sizes[i] for i in members], dim=-1))
        out = []
        for i, m in enumerate(self.linears):
            alone = x if weight_scale(m) is not None else x.to(_w(m).dtype)
            out.append(next(parts) if i in members else linear(alone, m))
        return out


def _w(m: nn.Module) -> torch.Tensor:
    """A linear member's weight (typed: nn.Module attributes are Tensor | Module to mypy)."""
    return cast(torch.Tensor, m.weight)


def _bias(m: nn.Module) -> torch.Tensor | None:
    b = getattr(m, "bias", None)
    return b if isinstance(b, torch.Tensor) else None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * (x / rms(x)), the normalisation in float32 (as transformers). The hot path calls this directly
    with the RMSNorm's weight and eps (no Module call per use)."""
    if x.dtype is torch.float32 and weight.dtype is torch.float32:
        y = compiled_rms_norm(x, weight, eps)  # --compile: one kernel at decode, else None
        # transformers' formula (x * rsqrt(mean(x^2) + eps) * weight), bitwise: one call, its ops in C++
        return F.rms_norm(x, (x.shape[-1],), weight, eps) if y is None else y
    h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, eps)
    return weight * h.to(x.dtype)


def linear(x: torch.Tensor, m: nn.Module) -> torch.Tensor:
    """m(x) without the Module call machinery (the hot path runs hundreds of these per step); int8 weights
    (pack_int8) through quant.qlinear."""
    return qlinear(x, _w(m), weight_scale(m), _bias(m))


def linear_add(x: torch.Tensor, m: nn.Module, residual: torch.Tensor | None) -> torch.Tensor:
    """residual + m(x) as one addmm (x and residual 2-D); m(x) if residual is None."""
    return matmul_add(x, _w(m), weight_scale(m), _bias(m), residual)


def matmul_add(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """residual + x @ w^T (+ bias) as one addmm (w int8 with its scale: quant.qlinear's weight; on the GEMV kernels,
    int8 or --compile's float one, the residual is added after it, dequantised it goes through the same addmm)."""
    if scale is not None:
        if residual is None or gemv_applies(x):
            y = qlinear(x, w, scale, bias)
            return y if residual is None else y.add_(residual)
        w = dequantize(w, scale, x.dtype)
    if residual is None:
        return qlinear(x, w, None, bias)
    g = gemv(x, w)  # the compiled float GEMV (--compile) for a few rows, else None
    if g is not None:
        return (g if bias is None else g.add_(bias)).add_(residual)
    if bias is not None:
        return torch.addmm(residual, x, w.t()).add_(bias)
    return torch.addmm(residual, x, w.t())


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up run as one matmul unless fuse=False (routed experts, whose
    weights the MoE stacks itself)."""

    def __init__(self, hidden: int, intermediate: int, fuse: bool = True) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._gate_up = LinearGroup([self.gate_proj, self.up_proj]) if fuse else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)), plus `residual` when given (added inside the down matmul)."""
        if self._gate_up is None:
            return linear_add(F.silu(linear(x, self.gate_proj)) * linear(x, self.up_proj), self.down_proj, residual)
        g, u = self._gate_up(x)
        return linear_add(F.silu(g).mul_(u), self.down_proj, residual)


class Router(nn.Module):
    """Sigmoid scores + e_score_correction_bias for the choice, group-limited top-k, renormalised, scaled."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.num_experts = s.n_routed_experts
        self.top_k = s.num_experts_per_tok
        self.n_group = cfg.n_group
        self.topk_group = cfg.topk_group
        self.norm_topk_prob = cfg.norm_topk_prob
        self.routed_scaling_factor = cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.num_experts, s.hidden_size, dtype=torch.float32))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (weights float32 [N, top_k], expert ids int64 [N, top_k])."""
        return self.route(F.linear(x.to(torch.float32), self.weight.to(torch.float32)))

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Router logits float32 [N, num_experts] -> (weights, expert ids), as forward (moe_fused.route)."""
        return route(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )


def choose_moe_path(tokens: int, top_k: int, experts: int, row_macs: int, counts: list[int] | None = None) -> str:
    """The MoE path for `tokens` rows, from multiply-adds plus framework ops costed at MOE_OP_MACS each:

        dense      every expert runs every token (no grouping):      E*N rows
        padded     grouped rows padded to the busiest expert (cap):  E*cap rows + MOE_SORT_OPS
        per_expert each hit expert on its slice:                     N*k rows   + MOE_SORT_OPS + MOE_LOOP_OPS*hit

    row_macs = multiply-adds of one row through one expert (3 * hidden * intermediate). Without `counts`
    (tokens per expert) only "dense" or "grouped" is decided; with them, "padded" or "per_expert".
    """
    nk = tokens * top_k
    op = MOE_OP_MACS
    if counts is None:  # against the cheapest a grouped path can be: padded with no padding
        return "dense" if experts * tokens * row_macs <= nk * row_macs + MOE_SORT_OPS * op else "grouped"
    hit = sum(1 for c in counts if c)
    padded = experts * max(counts) * row_macs + MOE_SORT_OPS * op
    loop = nk * row_macs + (MOE_SORT_OPS + MOE_LOOP_OPS * hit) * op
    return "padded" if padded <= loop else "per_expert"


class MoEWeights(NamedTuple):
    """The MoE's fused storage (MoE._weights): every projection of the layer is a view into w_in or w_down."""

    w_in: torch.Tensor  # [2*E*I + R + 2*Is, hidden]: expert 0's gate | up, expert 1's gate | up, ... | router (R = E
    #                      rows, or 0 if it runs alone) | shared gate | shared up
    w_down: torch.Tensor  # [hidden, E*I + Is]: routed downs | shared down (column blocks); or flat (blocked)
    router_rows: int  # R
    gate_up: torch.Tensor  # [E, 2I, hidden] view of w_in: each expert's gate rows then its up rows
    gate_ups: list[torch.Tensor]  # gate_up[e] for each expert, as views made once (no indexing op per step)
    down: torch.Tensor  # [E, hidden, I] view of w_down (contiguous if blocked)
    w_down_t: torch.Tensor  # w_down.t(), as addmm takes it
    routed_width: int  # E*I: the routed experts' columns of w_down
    tail: torch.Tensor  # w_in[2*E*I:]: router | shared gate | shared up, one matmul on the grouped paths
    shared_down: torch.Tensor  # w_down[:, E*I:]: the shared expert's down weight
    # int8 weights (pack_int8), else None: w_in's per-row scale [rows, 1]; w_down's per-row scale of each column
    # block of width gcd(I, Is) [hidden, (E*I + Is) / gcd] (each expert's and the shared down's own scales)
    in_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    down_block: int = 1  # the column block width of down_scale
    # float weights of a MoE whose dense path never runs: w_down is flat [E*hidden*I + hidden*Is], each down (and
    # `down`, `shared_down`) a contiguous block of it, so a decode GEMV streams it (a [hidden, I] column block of
    # [hidden, E*I + Is] read at ~7 GB/s against ~18 contiguous at one row, bench/decode_ops.py)
    blocked: bool = False


class MoE(nn.Module):
    """Routed experts + shared expert, on one of three paths (choose_moe_path):

    - dense: every expert and the shared expert run every token as two matmuls in all, one over the fused input
      weight (gates and ups | router | shared) and one over the fused down weight, the routing weights scaling
      each expert's activations in between (a zero for the experts a token did not pick): no sort, gather or
      scatter (few experts and few tokens: decode batches of small models, where grouping costs more ops than
      extra rows);
    - padded: tokens grouped per expert by one stable sort, one gather into per-expert rows padded to the
      busiest expert, one batched matmul over the stacked [gate | up] weights [E, 2I, hidden] and one over the
      downs, one scatter-add back;
    - per expert: the same grouping, then one gate|up matmul and one down matmul per hit expert on its contiguous
      slice (prefill, decode batches of larger models); one float32 token (batch-1 decode) skips the grouping
      (_routed_one: its experts in id order, the same sums, bitwise); --compile runs 2-16 as one native.moe_experts.
    On the grouped paths the router and the shared expert's gate and up are one matmul (w_in's tail), and the
    shared expert's down adds the routed sum inside its addmm.

    Storage (MoEWeights): w_in rows [expert 0 gate | up, ..., expert E-1 gate | up | router | shared gate | shared
    up] and w_down [routed downs | shared down] columns; every Linear weight of the layer (router, experts,
    shared expert) is a view into them, built once on first use (again only if the weights were moved), so no
    tensor is held twice and the state dict keeps transformers' names. A router whose dtype or device differs
    (float32 in a bf16 model) keeps its own weight and runs alone.
    """

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.gate = Router(cfg)
        inter = s.moe_intermediate_size
        self.experts = nn.ModuleList(MLP(s.hidden_size, inter, fuse=False) for _ in range(s.n_routed_experts))
        self.shared_experts = MLP(s.hidden_size, s.moe_intermediate_size * s.n_shared_experts, fuse=False)
        self._fused: MoEWeights | None = None
        self._ptrs: tuple[int, int, int] = (0, 0, 0)
        self._row_macs = 3 * s.hidden_size * s.moe_intermediate_size
        self._n_experts, self._top_k = s.n_routed_experts, s.num_experts_per_tok
        ex0, ex1 = cast(MLP, self.experts[0]), cast(MLP, self.experts[-1])
        # the Linears whose storage _weights watches (a tuple: not registered as submodules again)
        self._watch = (ex0.gate_proj, ex1.down_proj, self.shared_experts.down_proj)

    def _experts(self) -> list[MLP]:
        return [cast(MLP, m) for m in self.experts]  # nn.ModuleList yields Module

    def _members(self) -> tuple[int, int, int]:
        a, b, c = self._watch
        return (a.weight.data_ptr(), b.weight.data_ptr(), c.weight.data_ptr())

    def _weights(self) -> MoEWeights:
        """The fused storage, every member's weight re-pointed into it (built once, again if storage moved)."""
        f = self._fused
        if f is not None and self._members() == self._ptrs:
            return f
        ex, sh = self._experts(), cast(MLP, self.shared_experts)
        n_e, inter = len(ex), ex[0].gate_proj.weight.shape[0]
        hidden = ex[0].gate_proj.weight.shape[1]
        first = ex[0].gate_proj.weight
        router = self.gate.weight
        fuse_router = router.dtype == first.dtype and router.device == first.device
        ei = n_e * inter
        r = n_e if fuse_router else 0
        i_s = sh.gate_proj.weight.shape[0]
        in_scale = down_scale = None
        blk = math.gcd(inter, i_s)
        with torch.inference_mode(False), torch.no_grad():
            rows = [w for m in ex for w in (m.gate_proj.weight, m.up_proj.weight)]
            rows += ([router] if fuse_router else []) + [sh.gate_proj.weight, sh.up_proj.weight]
            w_in = torch.cat(rows)
            int8 = weight_scale(ex[0].gate_proj) is not None
            # the dense path never runs (not even for one token) and float weights: each down a contiguous block
            blocked = not int8 and choose_moe_path(1, self._top_k, n_e, self._row_macs) != "dense"
            downs_w = [m.down_proj.weight for m in ex] + [sh.down_proj.weight]
            if blocked:
                w_down = torch.cat([w.reshape(-1) for w in downs_w])  # [E*hidden*I + hidden*Is]
                d_views = [w_down[i * hidden * inter :][: hidden * inter].view(hidden, inter) for i in range(n_e)]
                d_views.append(w_down[ei * hidden :].view(hidden, i_s))
            else:
                w_down = torch.cat(downs_w, dim=1)
                d_views = [w_down[:, i * inter : (i + 1) * inter] for i in range(n_e)] + [w_down[:, ei:]]
            if int8:  # (pack_int8): the scales fused alike
                ins = [weight_scale(p) for m in [*ex, sh] for p in (m.gate_proj, m.up_proj)]
                in_scale = torch.cat(cast(list[torch.Tensor], ins))
                downs = [(weight_scale(m.down_proj), inter) for m in ex] + [(weight_scale(sh.down_proj), i_s)]
                down_scale = torch.cat([cast(torch.Tensor, d).repeat(1, n // blk) for d, n in downs], dim=1)
            for i, m in enumerate(ex):
                m.gate_proj.weight.data = w_in[2 * i * inter : (2 * i + 1) * inter]
                m.up_proj.weight.data = w_in[(2 * i + 1) * inter : (2 * i + 2) * inter]
                m.down_proj.weight.data = d_views[i]
            if fuse_router:
                router.data = w_in[2 * ei : 2 * ei + r]
            s0 = 2 * ei + r
            sh.gate_proj.weight.data = w_in[s0 : s0 + i_s]
            sh.up_proj.weight.data = w_in[s0 + i_s : s0 + 2 * i_s]
            sh.down_proj.weight.data = d_views[-1]
        gate_up = w_in[: 2 * ei].view(n_e, 2 * inter, hidden)
        if blocked:
            down = w_down[: ei * hidden].view(n_e, hidden, inter)
        else:
            down = w_down[:, :ei].view(hidden, n_e, inter).permute(1, 0, 2)
        self._fused = MoEWeights(
            w_in,
            w_down,
            r,
            gate_up,
            list(gate_up.unbind(0)),
            down,
            w_down.t(),
            ei,
            w_in[2 * ei :],
            d_views[-1],
            in_scale,
            down_scale,
            blk,
            blocked,
        )
        self._ptrs = self._members()
        return self._fused

    def one_token_weights(self) -> MoEWeights | None:
        """The fused weights when one token takes moe_fused.moe_one's path (not the dense path), else None."""
        f = self._weights()
        if not f.blocked and choose_moe_path(1, self._top_k, self._n_experts, self._row_macs) == "dense":
            return None
        return f

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [N, hidden] (plus `residual` when given); expert outputs are added in expert-id order per token on
        the grouped paths (the stable sort keeps it), as transformers' per-expert index_add_ does, then the shared
        expert's; the dense path sums them (and the shared expert) inside its down matmul."""
        f = self._weights()
        n, e = x.shape[0], self._n_experts
        gate = self.gate
        ei, r = f.routed_width, f.router_rows
        if not f.blocked and choose_moe_path(n, self._top_k, e, self._row_macs) == "dense":
            h = qlinear(x, f.w_in, f.in_scale)
            logits = h[:, 2 * ei : 2 * ei + r] if r else F.linear(x.to(gate.weight.dtype), gate.weight)
            weights, ids = gate.route(logits if logits.dtype == torch.float32 else logits.float())
            gu = h[:, : 2 * ei].view(n, e, 2, -1)
            hs = h[:, 2 * ei + r :]
            i_s = hs.shape[1] // 2
            act = h.new_empty(n, ei + i_s)  # [N, E*I + Is]: every expert's activations, shared last
            routed = act[:, :ei].view(n, e, -1)
            torch.mul(F.silu(gu[:, :, 0]), gu[:, :, 1], out=routed)
            torch.mul(F.silu(hs[:, :i_s]), hs[:, i_s:], out=act[:, ei:])
            dense = weights.new_zeros(n, e).scatter_(1, ids, weights)  # weight per token and expert (0: not picked)
            routed.mul_(dense.unsqueeze(-1))
            if f.down_scale is not None:
                return matmul_add(act, f.w_down, f.down_scale, None, residual)
            return torch.addmm(residual, act, f.w_down_t) if residual is not None else F.linear(act, f.w_down)
        fused = moe_one(x, residual, f, gate) if n == 1 else None  # --compile: one call for one token
        if fused is not None:
            return fused
        tail_scale = None if f.in_scale is None else f.in_scale[2 * ei :]
        tail = qlinear(x, f.tail, tail_scale)  # router (if fused) | shared gate | shared up, views of one matmul
        i_s = (tail.shape[1] - r) // 2
        if r:
            logits, g, u = tail.split_with_sizes((r, i_s, i_s), dim=1)
        else:
            logits = F.linear(x.to(gate.weight.dtype), gate.weight)
            g, u = tail.split_with_sizes((i_s, i_s), dim=1)
        weights, ids = gate.route(logits if logits.dtype == torch.float32 else logits.float())
        shared = F.silu(g).mul_(u)
        if f.down_scale is None:
            out = matmul_add(shared, f.shared_down, None, None, self._routed(x, weights, ids, f))  # + shared expert
        else:
            sd = f.down_scale[:, ei // f.down_block :]
            out = matmul_add(shared, f.shared_down, sd, None, self._routed(x, weights, ids, f))
        return out if residual is None else out.add_(residual)

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, f: MoEWeights) -> torch.Tensor:
        n, k = ids.shape
        num_experts = len(self.experts)
        if n == 1 and x.dtype == weights.dtype == torch.float32:
            if choose_moe_path(1, k, num_experts, self._row_macs, counts=[1] * k) == "per_expert":
                return self._routed_one(x, weights, ids, f)
        elif f.in_scale is None and compiled_gemv_on():  # --compile, 2-16 tokens: the loop as one C call (its order)
            if (y := moe_experts(x, ids, weights, f.gate_up, f.down)) is not None:
                return y
        return self._routed_grouped(x, weights, ids, f)

    def _routed_one(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, f: MoEWeights) -> torch.Tensor:
        """One float32 token (batch-1 decode) on the per-expert path without its sort, gather and scatter: its
        experts in expert-id order, each output times its routing weight (a float32 multiply, as the grouped
        path's), summed in that order (the grouped path's index_add_ into zeros: the same float32 sums)."""
        two_i, i_b = f.gate_ups[0].shape[0], f.gate_ups[0].shape[0] // 2 // f.down_block
        acc = None
        for e, w in sorted(zip(ids[0].tolist(), weights[0].tolist(), strict=True)):
            gs = None if f.in_scale is None else f.in_scale[e * two_i : (e + 1) * two_i]
            g, u = qlinear(x, f.gate_ups[e], gs).chunk(2, dim=-1)  # gate | up, one matmul
            ds = None if f.down_scale is None else f.down_scale[:, e * i_b : (e + 1) * i_b]
            y = qlinear(F.silu(g).mul_(u), cast(MLP, self.experts[e]).down_proj.weight, ds).mul_(w)
            acc = y if acc is None else acc.add_(y)
        assert acc is not None
        return acc

    def _routed_grouped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, f: MoEWeights) -> torch.Tensor:
        """Tokens grouped per expert (one stable sort), then the padded or per-expert path (choose_moe_path)."""
        n, k = ids.shape
        num_experts = len(self.experts)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        ws = weights.reshape(-1)[order, None]
        counts_t = torch.bincount(flat, minlength=num_experts)
        counts = counts_t.tolist()
        if choose_moe_path(n, k, num_experts, self._row_macs, counts=counts) == "padded":
            se = flat[order]
            pos = torch.arange(n * k, device=x.device) - (torch.cumsum(counts_t, 0) - counts_t)[se]
            xp = x.new_zeros(num_experts, max(counts), x.shape[1])
            xp[se, pos] = x[tok]  # one gather (x[tok]) into the padded per-expert rows
            gate_up, down = f.gate_up, f.down
            if f.in_scale is not None and f.down_scale is not None:  # int8: dequantised for the batched matmuls
                ei, blk = f.routed_width, f.down_block
                gate_up = dequantize(f.w_in[: 2 * ei], f.in_scale[: 2 * ei], x.dtype).view(f.gate_up.shape)
                down = dequantize(f.w_down[:, :ei], f.down_scale[:, : ei // blk], x.dtype)
                down = down.view(x.shape[1], num_experts, -1).permute(1, 0, 2)
            g, u = torch.bmm(xp, gate_up.transpose(1, 2)).chunk(2, dim=-1)  # [E, cap, 2I]: gate | up
            yp = torch.bmm(F.silu(g).mul_(u), down.transpose(1, 2))
            y = yp[se, pos] * ws
        else:
            xs = x[tok]  # one gather: [N * k, hidden], grouped by expert
            ys, start = [], 0
            two_i, i_b = f.gate_ups[0].shape[0], f.gate_ups[0].shape[0] // 2 // f.down_block
            for e, (expert, gate_up, c) in enumerate(zip(self._experts(), f.gate_ups, counts, strict=True)):
                if c:
                    gs = None if f.in_scale is None else f.in_scale[e * two_i : (e + 1) * two_i]
                    g, u = qlinear(xs[start : start + c], gate_up, gs).chunk(2, dim=-1)  # gate | up, one matmul
                    ds = None if f.down_scale is None else f.down_scale[:, e * i_b : (e + 1) * i_b]
                    ys.append(qlinear(F.silu(g).mul_(u), expert.down_proj.weight, ds))
                    start += c
            y = (torch.cat(ys) if len(ys) > 1 else ys[0]) * ws
        return torch.zeros_like(x).index_add_(0, tok, y if y.dtype == x.dtype else y.to(x.dtype))  # one scatter
