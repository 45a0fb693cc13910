"""Capacity planning: KV budget -> max_total_num_tokens per role and PP stage.

    max_total_num_tokens = floor(budget / bytes_per_token / page_size) * page_size

Each PP stage is sized on its own layers; a worker holds the minimum over its
stages (the binding stage). The budget is given directly or estimated as
gpu_memory x mem_fraction - stage weights. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dsakv.errors import CapacityError, ConfigError
from dsakv.plan.hisparse import HISPARSE_ROLES, HiSparseFigures, check_buffer_size, check_ratio, hisparse_figures
from dsakv.plan.ranks import RankGrid
from dsakv.plan.weights import reform_headroom_bytes, stage_weight_bytes, weight_format_for
from dsakv.spec.layout import DEFAULT_PAGE_SIZE, KVLayout
from dsakv.spec.model import ModelSpec
from dsakv.util import ceil_div

ROLES = ("colocated", "prefill", "decode")
DRAFT_PLACEMENTS = ("every", "last")


def max_total_num_tokens(budget_bytes: int, layout: KVLayout) -> int:
    """Tokens a pool of `budget_bytes` holds for `layout`, floored to whole pages."""
    bpt = layout.bytes_per_token
    pages = budget_bytes // bpt // layout.page_size
    if pages < 1:
        raise CapacityError(
            f"a KV budget of {budget_bytes} bytes holds no page of layers {layout.describe_range()}: one page "
            f"needs {bpt * layout.page_size} bytes ({bpt} B/token x page size {layout.page_size}); "
            "raise the budget or lower --page-size"
        )
    return int(pages * layout.page_size)


def pages_for_tokens(tokens: int, page_size: int) -> int:
    return ceil_div(tokens, page_size)


def even_partition(num_layers: int, pp: int) -> tuple[int, ...]:
    """Split layers over pp stages as evenly as possible, the extra layers on the first stages."""
    if pp < 1 or pp > num_layers:
        raise ConfigError(f"--pp {pp} must be between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def check_partition(partition: tuple[int, ...], num_layers: int, pp: int | None = None) -> tuple[int, ...]:
    if not partition:
        raise ConfigError("PP partition is empty: give one layer count per stage, e.g. 20,20,20,18")
    if pp is not None and len(partition) != pp:
        raise ConfigError(f"PP partition {','.join(map(str, partition))} has {len(partition)} stages but --pp is {pp}")
    for i, n in enumerate(partition):
        if n < 1:
            raise ConfigError(
                f"PP partition {','.join(map(str, partition))}: stage {i} has {n} layers; every stage needs >= 1"
            )
    if sum(partition) != num_layers:
        raise ConfigError(
            f"PP partition {','.join(map(str, partition))} sums to {sum(partition)} but the model has "
            f"{num_layers} layers: make the stage sizes add up to {num_layers}"
        )
    return partition


def parse_partition(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip() != "")
    except ValueError:
        raise ConfigError(f"PP partition {text!r} must be comma-separated layer counts, e.g. 20,20,20,18") from None


@dataclass(frozen=True)
class Deployment:
    """One role's deployment: which layers each stage holds, formats and memory."""

    spec: ModelSpec
    role: str = "decode"
    pp: int = 1
    partition: tuple[int, ...] | None = None
    draft_layers: int = 0
    kv_format: str = "fp8-656"
    index_format: str = "fp8-132"
    page_size: int = DEFAULT_PAGE_SIZE
    kv_budget: int | None = None
    gpu_memory: int | None = None
    mem_fraction: float = 0.85
    weight_format: str | None = None
    tp: int = 1
    # the rank grid (plan/ranks.py): DP groups (with DP attention) or replicas, expert-parallel split of the MoE
    dp: int = 1
    enable_dp_attention: bool = False
    ep: int = 1
    hicache_ratio: float | None = None
    hicache_size: int | None = None
    # L3 (cache/storage: Mooncake Store or page files): bytes of storage this stage's pages may fill
    hicache_storage_size: int | None = None
    hisparse_ratio: float | None = None
    hisparse_buffer: int | None = None
    # "every": each PP stage holds the draft layers (the seeds' accounting); "last": only the last stage, where
    # dsakv's engine runs them (the draft needs the target's final hidden states)
    draft_placement: str = "every"

    def __post_init__(self) -> None:
        if self.draft_placement not in DRAFT_PLACEMENTS:
            raise ConfigError(
                f"draft placement {self.draft_placement!r} is unknown: use one of {', '.join(DRAFT_PLACEMENTS)}"
            )
        if self.role not in ROLES:
            raise ConfigError(f"role {self.role!r} is unknown: use one of {', '.join(ROLES)}")
        if self.partition is None:
            object.__setattr__(self, "partition", even_partition(self.spec.num_layers, self.pp))
        else:
            check_partition(self.partition, self.spec.num_layers, None)
            object.__setattr__(self, "pp", len(self.partition))
        if self.kv_budget is None and self.gpu_memory is None:
            raise ConfigError("no memory given: pass --kv-budget (e.g. 96.33GiB) or --gpu-memory (e.g. 141GB)")
        if not 0.0 < self.mem_fraction <= 1.0:
            raise ConfigError(f"--mem-fraction {self.mem_fraction} must be in (0, 1]")
        self.grid.check_model(self.spec)
        if self.hicache_ratio is not None and self.hicache_size is not None:
            raise ConfigError("give --hicache-ratio or --hicache-size, not both")
        if self.hicache_ratio is not None and self.hicache_ratio <= 0:
            raise ConfigError(f"--hicache-ratio {self.hicache_ratio} must be > 0 (host pool = ratio x device pool)")
        if self.hisparse_ratio is not None:
            check_ratio(self.hisparse_ratio)
            check_buffer_size(self.hisparse_buffer)
        elif self.hisparse_buffer is not None:
            raise ConfigError("--hisparse-buffer needs --hisparse-ratio (the logical pool / hot rows ratio, e.g. 10)")

    @property
    def grid(self) -> RankGrid:
        """The ranks of one instance of this role (validated on construction)."""
        return RankGrid(tp=self.tp, dp=self.dp, dp_attention=self.enable_dp_attention, ep=self.ep, pp=self.pp)

    @property
    def hisparse(self) -> bool:
        """HiSparse sizing applies: a ratio was given and this role decodes (a prefill keeps its KV on device)."""
        return self.hisparse_ratio is not None and self.role in HISPARSE_ROLES

    @property
    def stage_ranges(self) -> list[tuple[int, int]]:
        assert self.partition is not None
        out, start = [], 0
        for n in self.partition:
            out.append((start, start + n))
            start += n
        return out

    def stage_draft_layers(self, stage: int) -> int:
        """Draft layers stage `stage` holds under this deployment's draft placement."""
        if self.draft_placement == "last" and stage != self.pp - 1:
            return 0
        return self.draft_layers

    def layout(self, stage: int, elide: bool) -> KVLayout:
        start, end = self.stage_ranges[stage]
        return KVLayout(
            self.spec,
            start,
            end,
            draft_layers=self.stage_draft_layers(stage),
            elide=elide,
            kv_format=self.kv_format,
            index_format=self.index_format,
            page_size=self.page_size,
        )

    def rank_weight_bytes(self, stage: int) -> int:
        """Estimated weight bytes on one rank of stage `stage` under this deployment's rank grid."""
        start, end = self.stage_ranges[stage]
        return stage_weight_bytes(
            self.spec,
            start,
            end,
            self.stage_draft_layers(stage),
            weight_format_for(self.spec, self.weight_format),
            first=stage == 0,
            last=stage == self.pp - 1,
            grid=self.grid,
        )

    def rank_reform_headroom(self, stage: int) -> int:
        """Bytes a surviving rank of stage `stage` loads after one EP rank died (plan/weights.reform_headroom_bytes)."""
        start, end = self.stage_ranges[stage]
        return reform_headroom_bytes(self.spec, start, end, weight_format_for(self.spec, self.weight_format), self.grid)

    def stage_budget(self, stage: int) -> tuple[int, int | None]:
        """(KV budget bytes, estimated weight bytes or None when the budget was given)."""
        if self.kv_budget is not None:
            return self.kv_budget, None
        assert self.gpu_memory is not None
        start, end = self.stage_ranges[stage]
        weights = self.rank_weight_bytes(stage)
        # an elastic EP survivor loads a dead rank's experts: that room stays free of KV
        budget = int(self.gpu_memory * self.mem_fraction) - weights - self.rank_reform_headroom(stage)
        if budget <= 0:
            raise CapacityError(
                f"stage {stage} (layers {start}-{end - 1}): estimated weights {weights / 2**30:.1f} GiB per GPU "
                f"exceed GPU memory x mem_fraction = {self.gpu_memory * self.mem_fraction / 2**30:.1f} GiB: "
                "use more PP stages, a larger --tp (or fewer DP attention groups), a quantised --weight-format, "
                "or --kv-budget"
            )
        return budget, weights


