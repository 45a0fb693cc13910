"""The weights fingerprint: 16 hex chars that change whenever any byte of any weight changes.

Stored pages (disk tier, Mooncake Store) are keyed by it, so KV computed by other weights is never loaded.
It covers every byte of every tensor, not a sample:

  from a checkpoint directory   sha256 over the full contents of each *.safetensors file, in name order;
                                computed once per file identity (resolved path, size, mtime_ns) and cached
                                in-process and in $DSAKV_CACHE_DIR/fingerprints.json (default
                                ~/.cache/dsakv), so a restart of a 1 TB checkpoint does not re-read it
  from an in-memory model       sha256 over each state_dict tensor's name, shape, dtype and all its bytes

and the compute dtype of the loaded model (the same files run in bf16 give other KV).
Imports torch lazily; must not import model or engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_memo: dict[tuple[str, int, int], str] = {}
_CHUNK = 16 << 20


def cache_file() -> Path:
    root = os.environ.get("DSAKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsakv")
    return Path(root) / "fingerprints.json"


def _load_disk_cache() -> dict[str, str]:
    try:
        data = json.loads(cache_file().read_text())
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_disk_cache(entries: dict[str, str]) -> None:
    p = cache_file()
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries, sort_keys=True))
        os.replace(tmp, p)
    except OSError as e:  # a read-only home: the in-process cache still works
        log.debug("cannot write %s: %s", p, e)


def file_digest(path: str | Path) -> str:
    """sha256 of a file's full contents, cached by (resolved path, size, mtime_ns)."""
    p = Path(path).resolve()
    st = p.stat()
    ident = (str(p), st.st_size, st.st_mtime_ns)
    key = f"{ident[0]}|{ident[1]}|{ident[2]}"
    with _lock:
        if ident in _memo:
            return _memo[ident]
        disk = _load_disk_cache()
        if key in disk:
            _memo[ident] = disk[key]
            return disk[key]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    digest = h.hexdigest()
    log.info("weights fingerprint: hashed %s (%d B)", p, st.st_size)
    with _lock:
        _memo[ident] = digest
        disk = _load_disk_cache()
        disk = {k: v for k, v in disk.items() if not k.startswith(f"{ident[0]}|")}  # drop stale identities
        disk[key] = digest
        _save_disk_cache(disk)
    return digest


def tensors_digest(model: Any) -> str:
    """sha256 over every state_dict tensor in full (name, shape, dtype, bytes)."""
    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def weights_fingerprint(model: Any, model_dir: str | Path | None = None) -> str:
    """16 hex chars naming `model`'s weights (from its checkpoint files when `model_dir` is given)."""
    import torch

    dtype = next((str(p.dtype) for p in model.parameters()), "none") if isinstance(model, torch.nn.Module) else ""
    h = hashlib.sha256(f"dtype={dtype}".encode())
    files = sorted(Path(model_dir).glob("*.safetensors")) if model_dir is not None else []
    if files:
        for f in files:
            h.update(f"{f.name}:{file_digest(f)}".encode())
    else:
        h.update(tensors_digest(model).encode())
    return h.hexdigest()[:16]
