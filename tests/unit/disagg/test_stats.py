"""Typed counters (dsakv.util.stats): bumped as attributes, shown by their field names; an on_first_use counter
only once counted. The role counter sets show the names their health / metrics always showed."""

from __future__ import annotations

from dataclasses import dataclass

from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.prefill.stats import PrefillStats
from dsakv.disagg.router.requests import RouterStats
from dsakv.util.stats import Stats, on_first_use


@dataclass
class _Demo(Stats):
    steps: int = 0
    refused: int = on_first_use()


def test_as_dict_names_and_first_use() -> None:
    s = _Demo()
    assert s.as_dict() == {"steps": 0}
    s.steps += 2
    s.refused += 1
    assert s.as_dict() == {"steps": 2, "refused": 1}


def test_role_counter_names() -> None:
    assert list(PrefillStats().as_dict()) == ["submitted", "transferred", "transfer_failed", "dropped", "steps"]
    names = ["prealloc", "busy", "started", "kv_failed", "finished", "tokens", "kv_bytes", "reports_refused"]
    assert list(DecodeStats().as_dict()) == [*names, "staged_in", "staging_no_slot"]
    assert list(RouterStats().as_dict()) == [
        "requests_total", "finished_total", "failed_total", "aborted_total", "retries_total", "tokens_total",
        "routed_affinity_total", "routed_load_total", "routed_matched_pages_total", "dispatch_errors_total",
        "event_errors_total",
    ]  # fmt: skip
    p = PrefillStats(grants_refused=1, transfers_staged=2)
    assert (p.as_dict()["grants_refused"], p.as_dict()["transfers_staged"]) == (1, 2)
    assert "releases_refused" not in p.as_dict() and "revoked" not in DecodeStats().as_dict()
