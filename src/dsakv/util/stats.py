"""Typed counters: a dataclass of int fields, each bumped as an attribute (`stats.steps += 1`, under the owner's
lock) and shown by its field name (`as_dict()`: a worker's health counters, the router's /metrics).

    @dataclass
    class MyStats(Stats):
        steps: int = 0
        refused: int = on_first_use()   # left out of as_dict() until it is first counted

    stats = MyStats(); stats.steps += 1; stats.as_dict() == {"steps": 1}
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_FIRST_USE = "dsakv.stats.first_use"


def on_first_use() -> Any:
    """A counter that as_dict() shows only once it is non-zero (one that appears when the event first happens)."""
    return dataclasses.field(default=0, metadata={_FIRST_USE: True})


@dataclass
class Stats:
    """Base of the typed counter sets (every field an int counter)."""

    def as_dict(self) -> dict[str, int]:
        """name -> value of every counter (the on_first_use ones only once counted), in field order."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v or not f.metadata.get(_FIRST_USE):
                out[f.name] = int(v)
        return out


__all__ = ["Stats", "on_first_use"]
