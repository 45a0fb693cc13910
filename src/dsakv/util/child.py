"""ChildProcess: a spawned child answering (command, args) over a pipe with ("ok", value) or ("error", text);
`answer` is the child's side of it.

    parent: ChildProcess.call(cmd, args)  ── pipe ──►  child: answer(conn, {cmd: fn}, on_stop)
            value (or RuntimeError naming   ◄────────         ("ok", fn(args)) / ("error", "Type: text");
            the child and its error)                          "stop": on_stop(), ("ok", None), return

Used by the DeepSeek-V4 prefill's pipeline stages (disagg/prefill/v4_stages.py) and the tests' peer processes
(testing/peer_process.py, testing/v4_pd.py). Standard library only.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from typing import Any


def answer(
    conn: Connection, handlers: Mapping[str, Callable[[Any], Any]], on_stop: Callable[[], None] | None = None
) -> None:
    """Answer each (cmd, args) from `conn` with ("ok", handlers[cmd](args)), or ("error", "Type: text") when it
    raises or `cmd` is unknown, until the pipe closes or "stop" arrives (then on_stop() and ("ok", None))."""
    while True:
        try:
            cmd, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if cmd == "stop":
                if on_stop is not None:
                    on_stop()
                conn.send(("ok", None))
                return
            fn = handlers.get(cmd)
            if fn is None:
                raise ValueError(f"unknown command {cmd!r} (this child answers {sorted(handlers)} and 'stop')")
            conn.send(("ok", fn(args)))
        except Exception as e:
            conn.send(("error", f"{type(e).__name__}: {e}"))
            if cmd == "stop":
                return


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
