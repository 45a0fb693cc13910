"""A prefill stage's counters (its health's `counters`, with WorkerService's rpc_* ones beside them)."""

from __future__ import annotations

from dataclasses import dataclass

from dsakv.util.stats import Stats, on_first_use


@dataclass
class PrefillStats(Stats):
    """Bumped under the stage's lock by the leader / follower loop, the RPC handlers and the KvSender."""

    submitted: int = 0  # stage 0: SUBMITs accepted
    transferred: int = 0  # this stage's KV transfers that finished
    transfer_failed: int = 0  # ... that failed
    dropped: int = 0  # requests dropped (abort, deadline, a failed step); the decode was told
    steps: int = 0  # pipeline steps this stage ran
    grants_refused: int = on_first_use()  # stage 0: SUBMITs refused for their page grant
    releases_refused: int = on_first_use()  # stage 0: RELEASED calls refused (wrong boot or grant)
    transfers_staged: int = on_first_use()  # transfers through the backend's staging buffer
    transfers_into_slot: int = on_first_use()  # transfers into a decode's staging slot


@dataclass
class HostReplayStats(Stats):
    """A stage k > 0's replays of stage 0's host-tier copies (its health's `host_replayed`)."""

    offload_pages: int = 0  # pages copied device -> host
    load_pages: int = 0  # pages copied host -> device


__all__ = ["HostReplayStats", "PrefillStats"]