@dataclass(frozen=True)
class StagePlan:
    stage: int
    layer_start: int
    layer_end: int
    draft_layers: int
    producers: tuple[int, ...]
    budget_bytes: int
    weight_bytes: int | None
    bytes_per_token_dense: int
    bytes_per_token_elided: int
    tokens_dense: int
    tokens_elided: int
    host_tokens_dense: int | None = None
    host_tokens_elided: int | None = None
    host_bytes: int | None = None
    storage_bytes: int | None = None
    storage_tokens_dense: int | None = None
    storage_tokens_elided: int | None = None
    hisparse_dense: HiSparseFigures | None = None
    hisparse_elided: HiSparseFigures | None = None

    @property
    def gain(self) -> float:
        return self.tokens_elided / self.tokens_dense - 1.0

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "layers": [self.layer_start, self.layer_end - 1],
            "num_layers": self.num_layers,
            "draft_layers": self.draft_layers,
            "producers": list(self.producers),
            "num_producers": len(self.producers),
            "budget_bytes": self.budget_bytes,
            "weight_bytes_estimate": self.weight_bytes,
            "bytes_per_token_dense": self.bytes_per_token_dense,
            "bytes_per_token_elided": self.bytes_per_token_elided,
            "tokens_dense": self.tokens_dense,
            "tokens_elided": self.tokens_elided,
            "gain": round(self.gain, 6),
            "host_bytes": self.host_bytes,
            "host_tokens_dense": self.host_tokens_dense,
            "host_tokens_elided": self.host_tokens_elided,
            "storage_bytes": self.storage_bytes,
            "storage_tokens_dense": self.storage_tokens_dense,
            "storage_tokens_elided": self.storage_tokens_elided,
            **self._hisparse_dict(),
        }

    def _hisparse_dict(self) -> dict[str, Any]:
        if self.hisparse_dense is None or self.hisparse_elided is None:
            return {}
        return {"hisparse": {"dense": self.hisparse_dense.to_dict(), "elided": self.hisparse_elided.to_dict()}}


