"""Which prefill rank sends which key to which decode rank: the sender-assignment rule and the grid check.

A role is a grid of ranks (PP stage x DP group x attention-TP rank). Every attention-TP rank of a stage holds the
full keys of that stage's layers (MLA latent KV and index-K are replicated, never split by head), and a request
lives in one DP group on each side. So for one request:

    holders(key)   = the ranks of the prefill request's DP group whose stage holds key   (a of them: prefill TP)
    needers(key)   = the ranks of the decode request's DP group whose stage holds key    (c of them: decode
                     attention TP)

and the rule (`assign`) gives every (needing rank, key) exactly one sender among the holders, with

    per key: no holder serves more than ceil(len(needers) / len(holders)) of that key's receivers
    across keys: among the holders allowed, the one with the fewest bytes assigned so far (then fewest
                 transfers, then the first in a tie order the caller rotates per request) sends, so the bytes
                 spread over every prefill rank, within one key's bytes per request

    prefill TP 2 -> decode TP 4, one key:   tp0 -> d.tp0, d.tp2 ; tp1 -> d.tp1, d.tp3 (cap 2)
    prefill TP 8 -> decode DP 8 (DP attn):  one receiver per key; the keys round the 8 senders by bytes
    prefill TP 2 -> decode TP 1:            each key sent once, alternating by bytes (no rank-0 hotspot)

It is a pure function of the two grids and the keys' sizes: every rank computes the same routes on its own,
nothing is negotiated, and no rank gets a dummy request (a rank with no keys to send has no route). SGLang's
rank-0-only rule (`assign_rank0`) is kept for comparison (bench/parallel.py).

`check_grids` is the handshake-side check: each role's announced ranks form its whole grid (no rank missing or
twice), the stages tile the model's layers, the request's DP group exists on both sides, and every key a decode
rank needs has a holder; each problem is named. Imports only dsakv.errors and dsakv.spec; no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field

from dsakv.errors import ConfigError
from dsakv.spec.layout import BufferKey, Kind
from dsakv.spec.model import ModelSpec
from dsakv.util import ceil_div


@dataclass(frozen=True, order=True)
class RankId:
    """One rank of a role's grid."""

    stage: int = 0
    dp: int = 0
    tp: int = 0

    def __str__(self) -> str:
        return f"stage {self.stage} dp {self.dp} tp {self.tp}"


@dataclass(frozen=True)
class RoleGrid:
    """A role's rank grid as its handshake announces it.

    `stages[i]` is stage i's layer range [start, end); the draft layers (ids num_layers..) sit on the last stage.
    `dp` DP groups of `attention_tp` ranks per stage (dp 1 without DP attention: every rank serves every request).
    """

    role: str
    stages: tuple[tuple[int, int], ...]
    dp: int = 1
    attention_tp: int = 1
    draft_layers: int = 0

    def __post_init__(self) -> None:
        if not self.stages:
            raise ConfigError(f"{self.role} grid has no stage: announce at least one layer range")
        for name, v in (("dp", self.dp), ("attention_tp", self.attention_tp), ("draft_layers", self.draft_layers)):
            if v < (0 if name == "draft_layers" else 1):
                raise ConfigError(f"{self.role} grid: {name} {v} is out of range")

    @classmethod
    def from_partition(
        cls, role: str, partition: Iterable[int], *, dp: int = 1, attention_tp: int = 1, draft_layers: int = 0
    ) -> RoleGrid:
        out, start = [], 0
        for n in partition:
            out.append((start, start + n))
            start += n
        return cls(role, tuple(out), dp=dp, attention_tp=attention_tp, draft_layers=draft_layers)

    @property
    def num_layers(self) -> int:
        return self.stages[-1][1]

    @property
    def ranks(self) -> tuple[RankId, ...]:
        return tuple(
            RankId(s, d, t) for s in range(len(self.stages)) for d in range(self.dp) for t in range(self.attention_tp)
        )

    def group(self, dp: int) -> tuple[RankId, ...]:
        """The ranks that hold a request of DP group `dp` (every stage, every attention-TP rank)."""
        self.check_dp(dp)
        return tuple(r for r in self.ranks if r.dp == dp)

    def check_dp(self, dp: int) -> None:
        if not 0 <= dp < self.dp:
            raise ConfigError(
                f"DP rank {dp} does not exist on the {self.role}: it has {self.dp} DP group(s) (ranks 0..{self.dp - 1})"
            )

    def stage_layers(self, stage: int) -> tuple[int, ...]:
        start, end = self.stages[stage]
        draft = range(self.num_layers, self.num_layers + self.draft_layers) if stage == len(self.stages) - 1 else ()
        return (*range(start, end), *draft)

    def describe(self) -> str:
        parts = ",".join(str(e - s) for s, e in self.stages)
        return f"{self.role}: pp {len(self.stages)} ({parts}) x dp {self.dp} x attention tp {self.attention_tp}"


