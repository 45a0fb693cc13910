"""DeepSeek-V4 capacity: per-kind bytes per token, per-request state, tokens per PP stage, SGLang's accounting.

A V4 pool is pages of the token-indexed kinds plus one state slot per running request:

    budget = slots x state_bytes_per_request + pages x bytes_per_page        tokens = pages x page_size

so the per-request state is charged against the concurrency it allows (`max_running` slots), not per token.
SGLang's planner (as the issue quotes it) charges every token 0.1 x a window entry per layer (a window pool
sized at 0.1 x capacity), 64 B of ratio-4 compressor state per CSA layer, and the indexer at fp8 size even when
it is fp4. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from dsakv.errors import CapacityError, ConfigError
from dsakv.spec.layout import Kind
from dsakv.spec.v4 import CSA, HCA, WINDOW, V4Spec
from dsakv.spec.v4_layout import PAGED_KINDS, STATE_KINDS, PagedSpec, StateSpec, V4Layout, dense_bytes_per_token
from dsakv.util import ceil_div

SGLANG_WINDOW_FRACTION = Fraction(1, 10)  # SGLang's window pool: 0.1 x the full-token capacity, every layer
SGLANG_CSA_STATE_PER_TOKEN = 64  # B per full token per CSA layer: the ratio-4 compressor state sized per token


@dataclass(frozen=True)
class V4Deployment:
    spec: V4Spec
    partition: tuple[int, ...] | None = None
    draft_layers: int = 0
    kv_format: str = "fp8-584"
    index_format: str = "fp8-132"
    page_size: int | None = None
    hca_state: str = "online"
    kv_budget: int | None = None
    max_running: int = 1
    context_len: int | None = None

    def __post_init__(self) -> None:
        n = self.spec.num_layers
        if self.partition is None:
            object.__setattr__(self, "partition", (n,))
        part = self.parts
        if not part or any(k < 1 for k in part) or sum(part) != n:
            raise ConfigError(
                f"PP partition {','.join(map(str, part))} must be positive layer counts summing to the model's "
                f"{n} main layers"
            )
        if isinstance(self.max_running, bool) or not isinstance(self.max_running, int) or self.max_running < 1:
            raise ConfigError(f"--max-running-requests {self.max_running!r} must be an integer >= 1")
        if self.context_len is not None and self.context_len < 1:
            raise ConfigError(f"--context-len {self.context_len} must be >= 1")
        self.layout(0)  # validates formats, page size, draft layers

    @property
    def parts(self) -> tuple[int, ...]:
        assert self.partition is not None
        return self.partition

    @property
    def pp(self) -> int:
        return len(self.parts)

    def stage_range(self, stage: int) -> tuple[int, int]:
        start = sum(self.parts[:stage])
        return start, start + self.parts[stage]

    def layout(self, stage: int, **over: Any) -> V4Layout:
        start, end = self.stage_range(stage)
        kw: dict[str, Any] = {
            "draft_layers": self.draft_layers if stage == self.pp - 1 else 0,  # MTP runs after the last layer
            "kv_format": self.kv_format,
            "index_format": self.index_format,
            "page_size": self.page_size,
            "hca_state": self.hca_state,
        }
        kw.update(over)
        return V4Layout(self.spec, start, end, **kw)


@dataclass(frozen=True)
class V4StagePlan:
    stage: int
    layout: V4Layout
    budget: int | None
    slots: int
    pages: int | None
    requests_at_context: int | None

    @property
    def tokens(self) -> int | None:
        return None if self.pages is None else self.pages * self.layout.page

    @property
    def state_bytes(self) -> int:
        return self.slots * self.layout.state_bytes_per_request

    def counts(self) -> dict[str, int]:
        s = self.layout.spec
        return {t: len(s.layers_of(t, self.layout.layer_start, self.layout.end)) for t in (WINDOW, CSA, HCA)}

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        return {
            "stage": self.stage,
            "layers": [lay.layer_start, lay.end - 1],
            "draft_layers": lay.draft_layers,
            "layer_types": self.counts(),
            "bytes_per_token": str(lay.bytes_per_token),
            "bytes_per_token_float": float(lay.bytes_per_token),
            "bytes_per_page": lay.bytes_per_page,
            "state_bytes_per_request": lay.state_bytes_per_request,
            "budget_bytes": self.budget,
            "slots": self.slots,
            "state_bytes": self.state_bytes,
            "pages": self.pages,
            "tokens": self.tokens,
            "requests_at_context": self.requests_at_context,
        }


def stage_plan(d: V4Deployment, stage: int) -> V4StagePlan:
    lay = d.layout(stage)
    if d.kv_budget is None:
        return V4StagePlan(stage, lay, None, d.max_running, None, None)
    free = d.kv_budget - d.max_running * lay.state_bytes_per_request
    pages = free // lay.bytes_per_page if free > 0 else 0
    if pages < 1:
        raise CapacityError(
            f"stage {stage} (layers {lay.describe_range()}): a KV budget of {d.kv_budget:,} B holds "
            f"{d.max_running} request slots of {lay.state_bytes_per_request:,} B state and no page of "
            f"{lay.bytes_per_page:,} B: raise --kv-budget or lower --max-running-requests"
        )
    at_ctx = None
    if d.context_len is not None:
        per_req = ceil_div(d.context_len, lay.page) * lay.bytes_per_page + lay.state_bytes_per_request
        at_ctx = d.kv_budget // per_req
    return V4StagePlan(stage, lay, d.kv_budget, d.max_running, pages, at_ctx)


@dataclass(frozen=True)
class V4Plan:
    deployment: V4Deployment
    stages: tuple[V4StagePlan, ...]

    @property
    def binding(self) -> int:
        if any(s.tokens is None for s in self.stages):
            return max(range(len(self.stages)), key=lambda i: (self.stages[i].layout.bytes_per_token, -i))
        return min(range(len(self.stages)), key=lambda i: (self.stages[i].tokens or 0, i))

    @property
    def tokens(self) -> int | None:
        return self.stages[self.binding].tokens

    def to_dict(self) -> dict[str, Any]:
        d = self.deployment
        whole = d.layout(0) if d.pp == 1 else V4Deployment(**{**d.__dict__, "partition": None}).layout(0)
        return {
            "model": d.spec.name,
            "model_type": d.spec.model_type,
            "partition": list(d.parts),
            "page_size": whole.page,
            "kv_format": d.kv_format,
            "index_format": d.index_format,
            "hca_state": d.hca_state,
            "max_running_requests": d.max_running,
            "kinds": kind_rows(whole),
            "figures": figures(d.spec, d.kv_format, whole.page),
            "states": state_rows(whole),
            "stages": [s.to_dict() for s in self.stages],
            "binding_stage": self.binding,
            "tokens": self.tokens,
            "sglang": sglang_rows(whole, d.max_running, d.kv_budget),
        }


def plan_v4(d: V4Deployment) -> V4Plan:
    return V4Plan(d, tuple(stage_plan(d, s) for s in range(d.pp)))


def kind_rows(lay: V4Layout) -> list[dict[str, Any]]:
    """One row per paged kind: layers holding it, entry bytes, entries per page, bytes per token."""
    out = []
    for kind in PAGED_KINDS:
        layers = lay.layers_of_kind(kind)
        if not layers:
            continue
        b = lay.buffer(next(k for k in lay.keys if k.kind is kind))
        assert isinstance(b, PagedSpec)
        out.append(
            {
                "kind": kind.value,
                "layers": len(layers),
                "entry_bytes": b.entry_bytes,
                "ratio": b.ratio,
                "entries_per_page": b.entries_per_page,
                "bytes_per_token": str(lay.bytes_per_token_of(kind)),
                "bytes_per_token_float": float(lay.bytes_per_token_of(kind)),
            }
        )
    return out


def state_rows(lay: V4Layout) -> list[dict[str, Any]]:
    """One row per state kind: layers, slot bytes per layer, bytes per request; HCA in both modes."""
    out = []
    for kind in STATE_KINDS:
        layers = lay.layers_of_kind(kind)
        if not layers:
            continue
        st = lay.buffer(next(k for k in lay.keys if k.kind is kind))
        assert isinstance(st, StateSpec)
        row: dict[str, Any] = {
            "kind": kind.value,
            "layers": len(layers),
            "rows": st.rows,
            "row_bytes": st.row_bytes,
            "bytes_per_request": lay.state_bytes_of(kind),
        }
        if kind is Kind.HCA_STATE:
            other = "ring" if lay.hca_state == "online" else "online"
            row["mode"] = lay.hca_state
            row[f"bytes_per_request_{other}"] = V4Layout(
                lay.spec, lay.layer_start, lay.end, lay.draft_layers, lay.kv_format, lay.index_format, lay.page, other
            ).state_bytes_of(kind)
        out.append(row)
    return out


def figures(spec: V4Spec, kv_format: str, page_size: int) -> dict[str, str]:
    """Growing bytes per token of the whole model: by read (fp8 / fp4 indexer), every kind everywhere, dense."""

    def bpt(**kw: Any) -> Fraction:
        return V4Layout(spec, kv_format=kv_format, page_size=page_size, **kw).bytes_per_token

    return {
        "by_read_fp8": str(bpt(index_format="fp8-132")),
        "by_read_fp4": str(bpt(index_format="fp4-68")),
        "every_layer_fp8": str(bpt(index_format="fp8-132", every_layer=True)),
        "dense_v32_style": str(dense_bytes_per_token(spec, kv_format)),
    }


def sglang_bytes_per_token(lay: V4Layout) -> Fraction:
    """SGLang's per-full-token charge for the same layers (window pool, per-token CSA state, fp8-sized indexer)."""
    fp8 = V4Layout(lay.spec, lay.layer_start, lay.end, 0, lay.kv_format, "fp8-132", lay.page, lay.hca_state)
    window = SGLANG_WINDOW_FRACTION * lay.entry_bytes * len(lay.main_layers)
    csa = SGLANG_CSA_STATE_PER_TOKEN * len(lay.layers_of_kind(Kind.CSA_STATE))
    return fp8.bytes_per_token + window + csa


