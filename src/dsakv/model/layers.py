"""Per-token building blocks of a DSA decoder layer: RMSNorm, dense MLP, MoE (sigmoid noaux_tc router).

Parameter names follow transformers' GlmMoeDsa / DeepseekV32 modules so a checkpoint's
state dict loads by name. Experts are a ModuleList of MLPs (`experts.{e}.gate_proj`, ...),
the layout real checkpoints and transformers' save_pretrained use.
Imports torch and dsakv.model.config only.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from dsakv.model.config import DSAConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """weight * (x / rms(x)), the normalisation in float32 (as transformers), one fused op for float32."""
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        h = F.rms_norm(x.to(torch.float32), (x.shape[-1],), None, self.eps)
        return self.weight * h.to(x.dtype)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


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
        logits = F.linear(x.to(torch.float32), self.weight.to(torch.float32))
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if self.topk_group >= self.n_group:  # every group kept (GLM: one group): no group limit to apply
            ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
            return self._weights(scores, ids), ids
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        return self._weights(scores, ids), ids

    def _weights(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor


class MoE(nn.Module):
    """Routed experts + shared expert. Tokens are grouped per expert by one stable sort, one gather and one
    scatter-add; the grouped rows then run either

    - padded: all experts in two batched matmuls over their stacked weights [E, rows, hidden] (rows padded to
      the busiest expert), when at least half the experts are hit and padding at most doubles the rows
      (decode batches: few ops whatever the expert count), or
    - per expert: one gate/up/down per hit expert on its contiguous slice (prefill, or few experts hit).

    The stacked weights are the experts' storage: each expert's Linear weights are views into them (built on
    first use and again if the weights were moved), so no tensor is held twice.
    """

    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(s.hidden_size, s.moe_intermediate_size) for _ in range(s.n_routed_experts))
        self.shared_experts = MLP(s.hidden_size, s.moe_intermediate_size * s.n_shared_experts)
        self._stack: tuple[torch.Tensor, torch.Tensor] | None = None

    def _experts(self) -> list[MLP]:
        return [cast(MLP, m) for m in self.experts]  # nn.ModuleList yields Module

    def _stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate|up [E, 2I, hidden], down [E, hidden, I]) aliased by every expert's Linear weights."""
        ex = self._experts()
        st = self._stack
        if st is not None and all(
            m.gate_proj.weight.data_ptr() == st[0][e].data_ptr()
            and m.down_proj.weight.data_ptr() == st[1][e].data_ptr()
            for e, m in enumerate(ex)
        ):
            return st
        inter = ex[0].gate_proj.weight.shape[0]
        with torch.inference_mode(False), torch.no_grad():
            gu = torch.stack([torch.cat((m.gate_proj.weight, m.up_proj.weight)) for m in ex])
            down = torch.stack([m.down_proj.weight for m in ex])
            for e, m in enumerate(ex):
                m.gate_proj.weight.data = gu[e, :inter]
                m.up_proj.weight.data = gu[e, inter:]
                m.down_proj.weight.data = down[e]
        self._stack = (gu, down)
        return self._stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]; expert outputs are added in expert-id order per token (the stable sort keeps it), as
        transformers' per-expert index_add_ does."""
        weights, ids = self.gate(x)
        n, k = ids.shape
        num_experts = len(self.experts)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        ws = weights.reshape(-1)[order, None]
        counts_t = torch.bincount(flat, minlength=num_experts)
        counts = counts_t.tolist()
        cap = max(counts)
        hit = sum(1 for c in counts if c)
        if 2 * hit >= num_experts and cap * num_experts <= 2 * n * k:
            gu, down = self._stacked()
            inter = down.shape[2]
            se = flat[order]
            pos = torch.arange(n * k, device=x.device) - (torch.cumsum(counts_t, 0) - counts_t)[se]
            xp = x.new_zeros(num_experts, cap, x.shape[1])
            xp[se, pos] = x[tok]  # one gather (x[tok]) into the padded per-expert rows
            hgu = torch.bmm(xp, gu.transpose(1, 2))
            yp = torch.bmm(F.silu(hgu[..., :inter]) * hgu[..., inter:], down.transpose(1, 2))
            y = yp[se, pos] * ws
        else:
            xs = x[tok]  # one gather: [N * k, hidden], grouped by expert
            ys, start = [], 0
            for expert, c in zip(self._experts(), counts, strict=True):
                if c:
                    xe = xs[start : start + c]
                    g, u, d = expert.gate_proj.weight, expert.up_proj.weight, expert.down_proj.weight
                    ys.append(F.linear(F.silu(F.linear(xe, g)) * F.linear(xe, u), d))
                    start += c
            y = (torch.cat(ys) if len(ys) > 1 else ys[0]) * ws
        out = torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))  # one scatter
        return out + self.shared_experts(x)
