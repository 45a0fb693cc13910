"""HostPool: the host (CPU) tier of the KV cache, with exactly the device pool's keys.

It takes the same KVLayout object as the DevicePool and the planner, so a shared
layer's INDEX_K (elided on the device) does not exist on the host either: no
host bytes back a device buffer that does not exist.

Two physical layouts, chosen by name from HOST_LAYOUTS (one class each):

  layer_first   one uint8 tensor [num_pages, page_bytes] per key, like the device pool
  page_first    one uint8 tensor [num_pages, layout.bytes_per_page]; a page's buffers are contiguous
                (see page_copy.row_offsets), the layout a storage tier or a transfer wants:

                page 0: | L0/kv | L0/index_k | L1/kv | L1/index_k | L2/kv | L2/index_k | L3/kv | ...
                page 1: | L0/kv | L0/index_k | ...

Sizing (host_pages_for) follows dsakv.plan.capacity.host_tokens: host bytes = hicache_size, or
int(device tokens x bytes_per_token x hicache_ratio); pages = host bytes // bytes_per_page.

Copies to and from a CPU DevicePool go source to destination in one pass, page runs as memmoves
(page_copy.copy_page_set); with a GPU pool they are vectorised over pages (index_select / index_copy_ per key).
The logical index (which host pages hold what) lives in a PageAllocator, not here.
Imports torch and dsakv.spec/cache; must not import model or engine.
"""

from __future__ import annotations

from typing import ClassVar

import numpy.typing as npt
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.page_copy import (
    as_index,
    copy_page_set,
    copy_pages,
    gather_rows,
    put,
    row_offsets,
    run_start,
    scatter_rows,
    take,
)
from dsakv.errors import CapacityError, ConfigError
from dsakv.spec.layout import BufferKey, KVLayout
from dsakv.util import Registry


def host_pages_for(
    layout: KVLayout, device_pages: int, ratio: float | None = None, size: int | None = None
) -> tuple[int, int]:
    """(host budget bytes, host pages) for a host tier of `ratio` x the device pool, or of `size` bytes."""
    if (ratio is None) == (size is None):
        raise ConfigError(f"size the host tier with a ratio or a size in bytes, exactly one (got {ratio=}, {size=})")
    if size is not None:
        if size <= 0:
            raise ConfigError(f"hicache size = {size} bytes must be > 0")
        host_bytes = int(size)
    else:
        assert ratio is not None
        if ratio <= 0:
            raise ConfigError(f"hicache ratio = {ratio} must be > 0 (host pool = ratio x device pool bytes)")
        device_tokens = device_pages * layout.page_size
        host_bytes = int(device_tokens * layout.bytes_per_token * ratio)
    pages = host_bytes // layout.bytes_per_page
    if pages < 1:
        raise CapacityError(
            f"a host tier of {host_bytes} bytes cannot hold one page: a page of layers {layout.describe_range()} "
            f"needs {layout.bytes_per_page} bytes ({layout.bytes_per_token} B/token x page size {layout.page_size}); "
            "raise hicache_size / hicache_ratio"
        )
    return host_bytes, int(pages)


class HostPool:
    """Base class. `view(key)` is a [num_pages, page_bytes] uint8 tensor (possibly strided) for every key."""

    name: ClassVar[str] = ""

    def __init__(self, layout: KVLayout, num_pages: int, pin_memory: bool = False) -> None:
        if num_pages < 1:
            raise CapacityError(f"a host pool needs at least one page, got num_pages={num_pages}")
        self.layout = layout
        self.num_pages = num_pages
        self.pin_memory = pin_memory and torch.cuda.is_available()

    def _empty(self, *shape: int) -> torch.Tensor:
        return torch.empty(shape, dtype=torch.uint8, device="cpu", pin_memory=self.pin_memory)

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def keys(self) -> tuple[BufferKey, ...]:
        return self.layout.keys

    def has(self, key: BufferKey) -> bool:
        return key in self.layout.by_key

    def view(self, key: BufferKey) -> torch.Tensor:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        raise NotImplementedError

    # ---- copies; each returns the bytes moved -------------------------------------

    def offload(self, device: DevicePool, dev_ids: npt.ArrayLike, host_ids: npt.ArrayLike) -> int:
        """Copy device pages `dev_ids` into host pages `host_ids` (same length), every key."""
        raise NotImplementedError

    def load(self, device: DevicePool, host_ids: npt.ArrayLike, dev_ids: npt.ArrayLike) -> int:
        """Copy host pages `host_ids` into device pages `dev_ids` (same length), every key."""
        raise NotImplementedError

    def read_rows(self, host_ids: npt.ArrayLike) -> torch.Tensor:
        """Host pages as page rows, uint8 [len(host_ids), bytes_per_page] (see page_copy)."""
        raise NotImplementedError

    def write_rows(self, host_ids: npt.ArrayLike, rows: torch.Tensor) -> None:
        """Write page rows [len(host_ids), bytes_per_page] into host pages `host_ids`."""
        raise NotImplementedError

    def check_compatible(self, device: DevicePool) -> None:
        """Raise ConfigError unless the host pool has exactly the device pool's keys and page sizes."""
        dk, hk = set(device.keys), set(self.keys)
        for key in sorted(dk ^ hk):
            side = "device" if key in dk else "host"
            raise ConfigError(f"buffer {key} exists only in the {side} pool: build both pools from one KVLayout")
        for key in device.keys:
            d, h = device.layout.buffer(key).page_bytes, self.layout.buffer(key).page_bytes
            if d != h:
                raise ConfigError(f"buffer {key}: device page is {d} bytes but host page is {h} bytes")

    def _pair(self, a: npt.ArrayLike, b: npt.ArrayLike, what: str) -> tuple[torch.Tensor, torch.Tensor]:
        ia, ib = as_index(a), as_index(b)
        if ia.numel() != ib.numel():
            raise ValueError(f"{what}: {ia.numel()} source pages but {ib.numel()} destination pages")
        return ia, ib


