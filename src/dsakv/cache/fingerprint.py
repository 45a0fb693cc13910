"""The weights fingerprint: 16 hex chars that change whenever any byte of any weight changes.

Stored pages (disk tier, Mooncake Store) are keyed by it, so KV computed by other weights is never loaded.
It is a sha256 over every state_dict tensor of the loaded model in full (name, shape, dtype, all its bytes,
not a sample), so the same weights give the same fingerprint however they were loaded, and the same files
loaded in another dtype (other KV) give another.

Computed once per checkpoint: with the model's directory, the value is cached by the identity of its
*.safetensors files and the dtype, in-process and in $DSAKV_CACHE_DIR/fingerprints.json (default ~/.cache/dsakv),
so a restarted server does not re-hash. A rank's shard of a tensor- or expert-parallel model (SHARD on the model:
kind, rank, size) is cached under its own key: each shard gets the fingerprint of its own tensors; so is a model the
loader quantised (VARIANT: --weight-dtype int8 / fp8), whose weights are not the files' own.
The identity is everything that changes when a file's content can have:
resolved path, device, inode, size, mtime_ns and ctime_ns of each file (ctime moves on every write and on every
utime, so a rewrite that restores size and mtime is still a new identity; mtime alone is never trusted). The
loader records the identity it read (`LOADED_IDENTITY` on the model, taken before and checked after the read):
a checkpoint changed since, or while, it was loaded is hashed from memory and not cached. Imports torch lazily;
must not import model or engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_lock = threading.Lock()
_memo: dict[str, str] = {}


def cache_file() -> Path:
    root = os.environ.get("DSAKV_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "dsakv")
    return Path(root) / "fingerprints.json"


def _load_disk_cache() -> dict[str, str]:
    try:
        data = json.loads(cache_file().read_text())
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _save_disk_cache(key: str, value: str) -> None:
    p = cache_file()
    try:
        entries = _load_disk_cache()
        entries[key] = value
        if len(entries) > 256:  # keep the newest entries only
            entries = dict(list(entries.items())[-256:])
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(entries))
        os.replace(tmp, p)
    except OSError as e:  # a read-only home: the in-process cache still works
        log.debug("cannot write %s: %s", p, e)


LOADED_IDENTITY = "dsakv_checkpoint_identity"  # the model attribute the loader sets (file_identity as read)
SHARD = "dsakv_shard"  # the model attribute of a rank's shard (model/parallel.py): "tp 1/2", "ep 0/2"; "" whole
# the model attribute naming how the loader changed the weights it read ("int8", "fp8": quantised; "" as read): the
# same files quantised are other weights (other KV), so the cache key carries it
VARIANT = "dsakv_weights_variant"


def file_identity(model_dir: str | Path) -> str:
    """(resolved path, device, inode, size, mtime_ns, ctime_ns) of each *.safetensors file of a checkpoint, as
    one string ('' if none)."""
    parts = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        st = f.stat()
        parts.append(f"{f.resolve()}|{st.st_dev}:{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}")
    return ";".join(parts)


def tensors_digest(model: Any) -> str:
    """sha256 over every state_dict tensor in full (name, shape, dtype, bytes)."""
    import torch

    h = hashlib.sha256()
    for name, t in model.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        if t.numel():
            h.update(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return h.hexdigest()


def weights_fingerprint(model: Any, model_dir: str | Path | None = None) -> str:
    """16 hex chars naming `model`'s weights; cached by checkpoint file identity when `model_dir` is given (and,
    for a model the loader read, the files are still the ones it read)."""
    ident = file_identity(model_dir) if model_dir is not None else ""
    loaded = getattr(model, LOADED_IDENTITY, None)
    if ident and loaded is not None and loaded != ident:
        log.info("checkpoint %s changed since it was loaded: weights fingerprint hashed, not cached", model_dir)
        ident = ""
    key = ""
    if ident:
        params = list(model.parameters()) if hasattr(model, "parameters") else []
        shard = getattr(model, SHARD, "")  # a shard's tensors are not the whole model's: its own entry
        variant = getattr(model, VARIANT, "")  # quantised on load: not the files' weights
        key = f"{params[0].dtype if params else ''}|{ident}" + (f"|{shard}" if shard else "")
        key += f"|{variant}" if variant else ""
        with _lock:
            if key in _memo:
                return _memo[key]
        cached = _load_disk_cache().get(key)
        if cached:
            with _lock:
                _memo[key] = cached
            return cached
    t0 = time.perf_counter()
    value = tensors_digest(model)[:16]
    log.info("weights fingerprint %s (every tensor hashed in %.2f s)", value, time.perf_counter() - t0)
    if key and model_dir is not None and file_identity(model_dir) != ident:  # rewritten while hashed
        key = ""
    if key:
        with _lock:
            _memo[key] = value
        _save_disk_cache(key, value)
    return value
