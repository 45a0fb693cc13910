"""ChildProcess: a spawned child answering (command, args) over a pipe with ("ok", value) or ("error", text).

Used by the DeepSeek-V4 prefill's pipeline stages (disagg/prefill/v4_stages.py) and the tests' peer processes
(testing/peer_process.py). Standard library only.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection
from typing import Any


class ChildProcess:
    """A spawned child answering (command, args) over a pipe with ("ok", value) or ("error", text); `label`
    names it in errors. Subclasses set conn and proc."""

    conn: Connection
    proc: Any
    label = "child"
    call_timeout = 60.0

    def _reply(self, timeout: float, what: str) -> Any:
        if not self.conn.poll(timeout):
            self.kill()
            raise TimeoutError(f"{self.label} process did not answer {what!r} within {timeout:g}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.label} process failed in {what!r}: {value}")
        return value

    def call(self, cmd: str, args: Any = None, timeout: float | None = None) -> Any:
        self.conn.send((cmd, args))
        return self._reply(self.call_timeout if timeout is None else timeout, cmd)

    @property
    def pid(self) -> int:
        assert self.proc.pid is not None
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL (after a SIGCONT, so a paused child dies too); its sockets are closed by the kernel."""
        if self.proc.is_alive():
            os.kill(self.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.join(10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout=20)
            except (TimeoutError, RuntimeError, OSError, EOFError):
                pass
        self.kill()
        self.conn.close()