class LayerFirstHostPool(HostPool):
    """One host tensor per key, [num_pages, page_bytes], like the device pool."""

    name = "layer_first"

    def __init__(self, layout: KVLayout, num_pages: int, pin_memory: bool = False) -> None:
        super().__init__(layout, num_pages, pin_memory)
        self._tensors = {b.key: self._empty(num_pages, b.page_bytes) for b in layout.buffers}

    def view(self, key: BufferKey) -> torch.Tensor:
        try:
            return self._tensors[key]
        except KeyError:
            raise KeyError(self.layout.missing_key_message(key)) from None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self._tensors.values())

    def offload(self, device: DevicePool, dev_ids: npt.ArrayLike, host_ids: npt.ArrayLike) -> int:
        src, dst = self._pair(dev_ids, host_ids, "offload")
        if device.device.type == "cpu":  # one pass, page runs as memmoves (page_copy.copy_page_set)
            copy_page_set([(t, device.tensor(key)) for key, t in self._tensors.items()], dst, src)
        else:
            for key, t in self._tensors.items():
                copy_pages(t, dst, device.tensor(key), src)
        return int(dst.numel()) * self.layout.bytes_per_page

    def load(self, device: DevicePool, host_ids: npt.ArrayLike, dev_ids: npt.ArrayLike) -> int:
        src, dst = self._pair(host_ids, dev_ids, "load")
        if device.device.type == "cpu":
            copy_page_set([(device.tensor(key), t) for key, t in self._tensors.items()], dst, src)
        else:
            for key, t in self._tensors.items():
                copy_pages(device.tensor(key), dst, t, src)
        return int(dst.numel()) * self.layout.bytes_per_page

    def read_rows(self, host_ids: npt.ArrayLike) -> torch.Tensor:
        idx = as_index(host_ids)
        rows = torch.empty((idx.numel(), self.layout.bytes_per_page), dtype=torch.uint8)
        for key, (off, nbytes) in row_offsets(self.layout).items():
            rows[:, off : off + nbytes] = take(self._tensors[key], idx)
        return rows

    def write_rows(self, host_ids: npt.ArrayLike, rows: torch.Tensor) -> None:
        idx = as_index(host_ids)
        rows = rows.to("cpu")
        for key, (off, nbytes) in row_offsets(self.layout).items():
            put(self._tensors[key], idx, rows[:, off : off + nbytes])


class PageFirstHostPool(HostPool):
    """One host tensor [num_pages, bytes_per_page]; `view(key)` is a strided column slice of it."""

    name = "page_first"

    def __init__(self, layout: KVLayout, num_pages: int, pin_memory: bool = False) -> None:
        super().__init__(layout, num_pages, pin_memory)
        self.buffer = self._empty(num_pages, layout.bytes_per_page)

    def view(self, key: BufferKey) -> torch.Tensor:
        offsets = row_offsets(self.layout)
        if key not in offsets:
            raise KeyError(self.layout.missing_key_message(key))
        off, nbytes = offsets[key]
        return self.buffer[:, off : off + nbytes]

    def offset(self, key: BufferKey) -> int:
        """Byte offset of `key` inside a page row."""
        return row_offsets(self.layout)[key][0]

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    # A GPU gathers whole page rows on the device and moves them in one copy; a CPU "device" copies each key
    # straight into / out of its column slice (no staging copy).

    def offload(self, device: DevicePool, dev_ids: npt.ArrayLike, host_ids: npt.ArrayLike) -> int:
        src, dst = self._pair(dev_ids, host_ids, "offload")
        if device.device.type == "cpu":  # one pass per page and buffer, straight into the column slices
            copy_page_set([(self.view(key), device.tensor(key)) for key in self.keys], dst, src)
        else:
            copy_pages(self.buffer, dst, gather_rows(device, src), torch.arange(src.numel()))
        return int(dst.numel()) * self.layout.bytes_per_page

    def load(self, device: DevicePool, host_ids: npt.ArrayLike, dev_ids: npt.ArrayLike) -> int:
        src, dst = self._pair(host_ids, dev_ids, "load")
        if device.device.type == "cpu":
            copy_page_set([(device.tensor(key), self.view(key)) for key in self.keys], dst, src)
        else:
            s0 = run_start(src)
            rows = self.buffer[s0 : s0 + src.numel()] if s0 is not None else take(self.buffer, src)
            scatter_rows(device, dst, rows.to(device.device))
        return int(dst.numel()) * self.layout.bytes_per_page

    def read_rows(self, host_ids: npt.ArrayLike) -> torch.Tensor:
        return take(self.buffer, as_index(host_ids))

    def write_rows(self, host_ids: npt.ArrayLike, rows: torch.Tensor) -> None:
        put(self.buffer, as_index(host_ids), rows.to("cpu"))


HOST_LAYOUTS: Registry[type[HostPool]] = Registry(
    "host layout", flag="--hicache-layout", unknown="host layout {name!r} is unknown: use one of {choices}"
)
for _cls in (LayerFirstHostPool, PageFirstHostPool):
    HOST_LAYOUTS.add(_cls.name, _cls)


def make_host_pool(layout_name: str, layout: KVLayout, num_pages: int, pin_memory: bool = False) -> HostPool:
    """A host pool of `num_pages` pages in the named physical layout."""
    return HOST_LAYOUTS.get(layout_name)(layout, num_pages, pin_memory)
