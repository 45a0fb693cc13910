"""Capacity planning. No torch."""

from dsakv.plan.balance import BalanceResult, balance
from dsakv.plan.capacity import (
    ROLES,
    Deployment,
    RolePlan,
    StagePlan,
    check_partition,
    even_partition,
    max_total_num_tokens,
    parse_partition,
    plan,
)
from dsakv.plan.hisparse import HiSparseFigures, hisparse_figures
from dsakv.plan.units import fmt_bytes, parse_size

__all__ = [
    "ROLES",
    "BalanceResult",
    "Deployment",
    "HiSparseFigures",
    "RolePlan",
    "StagePlan",
    "balance",
    "check_partition",
    "even_partition",
    "fmt_bytes",
    "hisparse_figures",
    "max_total_num_tokens",
    "parse_partition",
    "parse_size",
    "plan",
]
