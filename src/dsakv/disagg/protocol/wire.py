"""Plain-data forms of what the control-plane RPC carries (msgpack-friendly dicts and lists).

SamplingParams travel as dicts; page ids as lists of ints; a torch.Generator state as bytes.
Imports dsakv.engine.request (standard library only there) and numpy; never torch.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict
from typing import Any

import numpy as np
import numpy.typing as npt

from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError

IntArray = npt.NDArray[np.int64]


def params_to_dict(p: SamplingParams) -> dict[str, Any]:
    d = asdict(p)
    d["stop_token_ids"] = list(p.stop_token_ids)
    return d


def params_from_dict(d: Any) -> SamplingParams:
    if not isinstance(d, dict):
        raise ConfigError(f"sampling params must be a map, got {type(d).__name__}")
    known = set(SamplingParams.__dataclass_fields__)
    extra = sorted(set(d) - known)
    if extra:
        raise ConfigError(f"unknown sampling parameter(s) {extra}: this dsakv knows {sorted(known)}")
    d = dict(d)
    if "stop_token_ids" in d:
        d["stop_token_ids"] = tuple(d["stop_token_ids"])
    return SamplingParams(**d)


def page_list(ids: Any) -> list[int]:
    return [int(i) for i in np.asarray(ids, dtype=np.int64).tolist()]


def page_array(ids: Any) -> IntArray:
    return np.asarray(list(ids), dtype=np.int64)


def new_boot_id() -> str:
    """A fresh id for one process lifetime: peers compare it to notice a restart."""
    return uuid.uuid4().hex[:12]
