"""Storage (L3) backends of the prefix cache: `file` (local page files) and `mooncake` (a shared Mooncake Store).
See base.py for the contract; master.py starts a local Mooncake master and store memory."""

from dsakv.cache.storage.base import (
    STORAGE_BACKENDS,
    ReadResult,
    Segments,
    StorageBackend,
    StorageConfig,
    StorageError,
    chain_hashes,
    layout_identity,
    make_storage,
    page_checksum,
)

__all__ = [
    "STORAGE_BACKENDS",
    "ReadResult",
    "Segments",
    "StorageBackend",
    "StorageConfig",
    "StorageError",
    "chain_hashes",
    "layout_identity",
    "make_storage",
    "page_checksum",
]
