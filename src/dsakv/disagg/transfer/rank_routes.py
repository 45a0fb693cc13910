"""The sender rule (rank_assign.assign) on one handshaken link: which of a link's parts (decode stage x decode
TP rank) this prefill rank writes, and which keys of each.

    routes = part_routes(link, stage=k, tp_rank=t, tp_size=T, rotate=request_rotation(rid))
    for part, table in routes: TransferPlan.build(table, src, dst) -> backend.submit(part.peer, ...)

Grid as rank_assign sees it: the senders are the T TP ranks of prefill stage k (each holds the stage's keys:
latent KV and index-K are replicated over TP, so every rank holds every key of its stage), the receivers are
the link's parts, `RankId(decode stage, 0, decode rank)`, each needing the keys it pairs with this stage. The
rule gives each (receiver, key) exactly one sender and no sender more than ceil(receivers / senders) of one key's
receivers; with T = 1 every part gets all its keys from this rank (TP 1 -> TP 2: the one prefill rank writes both
decode ranks' pools). The rotation is a pure function of the request id, so every prefill rank computes the same
routes without talking to the others.

Bench only: DSAKV_BENCH_RANK0_SENDER=1 in the prefill's environment (its TP ranks inherit it) swaps the rule for
SGLang's rank-0 sender (rank_assign.assign_rank0: prefill TP rank 0 writes every key to every receiver, the
others send nothing), so bench/parallel.py can measure the rule against it; default off, never for serving.
Imports dsakv.disagg.transfer.{bootstrap, plan, rank_assign}; no torch.
"""

from __future__ import annotations

import os
import zlib

from dsakv.disagg.transfer.bootstrap import DecodeLink, LinkPart
from dsakv.disagg.transfer.plan import PairTable
from dsakv.disagg.transfer.rank_assign import Assignment, RankId, assign, assign_rank0

RANK0_ENV = "DSAKV_BENCH_RANK0_SENDER"  # bench only: rank 0 sends every key (the comparison arm)


def rank0_sender() -> bool:
    """Whether this process's environment asks for the rank-0 sender (RANK0_ENV set, not "" or "0")."""
    return os.environ.get(RANK0_ENV, "0") not in ("", "0")


def request_rotation(rid: str) -> int:
    """The tie-order rotation of request `rid` (the same on every prefill rank: crc32 of its id)."""
    return zlib.crc32(rid.encode())


def receiver(part: LinkPart) -> RankId:
    return RankId(part.stage, 0, part.rank)


def link_assignment(
    link: DecodeLink, stage: int, tp_size: int = 1, rotate: int = 0, rank0: bool | None = None
) -> Assignment:
    """The rule over a link: senders = prefill stage `stage`'s TP ranks, receivers = the link's parts, each key
    weighed by its page bytes (the bytes spread over the senders). `rank0` (default: rank0_sender()): the bench's
    rank-0 sender instead."""
    needs = {receiver(p): [kp.key for kp in p.table.pairs] for p in link.parts}
    held = sorted({k for keys in needs.values() for k in keys})
    weight = {kp.key: kp.page_bytes for p in link.parts for kp in p.table.pairs}
    senders = {RankId(stage, 0, t): held for t in range(tp_size)}
    if rank0_sender() if rank0 is None else rank0:
        return assign_rank0(senders, needs)
    return assign(senders, needs, weight, rotate=rotate)


def part_routes(
    link: DecodeLink, stage: int, tp_rank: int = 0, tp_size: int = 1, rotate: int = 0
) -> list[tuple[LinkPart, PairTable]]:
    """The parts prefill rank `tp_rank` of stage `stage` writes, each with the table of the keys it sends there
    (a part it sends nothing to is left out: no empty plan, no dummy transfer)."""
    a = link_assignment(link, stage, tp_size, rotate)
    mine = a.keys_from(RankId(stage, 0, tp_rank))
    out = []
    for part in link.parts:
        keys = set(mine.get(receiver(part), ()))
        if not keys:
            continue
        pairs = [kp for kp in part.table.pairs if kp.key in keys]
        out.append((part, part.table if len(pairs) == len(part.table.pairs) else PairTable.of(pairs)))
    return out


def route_pairs(link: DecodeLink, stage: int, tp_size: int, rotate: int = 0) -> list[list[int]]:
    """The (prefill TP rank, decode cell) pairs the rule routes any key over, sorted: what a TP prefill stage's
    report names so the decode can check that every one of them landed (StageDone.routes). A decode cell is the
    part's flat rank (LinkPart.cell: the TP rank for a one-stage decode, stage x TP + rank for a TP x PP one)."""
    a = link_assignment(link, stage, tp_size, rotate)
    cell = {receiver(p): p.cell for p in link.parts}
    return [list(p) for p in sorted({(s.tp, cell[r]) for s, r in a.routes})]


__all__ = ["RANK0_ENV", "link_assignment", "part_routes", "rank0_sender", "receiver", "request_rotation", "route_pairs"]
