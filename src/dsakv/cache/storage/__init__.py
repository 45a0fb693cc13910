"""Storage (L3) backends of the prefix cache: `file` (local page files) and `mooncake` (a shared Mooncake Store).
See base.py for the contract; master.py starts a local Mooncake master and store memory."""

from dsakv.cache.storage.base import (
    STORAGE_BACKENDS,
    PageLayout,
    ReadResult,
    Segments,
    StorageBackend,
    StorageError,
    chain_hashes,
    layout_identity,
    page_checksum,
)
from dsakv.config import StorageConfig


def make_storage(layout: PageLayout, model_hash: str | None, config: StorageConfig) -> StorageBackend:
    """The configured backend (imports the backend modules, which register themselves, on first use; here and not
    in base.py, which they import)."""
    import dsakv.cache.storage.file  # noqa: F401
    import dsakv.cache.storage.mooncake  # noqa: F401

    return STORAGE_BACKENDS.get(config.backend)(layout, model_hash, config)


__all__ = [
    "STORAGE_BACKENDS",
    "PageLayout",
    "ReadResult",
    "Segments",
    "StorageBackend",
    "StorageError",
    "chain_hashes",
    "layout_identity",
    "make_storage",
    "page_checksum",
]
