"""Read-only views of a DecodeWorker: its HEALTH reply and the integrity check of its books.

    decode_views.health(worker)     -> DecodeHealth (pools, inbound / failed-held requests, registered prefill stages,
                                       counters, integrity, MTP counters, a pipeline's fields from stage 0)
    decode_views.integrity(worker)  -> "ok", or what does not balance (the engine's books; the requests the engine
                                       holds waiting for KV == the ones the inbound ledger tracks; the staging
                                       slots held == the ones the requests hold)

DecodeWorker.health / .integrity answer with these (the HEALTH RPC and WorkerService's integrity hook); the worker's
RPC handlers and step loop stay in decode_worker. The worker is read through a Protocol (DecodeState), so this module
does not import decode_worker. Nothing here changes the worker; the lock is taken only to copy the ledger's ids.
"""

from __future__ import annotations

import os
from contextlib import AbstractContextManager
from typing import Any, Protocol

from dsakv.config import DecodeConfig
from dsakv.disagg.decode import stage as decode_stage
from dsakv.disagg.decode.ranks import DecodeTP
from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.protocol.lifecycle import InboundKv, Ledger, Phase
from dsakv.disagg.protocol.messages import DecodeHealth, StageInfo
from dsakv.disagg.transfer.staging import StagingSlots
from dsakv.engine.engine import Engine


class DecodeState(decode_stage.DecodeWorker, Protocol):
    """What the views read of a decode worker (decode_worker.DecodeWorker), on top of what its pipeline reads."""

    cfg: DecodeConfig
    stats: DecodeStats
    inbound: Ledger[InboundKv]
    pipeline: decode_stage.DecodePipeline | None
    slots: StagingSlots | None
    tp: DecodeTP

    @property
    def _lock(self) -> AbstractContextManager[Any]: ...


def integrity(w: DecodeState) -> str:
    """'ok', or what does not balance (engine books; requests waiting for KV == the ones tracked)."""
    try:
        w.engine.check_integrity()
        with w._lock:
            waiting = set(w.engine.scheduler.awaiting_kv)
            ours = set(w.inbound)
        if waiting != ours:
            return (
                f"requests waiting for KV in the engine {sorted(waiting - ours)[:4]} are not tracked, "
                f"tracked ones {sorted(ours - waiting)[:4]} are not waiting"
            )
        if w.slots is not None:
            with w._lock:  # slots are taken and given back under it
                want = {inb.slot: inb.rid for inb in w.inbound.values() if inb.slot >= 0}
                held = w.slots.held()
            if held != want:
                return f"staging slots held {held} but the requests hold {want}"
    except AssertionError as e:
        return str(e)
    return "ok"


def health(w: DecodeState) -> DecodeHealth:
    """The HEALTH reply of decode worker `w` (stage 0's, with the pipeline's fields, for a pipelined decode)."""
    st = w.engine.stats()
    with w._lock:
        failed_held = len(w.inbound.in_phase(Phase.FAILED))
        inbound = len(w.inbound) - failed_held
    extra = w.pipeline.health_fields(w) if w.pipeline is not None else w.tp.health_fields()
    return DecodeHealth(
        ok=not w.service.stopping.is_set() and extra.get("down") is None,
        role="decode",
        name=w.name,
        pid=os.getpid(),
        boot=w.boot,
        elide=w.engine.layout.elide,
        backend=w.cfg.config.transfer.backend,
        page_size=st.page_size,
        pages_total=st.pages_total,
        pages_used=st.pages_used,
        pages_free=st.pages_free,
        capacity_tokens=st.capacity_tokens,
        bytes_per_token=st.bytes_per_token,
        max_prompt_tokens=st.capacity_tokens - 1,
        vocab_size=int(w.engine.spec.vocab_size),
        running=st.num_running,
        waiting=st.num_waiting,
        inbound=inbound,
        failed_held=failed_held,
        stages=[
            StageInfo(stage=e.stage, rpc=e.rpc, prefill=e.prefill, layers=[e.layer_start, e.layer_end - 1])
            for e in w.registry.entries()
        ],
        counters=w.stats.as_dict(),
        integrity=w.integrity(),
        spec=spec_counters(w.engine),
        staging_slots=[w.slots.free, w.slots.num_slots] if w.slots is not None else None,
        **extra,
    )


def spec_counters(engine: Engine) -> dict[str, float] | None:
    """Engine.spec_stats() without the engine lock (plain counters): health must not wait for another step."""
    sp = engine.speculator
    return sp.stats.to_dict() if sp is not None else None
