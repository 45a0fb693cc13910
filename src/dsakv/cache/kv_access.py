"""Read and write token values in a DevicePool by BufferKey, through the layout's storage codecs.

    write_tokens(pool, BufferKey(6, Kind.INDEX_K), slots, k)   # k [N, index_head_dim]
    read_tokens(pool, BufferKey(6, Kind.KV), slots)            # -> float32 [N, kv_lora_rank + rope_dim]

KV values are [latent (kv_lora_rank) | rope key (qk_rope_head_dim)]; index-K values
are [index_head_dim]. A key the pool does not hold (a shared layer's INDEX_K under
elision, a layer outside the stage) raises KeyError from DevicePool.tensor, naming
layer and kind; nothing here catches it.
Imports torch and dsakv.spec / dsakv.cache; must not import model, engine or disagg.
"""

from __future__ import annotations

from typing import Protocol

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.formats import Codec, make_index_codec, make_kv_codec
from dsakv.spec.layout import BufferKey, Kind, KVLayout


def codec_for(layout: KVLayout, kind: Kind) -> Codec:
    """The codec the layout's format gives buffers of `kind`."""
    spec = layout.spec
    if kind is Kind.KV:
        return make_kv_codec(layout.kv_format, spec.kv_lora_rank, spec.qk_rope_head_dim)
    return make_index_codec(layout.index_format, spec.index_head_dim)


class TokenAccess(Protocol):
    """What a model step reads and writes token values through: PoolAccess, or a HiSparse step."""

    page_size: int

    def write(self, key: BufferKey, slots: torch.Tensor, values: torch.Tensor) -> None: ...

    def read(self, key: BufferKey, slots: torch.Tensor) -> torch.Tensor: ...


class PoolAccess:
    """Codec-aware access to one DevicePool; codecs are built once per kind.

    check_slots=False skips the per-call bounds check of the slots, for a caller that checked them once (a
    model step checks its slot table against pool.capacity_slots before its layers read and write)."""

    def __init__(self, pool: DevicePool, check_slots: bool = True) -> None:
        self.pool = pool
        self.check_slots = check_slots
        self.capacity_slots = pool.num_pages * pool.page_size
        self._plain: dict[BufferKey, torch.Tensor | None] = {}
        self.page_size = pool.page_size
        self._codecs = {Kind.KV: codec_for(pool.layout, Kind.KV)}
        if pool.layout.spec.has_indexer:
            self._codecs[Kind.INDEX_K] = codec_for(pool.layout, Kind.INDEX_K)

    def codec(self, kind: Kind) -> Codec:
        return self._codecs[kind]

    def _plain_rows(self, key: BufferKey) -> torch.Tensor | None:
        """[num_pages * page_size, dim] float32 view of a buffer stored as plain fp32 rows, else None (cached)."""
        if key in self._plain:
            return self._plain[key]
        codec = self._codecs[key.kind]
        buf = self.pool.tensor(key)  # raises KeyError for a key the pool does not hold
        rows = None
        if codec.fmt == "fp32" and len(codec.segments) == 1 and buf.shape[1] % 4 == 0:
            rows = buf.view(torch.float32).view(buf.shape[0] * self.page_size, codec.dim)
        self._plain[key] = rows
        return rows

    def rows_in_place(self, key: BufferKey) -> torch.Tensor | None:
        """key's buffer as float32 rows [num_pages * page_size, dim] to read in place (decode's native attention),
        or None unless it is stored as plain fp32 rows and the caller checks its slots (check_slots=False)."""
        return None if self.check_slots else self._plain_rows(key)

    def write(self, key: BufferKey, slots: torch.Tensor, values: torch.Tensor) -> None:
        rows = None if self.check_slots else self._plain_rows(key)
        if rows is not None and slots.device == rows.device:  # fp32 rows, slots checked by the caller: no encoding
            rows.index_copy_(0, slots, values if values.dtype == torch.float32 else values.float())
            return
        buf = self.pool.tensor(key)  # raises KeyError for a key the pool does not hold
        dev = buf.device
        if slots.device != dev or values.device != dev:
            slots, values = slots.to(dev), values.to(dev)
        self._codecs[key.kind].write(buf, slots, values, self.page_size, self.check_slots)

    def read(self, key: BufferKey, slots: torch.Tensor) -> torch.Tensor:
        rows = None if self.check_slots else self._plain_rows(key)
        if rows is not None and slots.device == rows.device:
            return rows.index_select(0, slots)
        buf = self.pool.tensor(key)
        if slots.device != buf.device:
            slots = slots.to(buf.device)
        return self._codecs[key.kind].read(buf, slots, self.page_size, self.check_slots)


def write_tokens(pool: DevicePool, key: BufferKey, slots: torch.Tensor, values: torch.Tensor) -> None:
    """Store values [N, dim] of key's kind at token slots [N] (slot = page * page_size + offset)."""
    buf = pool.tensor(key)
    codec_for(pool.layout, key.kind).write(buf, slots.to(buf.device), values.to(buf.device), pool.page_size)


def read_tokens(pool: DevicePool, key: BufferKey, slots: torch.Tensor) -> torch.Tensor:
    """Float32 [N, dim] values of key at token slots [N]."""
    buf = pool.tensor(key)
    return codec_for(pool.layout, key.kind).read(buf, slots.to(buf.device), pool.page_size)
