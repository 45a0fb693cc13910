"""V4Pool: the physical DeepSeek-V4 cache, one uint8 tensor per key of a V4Layout.

Contract:
- paged kinds (CSA_KV, CSA_INDEX_K, HCA_KV): `paged(key)` is [num_pages, page_bytes]; entry e of a request
  (covering tokens [e x ratio, (e + 1) x ratio)) lives on its page (e x ratio) // page_size at row
  (e x ratio % page_size) // ratio, so no entry straddles a page.
- state kinds (WINDOW, CSA_STATE, CSA_INDEX_STATE, HCA_STATE): `state(key)` is [num_slots, slot_bytes], one
  slot per running request (SlotAllocator below hands them out).
- Any key the layout does not hold raises KeyError naming layer, kind and what that layer reads.
- Allocated bytes == layout.pool_bytes(num_pages, num_slots), exactly the planner's figure for the same layout.
Imports torch; must not import model, engine or disagg.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import torch

from dsakv.cache.device_pool import Region
from dsakv.errors import CapacityError
from dsakv.spec.layout import BufferKey
from dsakv.spec.v4_layout import PagedSpec, StateSpec, V4Layout


class SlotAllocator:
    """Request-state slots 0..n-1: alloc() the lowest free one, free(slot) gives it back."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise CapacityError(f"all {self.num_slots} request-state slots are in use: raise --max-running-requests")
        self._free.sort()
        return self._free.pop(0)

    def free(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not an allocated request-state slot (0..{self.num_slots - 1})")
        self._free.append(slot)


class V4Pool:
    def __init__(self, layout: V4Layout, num_pages: int, num_slots: int, device: str | torch.device = "cpu") -> None:
        if num_pages < 1 or num_slots < 1:
            raise CapacityError(f"a V4 pool needs >= 1 page and >= 1 request slot, got {num_pages} / {num_slots}")
        self.layout = layout
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.device = torch.device(device)
        self._paged = {
            b.key: torch.zeros((num_pages, b.page_bytes), dtype=torch.uint8, device=self.device) for b in layout.paged
        }
        self._state = {
            s.key: torch.zeros((num_slots, s.slot_bytes), dtype=torch.uint8, device=self.device) for s in layout.states
        }

    @property
    def page_size(self) -> int:
        return self.layout.page

    def has(self, key: BufferKey) -> bool:
        return key in self._paged or key in self._state

    def paged(self, key: BufferKey) -> torch.Tensor:
        try:
            return self._paged[key]
        except KeyError:
            raise KeyError(self.layout.missing_key_message(key)) from None

    def state(self, key: BufferKey) -> torch.Tensor:
        try:
            return self._state[key]
        except KeyError:
            raise KeyError(self.layout.missing_key_message(key)) from None

    def entries(self, key: BufferKey, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A paged key as [num_pages x entries_per_page, entry elements] of `dtype` (a view)."""
        spec = self.layout.buffer(key)
        assert isinstance(spec, PagedSpec)
        return self.paged(key).view(dtype).view(self.num_pages * spec.entries_per_page, -1)

    def rows(self, key: BufferKey, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A state key as [num_slots, rows, row elements] of `dtype` (a view)."""
        spec = self.layout.buffer(key)
        assert isinstance(spec, StateSpec)
        return self.state(key).view(dtype).view(self.num_slots, spec.rows, -1)

    def regions(self) -> dict[BufferKey, Region]:
        """Every buffer as a contiguous region for a transfer backend: paged keys [num_pages x page_bytes],
        state keys [num_slots x slot_bytes] (a slot is a state key's "page"), in layout key order."""
        out = {k: Region(t.data_ptr(), int(t.shape[1]), int(t.shape[0])) for k, t in self._paged.items()}
        out.update({k: Region(t.data_ptr(), int(t.shape[1]), int(t.shape[0])) for k, t in self._state.items()})
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in (*self._paged.values(), *self._state.values()))

    def nbytes_of(self, key: BufferKey) -> int:
        t = self._paged[key] if key in self._paged else self.state(key)
        return int(t.numel())

    def digests(self, pages: Iterable[int], slot: int, keys: Sequence[BufferKey] | None = None) -> dict[str, str]:
        """blake2b of each key's bytes (every key of the layout by default): pages `pages` in that order of a
        paged key, slot `slot` of a state key. What a transfer's two ends compare."""
        idx = torch.as_tensor([int(p) for p in pages], dtype=torch.int64, device=self.device)
        out = {}
        for key in self.layout.keys if keys is None else keys:
            t = self._paged[key].index_select(0, idx) if key in self._paged else self.state(key)[slot]
            out[str(key)] = hashlib.blake2b(t.contiguous().cpu().numpy().tobytes(), digest_size=16).hexdigest()
        return out
