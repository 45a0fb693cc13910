"""Per-token building blocks of a DSA decoder layer: RMSNorm, dense MLP, MoE (sigmoid noaux_tc router).

Parameter names follow transformers' GlmMoeDsa / DeepseekV32 modules so a checkpoint's
state dict loads by name. Experts are a ModuleList of MLPs (`experts.{e}.gate_proj`, ...),
the layout real checkpoints and transformers' save_pretrained use.
Imports torch and dsakv.model.config only.
"""

from __future__ import annotations

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
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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
        per_group = self.num_experts // self.n_group
        group_scores = choice.view(-1, self.n_group, per_group).topk(min(2, per_group), dim=-1)[0].sum(dim=-1)
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, self.n_group, per_group).reshape(-1, self.num_experts)
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class MoE(nn.Module):
    def __init__(self, cfg: DSAConfig) -> None:
        super().__init__()
        s = cfg.spec
        self.gate = Router(cfg)
        self.experts = nn.ModuleList(MLP(s.hidden_size, s.moe_intermediate_size) for _ in range(s.n_routed_experts))
        self.shared_experts = MLP(s.hidden_size, s.moe_intermediate_size * s.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, hidden]; tokens grouped per expert by one stable sort, one gather and one scatter-add.

        Expert outputs are added in expert-id order per token (the stable sort keeps it), as transformers'
        per-expert index_add_ does; only the experts some token chose run.
        """
        weights, ids = self.gate(x)
        n, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tok = torch.div(order, k, rounding_mode="floor")
        xs = x[tok]  # one gather: [N * k, hidden], grouped by expert
        ws = weights.reshape(-1)[order, None]
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        ys, start = [], 0
        for e, c in enumerate(counts):
            if c:
                ys.append(self.experts[e](xs[start : start + c]))
                start += c
        y = (torch.cat(ys) if len(ys) > 1 else ys[0]) * ws
        out = torch.zeros_like(x).index_add_(0, tok, y.to(x.dtype))  # one scatter
        return out + self.shared_experts(x)
