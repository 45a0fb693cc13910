"""What every pipeline (prefill or decode) shares about its stages: the layer range of each stage (split_layers)
and how a step's batch travels between stages (encode_batch / decode_batch).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsakv.errors import ConfigError
from dsakv.model.batch import ForwardBatch
from dsakv.plan.capacity import even_partition


def split_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage: `partition` (layers per stage) or an even split, earlier stages larger."""
    if pp_size < 1:
        raise ConfigError(f"--pp-size {pp_size} must be >= 1")
    if partition is None:
        partition = even_partition(num_layers, pp_size)
    if len(partition) != pp_size:
        raise ConfigError(f"--pp-partition {list(partition)} has {len(partition)} stages but --pp-size is {pp_size}")
    if any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ConfigError(
            f"--pp-partition {','.join(map(str, partition))} must give every stage >= 1 layer and sum to the "
            f"model's {num_layers} layers (sums to {sum(partition)})"
        )
    out, start = [], 0
    for n in partition:
        out.append((start, start + n))
        start += n
    return out


def encode_batch(b: ForwardBatch) -> dict[str, Any]:
    def arr(t: torch.Tensor) -> list[Any]:
        a = t.to(torch.int64).contiguous().numpy()
        return [list(a.shape), a.tobytes()]

    return {
        k: arr(getattr(b, k))
        for k in ("input_ids", "positions", "prefix_lens", "extend_lens", "slot_table", "out_slots")
    }


def decode_batch(d: dict[str, Any]) -> ForwardBatch:
    def t(v: list[Any]) -> torch.Tensor:
        shape, raw = v
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int64).reshape(shape).copy())

    return ForwardBatch(**{k: t(v) for k, v in d.items()})
