"""Which TCP addresses a process (and its children) listens on, from /proc (no psutil): for the tests that check
a deployment binds only the host it was given."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path


def _socket_inodes(pid: int) -> set[int]:
    out: set[int] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except (FileNotFoundError, PermissionError):
        return out
    for fd in fds:
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            out.add(int(target[8:-1]))
    return out


def child_pids(pid: int) -> list[int]:
    """The pids of `pid`'s children (every thread's list; a thread that exits meanwhile is skipped)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def _addr(hex_addr: str, v6: bool) -> str:
    raw = bytes.fromhex(hex_addr)
    if not v6:
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int(hex_addr, 16)))
    words = struct.unpack("<4I", raw)  # /proc prints the address as four host-order 32-bit words
    return socket.inet_ntop(socket.AF_INET6, struct.pack(">4I", *words))


def listening_sockets(pid: int, with_children: bool = True) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that pid (and its descendants) holds."""
    pids = [pid]
    if with_children:
        i = 0
        while i < len(pids):
            pids += child_pids(pids[i])
            i += 1
    table: dict[int, tuple[str, int]] = {}
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A":  # LISTEN
                continue
            host, port = f[1].split(":")
            table[int(f[9])] = (_addr(host, v6), int(port, 16))
    out = []
    for p in pids:
        for inode in _socket_inodes(p):
            if inode in table:
                out.append((p, *table[inode]))
    return sorted(set(out))


def is_loopback(addr: str) -> bool:
    return addr in ("127.0.0.1", "::1", "::ffff:127.0.0.1") or addr.startswith("127.")