def sglang_rows(lay: V4Layout, slots: int, budget: int | None) -> dict[str, Any]:
    """SGLang's reservations beside dsakv's on the same layers and budget, each with what it buys."""
    s = lay.spec
    n_main = len(lay.main_layers)
    n_csa = len(lay.layers_of_kind(Kind.CSA_STATE))
    fp8_index = Fraction(132 if lay.index_format == "fp4-68" else lay.index_entry_bytes, s.csa_ratio) * n_csa
    window_sg = SGLANG_WINDOW_FRACTION * lay.entry_bytes * n_main
    rows = [
        {
            "reservation": "CSA KV (ratio-4 entries)",
            "sglang_bpt": str(lay.bytes_per_token_of(Kind.CSA_KV)),
            "dsakv_bpt": str(lay.bytes_per_token_of(Kind.CSA_KV)),
            "dsakv_per_request": 0,
            "buys": f"one compressed K=V entry per {s.csa_ratio} tokens on the {n_csa} CSA layers (both)",
        },
        {
            "reservation": "CSA index-K",
            "sglang_bpt": str(fp8_index),
            "dsakv_bpt": str(lay.bytes_per_token_of(Kind.CSA_INDEX_K)),
            "dsakv_per_request": 0,
            "buys": f"the indexer's compressed keys ({lay.index_format}; SGLang sizes an fp4 indexer as fp8-132)",
        },
        {
            "reservation": "HCA KV (ratio-128 entries)",
            "sglang_bpt": str(lay.bytes_per_token_of(Kind.HCA_KV)),
            "dsakv_bpt": str(lay.bytes_per_token_of(Kind.HCA_KV)),
            "dsakv_per_request": 0,
            "buys": f"one compressed entry per {s.hca_ratio} tokens on the HCA layers (both)",
        },
        {
            "reservation": "sliding window",
            "sglang_bpt": str(window_sg),
            "dsakv_bpt": "0",
            "dsakv_per_request": lay.state_bytes_of(Kind.WINDOW),
            "buys": f"SGLang: window rows for 0.1 x capacity tokens = capacity / {int(s.sliding_window * 10)} "
            f"requests' windows; dsakv: one {s.sliding_window}-entry ring per running request, every layer",
        },
        {
            "reservation": "CSA compressor + indexer state",
            "sglang_bpt": str(SGLANG_CSA_STATE_PER_TOKEN * n_csa),
            "dsakv_bpt": "0",
            "dsakv_per_request": lay.state_bytes_of(Kind.CSA_STATE) + lay.state_bytes_of(Kind.CSA_INDEX_STATE),
            "buys": f"SGLang: state for every token; dsakv: {2 * s.csa_ratio} fp32 slots per request "
            "(the open window and the previous one's overlap half)",
        },
        {
            "reservation": "HCA compressor state",
            "sglang_bpt": "0",
            "dsakv_bpt": "0",
            "dsakv_per_request": lay.state_bytes_of(Kind.HCA_STATE),
            "buys": f"the open {s.hca_ratio}-token window ({lay.hca_state})",
        },
    ]
    sg = sglang_bytes_per_token(lay)
    out: dict[str, Any] = {
        "rows": rows,
        "sglang_bpt": str(sg),
        "dsakv_bpt": str(lay.bytes_per_token),
        "dsakv_state_per_request": lay.state_bytes_per_request,
        "slots": slots,
    }
    if budget is not None:
        sg_tokens = int(budget / sg) // lay.page * lay.page
        free = budget - slots * lay.state_bytes_per_request
        ds_tokens = max(free // lay.bytes_per_page, 0) * lay.page
        out.update(
            {
                "budget": budget,
                "sglang_tokens": sg_tokens,
                "sglang_window_requests": int(sg_tokens * SGLANG_WINDOW_FRACTION) // s.sliding_window,
                "dsakv_tokens": ds_tokens,
                "gain": round(ds_tokens / sg_tokens - 1.0, 6) if sg_tokens else None,
            }
        )
    return out
