"""Stage 0's rendezvous store and its listening fd: closed exactly once.

torch's TCPStore server owns the listening fd it is handed and closes it when it goes. Handing it our socket's own
fd and keeping the socket closed that number twice: the second close (the socket's finaliser) hit whatever had
reused the number meanwhile (ciJ: another test's HTTP client socket, EBADF; ciE/ciK: libuv abort() in the
colocated pipeline test)."""

from __future__ import annotations

import gc
import os
import time

from dsakv.pipeline.stage_comm import StageGroup
from dsakv.util.procs import free_ports


def _sockets() -> set[int]:
    """This process's open socket fds (libuv keeps a few pipes of its own for good: not counted)."""
    out = set()
    for f in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{f}").startswith("socket:"):
                out.add(int(f))
        except OSError:  # the listing's own fd, or one closed meanwhile
            pass
    return out


def test_store_fd_closed_once_and_a_reused_number_survives() -> None:
    before = _sockets()
    g = StageGroup(0, 2, "127.0.0.1", free_ports(), timeout_s=5.0)
    assert g._store is not None
    g._store.set("probe", "1")
    assert _sockets() - before, "stage 0's store holds no socket"
    g._store = None  # the server goes: it closes its listening fd (and its own client connection)
    gc.collect()
    deadline = time.monotonic() + 10.0
    while _sockets() - before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not (_sockets() - before), f"sockets {sorted(_sockets() - before)} of the dropped store still open"
    r, w = os.pipe()  # the lowest free numbers: the store's old ones
    try:
        del g  # nothing of the group may close an fd now
        gc.collect()
        os.write(w, b"x")
        assert os.read(r, 1) == b"x"
        assert os.fstat(r) and os.fstat(w)
    finally:
        os.close(r)
        os.close(w)
