"""HEALTH replies per role: a worker answers with its role's Health subclass, the wire map is its fields, and the
reader decodes the map as the subclass its "role" names (refusing an unknown role, a field of the other role, or
a map of the other role where one role is expected)."""

from __future__ import annotations

import pytest

from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.errors import MessageError
from dsakv.disagg.protocol.messages import DecodeHealth, Health, PrefillHealth, TransferHealth

COMMON = dict(
    ok=True, name="w", pid=1, boot="b", elide=True, backend="local", page_size=16, pages_total=4, pages_used=1,
    pages_free=3, capacity_tokens=64, integrity="ok", counters={"steps": 2},
)  # fmt: skip


def test_each_role_round_trips_as_its_own_class() -> None:
    p = PrefillHealth(role="prefill", **COMMON, jobs=2, transfer=TransferHealth(1, 0, 4096, 0.25), epoch="e")
    d = DecodeHealth(role="decode", **COMMON, vocab_size=512, max_prompt_tokens=63, running=1)
    for h in (p, d):
        got = from_wire(Health, to_wire(h))
        assert type(got) is type(h) and got == h
    assert to_wire(p)["transfer"] == {"count": 1, "failures": 0, "bytes": 4096, "seconds": 0.25}
    assert "vocab_size" not in to_wire(p) and "jobs" not in to_wire(d)  # each map holds only its role's fields
    assert from_wire(DecodeHealth, to_wire(d)) == d


def test_refusals() -> None:
    d = to_wire(DecodeHealth(role="decode", **COMMON))
    with pytest.raises(MessageError, match=r"role: got 'router'"):
        from_wire(Health, {**d, "role": "router"})
    with pytest.raises(MessageError, match=r"unknown field\(s\) \['jobs'\]"):
        from_wire(Health, {**d, "jobs": 1})
    with pytest.raises(MessageError, match="a DecodeHealth map where a PrefillHealth belongs"):
        from_wire(PrefillHealth, d)
    with pytest.raises(TypeError, match="build a PrefillHealth or a DecodeHealth"):
        Health(role="decode", **COMMON)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="role 'prefill', not 'decode'"):
        PrefillHealth(role="decode", **COMMON)  # type: ignore[arg-type]
