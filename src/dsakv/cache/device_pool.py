"""DevicePool: the physical KV storage, one uint8 tensor per BufferSpec of a layout.

Contract:
- `tensor(key)` is a [num_pages, page_bytes] uint8 tensor for every key the
  layout holds; any other key raises KeyError naming the layer and kind (a
  shared layer's INDEX_K under elision does not exist, so it can never be
  read or written by mistake).
- Allocated bytes == layout.bytes_per_page x num_pages, exactly the planner's
  bytes_per_token x tokens for the same layout object.
- `regions()` gives the (address, page_bytes, num_pages) of each buffer, for
  registration with a transfer engine.
The logical index (which pages belong to whom) lives in PageAllocator, not here.
Imports torch; must not import model, engine or disagg.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dsakv.errors import CapacityError
from dsakv.spec.layout import BufferKey, KVLayout
from dsakv.util import ceil_div


@dataclass(frozen=True)
class Region:
    """One registered memory region: a buffer's pages, contiguous."""

    addr: int
    page_bytes: int
    num_pages: int

    @property
    def nbytes(self) -> int:
        return self.page_bytes * self.num_pages


class DevicePool:
    def __init__(self, layout: KVLayout, num_pages: int, device: str | torch.device = "cpu") -> None:
        if num_pages < 1:
            raise CapacityError(f"a device pool needs at least one page, got num_pages={num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.unchecked_access: Any = None  # the model's codec access to this pool (DSAModel.check_pool)
        self._tensors: dict[BufferKey, torch.Tensor] = {
            b.key: torch.zeros((num_pages, b.page_bytes), dtype=torch.uint8, device=self.device) for b in layout.buffers
        }

    @classmethod
    def for_tokens(cls, layout: KVLayout, max_tokens: int, device: str | torch.device = "cpu") -> DevicePool:
        return cls(layout, ceil_div(max_tokens, layout.page_size), device)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return self.layout.keys

    def has(self, key: BufferKey) -> bool:
        return key in self._tensors

    def tensor(self, key: BufferKey) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(self.layout.missing_key_message(key)) from None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    def regions(self) -> dict[BufferKey, Region]:
        return {k: Region(int(t.data_ptr()), int(t.shape[1]), int(t.shape[0])) for k, t in self._tensors.items()}
