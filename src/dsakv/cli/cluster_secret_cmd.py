"""`dsakv cluster-secret PATH`: write a fresh deployment secret (64 hex digits, mode 600) for
--cluster-secret-file; copy the same file to every host of the deployment. Refuses to overwrite without --force."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dsakv.disagg.protocol.auth import write_secret


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", type=Path, help="where to write the secret (created with mode 600)")
    p.add_argument("--force", action="store_true", help="replace an existing file")


def run(args: argparse.Namespace) -> int:
    path: Path = args.path
    if path.exists() and not args.force:
        print(f"dsakv cluster-secret: error: {path} exists: pass --force to replace it", file=sys.stderr)
        return 2
    try:
        write_secret(path)
    except OSError as e:
        print(f"dsakv cluster-secret: error: {path}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"wrote a new cluster secret to {path} (mode 600): pass --cluster-secret-file {path} to every role")
    return 0
