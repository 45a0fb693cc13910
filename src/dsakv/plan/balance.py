"""--balance: the PP partition that maximises the binding stage's elided capacity.

Producers are uneven across stages (GLM-5.2's first stage holds layers 0, 1 and 2,
all producers), so the even split leaves the first stage binding. A dynamic
programme over contiguous partitions finds the max-min split exactly.
No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dsakv.errors import CapacityError
from dsakv.plan.capacity import Deployment, RolePlan, plan
from dsakv.plan.weights import embedding_bytes, layer_weight_bytes, lm_head_bytes, weight_format_for


@dataclass(frozen=True)
class BalanceResult:
    baseline: RolePlan
    balanced: RolePlan

    @property
    def gain_over_baseline(self) -> float:
        return self.balanced.tokens_elided / self.baseline.tokens_elided - 1.0


def balance(d: Deployment) -> BalanceResult:
    spec, pp, page = d.spec, d.pp, d.page_size
    n = spec.num_layers
    probe = d.layout(0, elide=True)
    kv, idx = probe.kv_bytes, probe.index_bytes
    own = [1 if spec.has_indexer and spec.indexer_types[i] == "full" else 0 for i in range(n)]
    pre_own = [0]
    for o in own:
        pre_own.append(pre_own[-1] + o)
    draft_bpt = d.draft_layers * (kv + idx)
    pre_w = [0]
    draft_w = 0
    wf = weight_format_for(spec, d.weight_format)
    if d.kv_budget is None:
        for i in range(n):
            pre_w.append(pre_w[-1] + layer_weight_bytes(spec, i, wf, d.grid))
        draft_w = sum(layer_weight_bytes(spec, n + j, wf, d.grid) for j in range(d.draft_layers))

    def tokens(a: int, b: int, first: bool, last: bool) -> int:
        bpt = (b - a) * kv + idx * (pre_own[b] - pre_own[a]) + draft_bpt
        if d.kv_budget is not None:
            budget = d.kv_budget
        else:
            assert d.gpu_memory is not None
            w = pre_w[b] - pre_w[a] + draft_w
            if first or d.draft_layers:
                w += embedding_bytes(spec, d.grid)
            if last or d.draft_layers:
                w += lm_head_bytes(spec, d.grid)
            budget = int(d.gpu_memory * d.mem_fraction) - w
        return max(budget, 0) // bpt // page * page

    neg = -1
    best = [[neg] * (n + 1) for _ in range(pp + 1)]
    cut = [[0] * (n + 1) for _ in range(pp + 1)]
    best[0][0] = 1 << 62
    for s in range(1, pp + 1):
        for b in range(s, n - (pp - s) + 1):
            for a in range(s - 1, b):
                if best[s - 1][a] == neg:
                    continue
                t = min(best[s - 1][a], tokens(a, b, s == 1, s == pp))
                if t > best[s][b]:
                    best[s][b], cut[s][b] = t, a
    if best[pp][n] <= 0:
        raise CapacityError("no PP partition gives every stage at least one page: raise the budget")
    sizes, b = [], n
    for s in range(pp, 0, -1):
        a = cut[s][b]
        sizes.append(b - a)
        b = a
    partition = tuple(reversed(sizes))
    return BalanceResult(baseline=plan(d), balanced=plan(replace(d, partition=partition)))