def grid_keys(
    grid: RoleGrid, stage_keys: Callable[[int], Collection[BufferKey]], dp: int
) -> dict[RankId, frozenset[BufferKey]]:
    """The keys each rank of DP group `dp` holds: its stage's keys, the same on every attention-TP rank."""
    per_stage = {s: frozenset(stage_keys(s)) for s in range(len(grid.stages))}
    return {r: per_stage[r.stage] for r in grid.group(dp)}


class MissingSender(ConfigError):
    """A receiving rank needs a key no sending rank holds."""


@dataclass(frozen=True)
class Assignment:
    """routes[(sender, receiver)] = the keys that sender writes into that receiver, in key order."""

    routes: dict[tuple[RankId, RankId], tuple[BufferKey, ...]]
    skipped: tuple[tuple[RankId, BufferKey], ...] = ()
    _by_receiver: dict[tuple[RankId, BufferKey], RankId] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for (s, r), keys in self.routes.items():
            for k in keys:
                self._by_receiver[(r, k)] = s

    def sender_of(self, receiver: RankId, key: BufferKey) -> RankId:
        return self._by_receiver[(receiver, key)]

    def keys_from(self, sender: RankId) -> dict[RankId, tuple[BufferKey, ...]]:
        """What one sending rank sends: receiver -> keys (empty when it sends nothing: no dummy work)."""
        return {r: keys for (s, r), keys in self.routes.items() if s == sender}

    @property
    def senders(self) -> tuple[RankId, ...]:
        return tuple(sorted({s for s, _ in self.routes}))

    def transfers(self, sender: RankId) -> int:
        """(receiver, key) transfers this sender makes."""
        return sum(len(keys) for (s, _), keys in self.routes.items() if s == sender)

    def pair_bytes(self, key_bytes: Mapping[BufferKey, int]) -> dict[tuple[RankId, RankId], int]:
        """Bytes per (sender, receiver) pair for a request whose keys weigh `key_bytes` (page bytes x pages)."""
        return {pair: sum(key_bytes[k] for k in keys) for pair, keys in self.routes.items()}

    def sender_bytes(self, key_bytes: Mapping[BufferKey, int]) -> dict[RankId, int]:
        out: dict[RankId, int] = {}
        for (s, _), n in self.pair_bytes(key_bytes).items():
            out[s] = out.get(s, 0) + n
        return out


def elided_index_k(spec: ModelSpec) -> Callable[[BufferKey], bool]:
    """The keys a sender may lack (compat's one-sided elision rule): index-K of a layer that shares its producer's
    top-k."""
    return lambda key: key.kind is Kind.INDEX_K and not spec.owns_index_k(key.layer)


def assign(
    senders: Mapping[RankId, Collection[BufferKey]],
    receivers: Mapping[RankId, Collection[BufferKey]],
    key_bytes: Mapping[BufferKey, int] | None = None,
    *,
    optional: Callable[[BufferKey], bool] | None = None,
    rotate: int = 0,
) -> Assignment:
    """Give every (receiving rank, key) exactly one sending rank that holds the key (the module's rule).

    `rotate` turns the tie order among equally loaded holders (holder i of n ranks as (i - rotate) mod n), so
    requests given different values (the request's sequence number, or its decode DP rank) start on different
    senders and no rank is favoured across requests.
    `senders` / `receivers`: the keys each rank of the request's DP group holds. `key_bytes` weighs the keys
    (default 1 each). A key a receiver holds and no sender does is skipped when `optional(key)` (one-sided
    index-K elision: the caller says which keys are allowed to be absent), else MissingSender names it.
    """
    weight = key_bytes or {}
    holders: dict[BufferKey, list[RankId]] = {}
    for s in sorted(senders):
        for k in senders[s]:
            holders.setdefault(k, []).append(s)
    needers: dict[BufferKey, list[RankId]] = {}
    for r in sorted(receivers):
        for k in receivers[r]:
            needers.setdefault(k, []).append(r)
    load = {s: (0, 0) for s in senders}  # (bytes, transfers) assigned so far
    routes: dict[tuple[RankId, RankId], list[BufferKey]] = {}
    skipped: list[tuple[RankId, BufferKey]] = []
    for key in sorted(needers):
        recvs, hold = needers[key], holders.get(key, [])
        if not hold:
            if optional is not None and optional(key):
                skipped.extend((r, key) for r in recvs)
                continue
            raise MissingSender(
                f"no sending rank holds {key} (layer {key.layer}, kind {key.kind.value}) that receiving rank(s) "
                f"{', '.join(map(str, recvs))} need: the sender's stages do not cover layer {key.layer}, or it "
                "elides that key; check both roles' partitions and --elide settings"
            )
        cap = ceil_div(len(recvs), len(hold))
        used = dict.fromkeys(hold, 0)
        nbytes = int(weight.get(key, 1))
        order = {h: (i - rotate) % len(hold) for i, h in enumerate(hold)}
        for r in recvs:
            s = min((h for h in hold if used[h] < cap), key=lambda h: (load[h][0], load[h][1], order[h]))
            used[s] += 1
            load[s] = (load[s][0] + nbytes, load[s][1] + 1)
            routes.setdefault((s, r), []).append(key)
    return Assignment({p: tuple(ks) for p, ks in sorted(routes.items())}, tuple(skipped))