@dataclass(frozen=True)
class RolePlan:
    deployment: Deployment
    stages: tuple[StagePlan, ...] = field(default=())

    @property
    def binding_dense(self) -> int:
        return min(range(len(self.stages)), key=lambda i: (self.stages[i].tokens_dense, i))

    @property
    def binding_elided(self) -> int:
        return min(range(len(self.stages)), key=lambda i: (self.stages[i].tokens_elided, i))

    @property
    def tokens_dense(self) -> int:
        return self.stages[self.binding_dense].tokens_dense

    @property
    def tokens_elided(self) -> int:
        return self.stages[self.binding_elided].tokens_elided

    @property
    def gain(self) -> float:
        return self.tokens_elided / self.tokens_dense - 1.0

    @property
    def instance_tokens_dense(self) -> int:
        """Tokens one instance holds (every pool of the grid at the binding stage's per-rank figure), dense."""
        return self.tokens_dense * self.deployment.grid.pools

    @property
    def instance_tokens_elided(self) -> int:
        return self.tokens_elided * self.deployment.grid.pools

    def ranks_dict(self) -> dict[str, Any]:
        """Per-rank and per-instance figures of the rank grid (tokens per rank == the single-GPU figures)."""
        g = self.deployment.grid
        return {
            **g.to_dict(),
            "tokens_per_rank_dense": self.tokens_dense,
            "tokens_per_rank_elided": self.tokens_elided,
            "tokens_per_instance_dense": self.instance_tokens_dense,
            "tokens_per_instance_elided": self.instance_tokens_elided,
            "kv_bytes_per_rank": [s.budget_bytes for s in self.stages],
            "weight_bytes_per_rank_estimate": [self.deployment.rank_weight_bytes(s.stage) for s in self.stages],
            "reform_headroom_bytes_per_rank": [self.deployment.rank_reform_headroom(s.stage) for s in self.stages],
        }

    def hisparse_binding(self, elide: bool) -> int | None:
        """The stage with the fewest logical HiSparse tokens (None without HiSparse sizing)."""
        figs = [s.hisparse_elided if elide else s.hisparse_dense for s in self.stages]
        if any(f is None for f in figs):
            return None
        return min(range(len(figs)), key=lambda i: (figs[i].logical_tokens, i))  # type: ignore[union-attr]

    def hisparse_figures(self, elide: bool) -> HiSparseFigures | None:
        """The binding stage's HiSparse figures: what the worker holds."""
        i = self.hisparse_binding(elide)
        if i is None:
            return None
        return self.stages[i].hisparse_elided if elide else self.stages[i].hisparse_dense

    def to_dict(self) -> dict[str, Any]:
        d = self.deployment
        return {
            "model": d.spec.name,
            "model_type": d.spec.model_type,
            "role": d.role,
            "pp": d.pp,
            "partition": list(d.partition or ()),
            "draft_layers": d.draft_layers,
            "draft_placement": d.draft_placement,
            "kv_format": d.kv_format,
            "index_format": d.index_format,
            "page_size": d.page_size,
            "budget_source": "kv_budget" if d.kv_budget is not None else "gpu_memory_estimate",
            "producers": list(d.spec.producers),
            "num_producers": len(d.spec.producers),
            "num_shared": len(d.spec.shared_layers),
            "stages": [s.to_dict() for s in self.stages],
            "binding_stage_dense": self.binding_dense,
            "binding_stage_elided": self.binding_elided,
            "max_total_num_tokens_dense": self.tokens_dense,
            "max_total_num_tokens_elided": self.tokens_elided,
            "gain": round(self.gain, 6),
            "ranks": self.ranks_dict(),
            **self._hisparse_dict(),
        }

    def _hisparse_dict(self) -> dict[str, Any]:
        d = self.deployment
        if d.hisparse_ratio is None:
            return {}
        hd, he = self.hisparse_figures(False), self.hisparse_figures(True)
        if hd is None or he is None:
            return {"hisparse": {"ratio": d.hisparse_ratio, "applies": False, "reason": HISPARSE_PREFILL_NOTE}}
        return {
            "hisparse": {
                "ratio": d.hisparse_ratio,
                "applies": True,
                "buffer_size": d.hisparse_buffer,
                "binding_stage_dense": self.hisparse_binding(False),
                "binding_stage_elided": self.hisparse_binding(True),
                "dense": hd.to_dict(),
                "elided": he.to_dict(),
                "gain": round(he.logical_tokens / hd.logical_tokens - 1.0, 6),
            }
        }


