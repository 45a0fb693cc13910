"""DiskTier: the `file` storage backend (cache/storage/file.py) under its historical name and constructor.

    DiskTier(root, layout, model_hash=None, max_bytes=None) == FileStore(layout, model_hash,
                                                                StorageConfig(backend="file", dir=root, max_bytes=...))
Imports dsakv.cache.storage only.
"""

from __future__ import annotations

from pathlib import Path

from dsakv.cache.storage.base import META_MAGIC as MAGIC
from dsakv.cache.storage.base import layout_identity
from dsakv.cache.storage.file import FileStore
from dsakv.config import StorageConfig
from dsakv.spec.layout import KVLayout


class DiskTier(FileStore):
    def __init__(
        self, root: str | Path, layout: KVLayout, model_hash: str | None = None, max_bytes: int | None = None
    ) -> None:
        super().__init__(layout, model_hash, StorageConfig(backend="file", dir=str(root), max_bytes=max_bytes))


__all__ = ["MAGIC", "DiskTier", "FileStore", "layout_identity"]
