"""HiSparse capacity: index-K for every token on the device, the MLA KV for every token on the host.

A HiSparse decode keeps on the device (1) index-K for every token of the logical pool (the indexer scores them
all) and (2) a pool of hot KV rows, from which each request gets `device_buffer_size` rows per layer plus one
page for its newest tokens; the host holds the MLA KV of every token of the logical pool. The logical pool is
`ratio` x the device's hot-row pool (SGLang's host_to_device_ratio):

    device B/token  = kv_bytes_per_token + ratio x index_bytes_per_token      (per hot row)
    device tokens   = floor(budget / device B/token / page_size) x page_size   (hot KV rows, all requests)
    logical tokens  = floor(device tokens x ratio / page_size) x page_size     (index-K on device, KV on host)
    hot rows        = device tokens, or whole request buffers of (device_buffer_size + page_size) rows in them
    device bytes    = hot rows x kv_bytes_per_token + logical tokens x index_bytes_per_token
    host bytes      = logical tokens x kv_bytes_per_token

kv_bytes_per_token sums the MLA KV of every layer (and draft layer) of the stage; index_bytes_per_token sums
index-K over the layers that own one: every layer dense (SGLang forces this whenever HiSparse is on), the
producers only with elision. For GLM-5.2 at ratio 10 (78 x 656 KV, 132 B index-K): dense
51,168 + 10 x 78 x 132 = 154,128 B vs elided 51,168 + 10 x 21 x 132 = 78,888 B per device token; 64 GiB holds
445,824 vs 871,040 hot rows (4,458,240 vs 8,710,400 logical tokens). SGLang's pool configurator budgets the
same cell (kv + ratio x indexer, every layer) since its fix for the ratio-scaled indexer buffer.
No torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dsakv.errors import CapacityError, ConfigError
from dsakv.spec.layout import Kind, KVLayout

HISPARSE_ROLES = ("colocated", "decode")


def split_bytes_per_token(layout: KVLayout) -> tuple[int, int]:
    """(MLA KV bytes per token, index-K bytes per token) of a layout, summed over its layers."""
    kv = sum(b.bytes_per_token for b in layout.buffers if b.key.kind is Kind.KV)
    idx = sum(b.bytes_per_token for b in layout.buffers if b.key.kind is Kind.INDEX_K)
    assert kv + idx == layout.bytes_per_token
    return kv, idx


def check_ratio(ratio: float) -> float:
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1:
        raise ConfigError(
            f"--hisparse-ratio {ratio!r} must be a number >= 1: the logical pool (index-K on the device, KV on the "
            "host) is ratio x the device's hot KV rows, e.g. 10"
        )
    return float(ratio)


def check_buffer_size(size: int | None) -> int | None:
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"--hisparse-buffer {size!r} must be a positive number of rows per layer, e.g. 2048")
    return size


@dataclass(frozen=True)
class HiSparseFigures:
    """One layout's HiSparse sizing for a device budget."""

    elide: bool
    ratio: float
    page_size: int
    kv_bytes_per_token: int
    index_bytes_per_token: int
    device_tokens: int  # hot KV rows on the device, all requests together
    logical_tokens: int  # tokens whose index-K is on the device and whose KV is on the host
    buffer_size: int | None = None  # device_buffer_size (rows per layer per request), when given

    @property
    def device_bytes_per_token(self) -> int:
        """Device bytes per hot row, SGLang's accounting: kv + ratio x index-K (exact for whole-number ratios)."""
        return self.kv_bytes_per_token + int(self.ratio * self.index_bytes_per_token)

    @property
    def hot_rows(self) -> int:
        """Hot KV rows allocated: whole request buffers when device_buffer_size is given, else device tokens."""
        if self.buffer_size is None:
            return self.device_tokens
        return (
            self.device_tokens
            // hot_rows_per_request(self.buffer_size, self.page_size)
            * hot_rows_per_request(self.buffer_size, self.page_size)
        )

    @property
    def hot_bytes(self) -> int:
        return self.hot_rows * self.kv_bytes_per_token

    @property
    def index_bytes(self) -> int:
        return self.logical_tokens * self.index_bytes_per_token

    @property
    def device_bytes(self) -> int:
        return self.hot_bytes + self.index_bytes

    @property
    def host_bytes(self) -> int:
        return self.logical_tokens * self.kv_bytes_per_token

    @property
    def max_requests(self) -> int | None:
        """Requests whose hot buffers fit: each takes buffer_size rows per layer plus one page."""
        if self.buffer_size is None:
            return None
        return self.device_tokens // hot_rows_per_request(self.buffer_size, self.page_size)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "elide": self.elide,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "index_bytes_per_token": self.index_bytes_per_token,
            "device_bytes_per_token": self.device_bytes_per_token,
            "device_tokens": self.device_tokens,
            "hot_rows": self.hot_rows,
            "logical_tokens": self.logical_tokens,
            "device_bytes": self.device_bytes,
            "device_hot_bytes": self.hot_bytes,
            "device_index_bytes": self.index_bytes,
            "host_bytes": self.host_bytes,
        }
        if self.buffer_size is not None:
            out["buffer_size"] = self.buffer_size
            out["max_requests"] = self.max_requests
        return out


def hot_rows_per_request(buffer_size: int, page_size: int) -> int:
    """Rows per layer one request's device hot buffer holds: buffer_size + one page for the newest tokens."""
    return buffer_size + page_size


def hisparse_figures(
    budget_bytes: int, layout: KVLayout, ratio: float, buffer_size: int | None = None
) -> HiSparseFigures:
    """HiSparse sizing of `layout` (dense or elided as the layout says) for a device budget."""
    ratio = check_ratio(ratio)
    kv, idx = split_bytes_per_token(layout)
    page = layout.page_size
    cell = kv + ratio * idx
    pages = int(budget_bytes // cell) // page
    if pages < 1:
        raise CapacityError(
            f"a device budget of {budget_bytes} bytes holds no HiSparse page of layers {layout.describe_range()}: "
            f"one page needs {int(cell * page)} bytes ({kv} B KV + {ratio:g} x {idx} B index-K per token x page "
            f"size {page}); raise the budget or lower --hisparse-ratio"
        )
    device_tokens = pages * page
    logical = int(device_tokens * ratio) // page * page
    buffer_size = check_buffer_size(buffer_size)
    return HiSparseFigures(layout.elide, ratio, page, kv, idx, device_tokens, logical, buffer_size)
