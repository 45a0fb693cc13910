"""What every pipeline (prefill or decode) shares about its stages: how a step's batch travels between stages
(encode_batch / decode_batch). The layer range of each stage is dsakv.config.parallel.split_layers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dsakv.model.batch import ForwardBatch


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