HISPARSE_PREFILL_NOTE = (
    "a prefill keeps its KV on the device (the plain figures); under HiSparse PD it writes MLA KV into the "
    "decode's host pool and index-K into the decode's device pool: plan the decode with --role decode"
)


def host_tokens(d: Deployment, layout: KVLayout, device_tokens: int) -> tuple[int | None, int | None]:
    """(host bytes, host tokens) for the host tier sized from the same layout."""
    if d.hicache_ratio is None and d.hicache_size is None:
        return None, None
    if d.hicache_size is not None:
        host_bytes = d.hicache_size
    else:
        assert d.hicache_ratio is not None
        host_bytes = int(device_tokens * layout.bytes_per_token * d.hicache_ratio)
    pages = host_bytes // layout.bytes_per_page
    if pages < 1:
        raise CapacityError(
            f"host tier of {host_bytes} bytes holds no page ({layout.bytes_per_page} bytes per page for layers "
            f"{layout.describe_range()}): raise --hicache-size / --hicache-ratio"
        )
    return host_bytes, int(pages * layout.page_size)


# Every stored page (either storage backend) is its payload (exactly layout.bytes_per_page: the layout's keys,
# INDEX_K only for producers) plus one record of this many bytes (cache/storage/base.py META: magic, layout id,
# page hash, payload size, word sum, MAC nonce + tag); tests/unit/plan/test_plan_storage.py checks the two agree.
STORAGE_RECORD_BYTES = 144


