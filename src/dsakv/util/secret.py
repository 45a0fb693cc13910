"""The deployment's secret file: one per deployment (`dsakv cluster-secret PATH`), read by every role.

    secret = load_secret(path)      # >= 16 bytes, a regular file not readable by group/other; ValueError otherwise

It keys the control plane (disagg/auth.py) and the shared storage tier's page MACs (cache/storage/base.py).
$DSAKV_CLUSTER_SECRET_FILE names it where no flag does. Standard library only.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

SECRET_ENV = "DSAKV_CLUSTER_SECRET_FILE"
MIN_SECRET = 16


def new_secret() -> str:
    """A fresh secret (64 hex digits) for a secret file."""
    return os.urandom(32).hex()


def write_secret(path: Path, secret: str | None = None) -> Path:
    """Write a secret file readable by its owner only (created 0600, never world-readable in between)."""
    path = Path(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write((secret or new_secret()) + "\n")
    os.chmod(path, 0o600)
    return path


def load_secret(path: str | Path) -> bytes:
    """The secret in `path` (surrounding whitespace stripped); ValueError naming the file and the fix."""
    p = Path(path)
    fix = (
        f"create one with: dsakv cluster-secret {p}  "
        f"(or: python3 -c 'import secrets; print(secrets.token_hex(32))' > {p}; chmod 600 {p})"
    )
    try:
        st = p.stat()
    except OSError as e:
        raise ValueError(f"cluster secret file {p}: {e.strerror or e}; {fix}") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"cluster secret file {p} is not a regular file; {fix}")
    if st.st_mode & 0o077:
        raise ValueError(
            f"cluster secret file {p} is readable by group or others (mode {stat.S_IMODE(st.st_mode):o}): chmod 600 {p}"
        )
    data = p.read_bytes().strip()
    if len(data) < MIN_SECRET:
        raise ValueError(f"cluster secret file {p} holds {len(data)} bytes, at least {MIN_SECRET} needed; {fix}")
    return data


__all__ = ["MIN_SECRET", "SECRET_ENV", "load_secret", "new_secret", "write_secret"]
