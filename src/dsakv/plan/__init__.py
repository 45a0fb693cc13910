"""Capacity planning. No torch."""

import sys
import types
from typing import Any

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


class _CallablePackage(types.ModuleType):
    """This package is also the public API's `dsakv.plan(model, **options)` (dsakv/api/plan.py: `dsakv plan
    --json` as data), so the name means one thing whichever was imported first; its modules stay attributes."""

    def __call__(self, model: str, **options: Any) -> dict[str, Any]:
        from dsakv.api.plan import plan as api_plan  # the one upward import: tests/unit/test_layering.py FACADE

        return api_plan(model, **options)


sys.modules[__name__].__class__ = _CallablePackage
