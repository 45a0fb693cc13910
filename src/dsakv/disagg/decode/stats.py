"""A decode worker's counters (its health's `counters`, with WorkerService's rpc_* ones beside them)."""

from __future__ import annotations

from dataclasses import dataclass

from dsakv.util.stats import Stats, on_first_use


@dataclass
class DecodeStats(Stats):
    """Bumped under the worker's lock by the RPC handlers (kv_in, inbound) and the step loop (outputs)."""

    prealloc: int = 0  # requests whose pages were reserved
    busy: int = 0  # PREALLOCs refused for now (no free pages, the pipeline down)
    started: int = 0  # requests whose KV landed from every stage: decoding
    kv_failed: int = 0  # requests failed before decoding (a stage's KV failed, a deadline)
    finished: int = 0
    tokens: int = 0  # tokens decoded
    kv_bytes: int = 0  # KV bytes the stages reported landed
    reports_refused: int = 0  # STAGE_DONE / KV_FAILED reports refused (not the request's stage, bad grant)
    staged_in: int = 0  # requests whose KV came through a staging slot
    staging_no_slot: int = 0  # PREALLOCs with no free staging slot
    revoked: int = on_first_use()  # a failed request's grant revoked at a prefill stage (no write in flight)


__all__ = ["DecodeStats"]