def storage_tokens(d: Deployment, layout: KVLayout) -> int | None:
    """Tokens the L3 tier holds for this layout: whole pages of payload + record in `hicache_storage_size`."""
    if d.hicache_storage_size is None:
        return None
    per_page = layout.bytes_per_page + STORAGE_RECORD_BYTES
    pages = d.hicache_storage_size // per_page
    if pages < 1:
        raise CapacityError(
            f"--hicache-storage-size {d.hicache_storage_size} B holds no page ({per_page} B per stored page for "
            f"layers {layout.describe_range()}): raise it to at least {per_page} B"
        )
    return int(pages * layout.page_size)


def plan_stage(d: Deployment, stage: int) -> StagePlan:
    dense, elided = d.layout(stage, elide=False), d.layout(stage, elide=True)
    budget, weights = d.stage_budget(stage)
    td, te = max_total_num_tokens(budget, dense), max_total_num_tokens(budget, elided)
    start, end = d.stage_ranges[stage]
    hb, htd = host_tokens(d, dense, td)
    hb2, hte = host_tokens(d, elided, te)
    hs_dense = hs_elided = None
    if d.hisparse:
        assert d.hisparse_ratio is not None
        hs_dense = hisparse_figures(budget, dense, d.hisparse_ratio, d.hisparse_buffer)
        hs_elided = hisparse_figures(budget, elided, d.hisparse_ratio, d.hisparse_buffer)
    return StagePlan(
        stage=stage,
        layer_start=start,
        layer_end=end,
        draft_layers=d.stage_draft_layers(stage),
        producers=elided.producers,
        budget_bytes=budget,
        weight_bytes=weights,
        bytes_per_token_dense=dense.bytes_per_token,
        bytes_per_token_elided=elided.bytes_per_token,
        tokens_dense=td,
        tokens_elided=te,
        host_tokens_dense=htd,
        host_tokens_elided=hte,
        host_bytes=hb2 if hb2 is not None else hb,
        storage_bytes=d.hicache_storage_size,
        storage_tokens_dense=storage_tokens(d, dense),
        storage_tokens_elided=storage_tokens(d, elided),
        hisparse_dense=hs_dense,
        hisparse_elided=hs_elided,
    )


def plan(d: Deployment) -> RolePlan:
    """Plan every stage of a deployment."""
    return RolePlan(d, tuple(plan_stage(d, s) for s in range(d.pp)))