def assign_rank0(
    senders: Mapping[RankId, Collection[BufferKey]], receivers: Mapping[RankId, Collection[BufferKey]]
) -> Assignment:
    """SGLang's rule, for comparison: the lowest-ranked holder of a key (tp 0 of its stage) sends it to everyone."""
    routes: dict[tuple[RankId, RankId], list[BufferKey]] = {}
    for r in sorted(receivers):
        for key in sorted(receivers[r]):
            hold = sorted(s for s in senders if key in senders[s])
            if not hold:
                raise MissingSender(f"no sending rank holds {key} that receiving rank {r} needs")
            routes.setdefault((hold[0], r), []).append(key)
    return Assignment({p: tuple(ks) for p, ks in sorted(routes.items())})


def check_announced(grid: RoleGrid, announced: Iterable[RankId], num_layers: int) -> None:
    """Refuse a role whose announced ranks are not exactly its grid, or whose stages do not tile the layers."""
    if grid.num_layers != num_layers or grid.stages[0][0] != 0:
        raise ConfigError(
            f"{grid.describe()}: its stages cover layers {grid.stages[0][0]}..{grid.num_layers - 1}, the model has "
            f"layers 0..{num_layers - 1}: fix its --pp-partition"
        )
    for (a0, a1), (b0, _) in zip(grid.stages, grid.stages[1:], strict=False):
        if a1 != b0 or a1 <= a0:
            raise ConfigError(f"{grid.describe()}: stage ranges {grid.stages} do not tile the layers in order")
    seen: dict[RankId, int] = {}
    for r in announced:
        seen[r] = seen.get(r, 0) + 1
    want = set(grid.ranks)
    twice = sorted(r for r, n in seen.items() if n > 1)
    extra = sorted(set(seen) - want)
    missing = sorted(want - set(seen))
    problems = []
    if twice:
        problems.append(f"announced twice: {', '.join(map(str, twice))}")
    if extra:
        problems.append(f"outside the grid: {', '.join(map(str, extra))}")
    if missing:
        problems.append(f"missing: {', '.join(map(str, missing))}")
    if problems:
        raise ConfigError(
            f"{grid.describe()} has {len(want)} ranks; " + "; ".join(problems) + ": start every rank with the same "
            "--tp-size / --dp-size / --pp-size, each with its own rank id"
        )


def check_grids(
    prefill: RoleGrid,
    decode: RoleGrid,
    *,
    prefill_dp: int,
    decode_dp: int,
    prefill_keys: Callable[[int], Collection[BufferKey]],
    decode_keys: Callable[[int], Collection[BufferKey]],
    key_bytes: Mapping[BufferKey, int] | None = None,
    optional: Callable[[BufferKey], bool] | None = None,
    rotate: int = 0,
) -> Assignment:
    """The handshake check for one request: both grids over the same layers and draft layers, the DP groups it
    names exist, every needed key has a holder; returns the request's routes."""
    if prefill.num_layers != decode.num_layers:
        raise ConfigError(
            f"rank grids disagree: {prefill.describe()} covers {prefill.num_layers} layers, {decode.describe()} "
            f"{decode.num_layers}: both roles must serve the same model"
        )
    if prefill.draft_layers < decode.draft_layers:
        raise ConfigError(
            f"rank grids disagree: the decode holds {decode.draft_layers} draft layer(s), the prefill "
            f"{prefill.draft_layers}: give both the same --speculative-num-steps checkpoint"
        )
    prefill.check_dp(prefill_dp)
    decode.check_dp(decode_dp)
    return assign(
        grid_keys(prefill, prefill_keys, prefill_dp),
        grid_keys(decode, decode_keys, decode_dp),
        key_bytes,
        optional=optional,
        rotate=rotate,
    )
