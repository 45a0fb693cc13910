"""Run an ASGI app (dsakv.serve.app.create_app) with uvicorn until interrupted; shared by every serving role.

Stop signals: uvicorn handles SIGTERM / Ctrl-C with a graceful shutdown and then raises the signal again at once,
inside `Server.run`, so the default action ends the process before the caller's own shutdown runs (a TP rank 0
never told its follower ranks to stop: they saw the group's connection close). Here the signal is held instead:
`run_http` returns, the caller stops what it started, and `reraise_stop_signals` (the CLI's last step) raises a
SIGTERM again, so the exit status is still the signal's (-15), as uvicorn's is; a Ctrl-C stop exits 0.
"""

from __future__ import annotations

import contextlib
import logging
import signal
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsakv.serve.limits import HttpLimits

log = logging.getLogger("dsakv.serve")

_held: list[int] = []  # stop signals a server handled, in the order they came, raised again by reraise_stop_signals


def held_stop_signals() -> list[int]:
    """The stop signals handled by a server that has returned, not yet raised again."""
    return list(_held)


def reraise_stop_signals() -> None:
    """Raise the held SIGTERMs again: with its default action the process ends with the signal's status (-15), as
    under uvicorn alone. A Ctrl-C is dropped: the server's graceful stop was its whole effect and the command
    exits 0 (raising it again would be a KeyboardInterrupt traceback). Call it once everything the server's
    caller started has stopped."""
    while _held:
        sig = _held.pop()
        if sig != signal.SIGINT:
            signal.raise_signal(sig)


def _server(config: Any) -> Any:
    import uvicorn

    class Server(uvicorn.Server):  # type: ignore[misc]
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            with super().capture_signals():
                try:
                    yield
                finally:  # moved out before uvicorn's exit raises them; handlers are restored by then
                    captured = getattr(self, "_captured_signals", None)
                    if captured:
                        _held.extend(captured)
                        captured.clear()

    return Server(config)


def run_http(app: Any, host: str, port: int, log_level: str = "info", limits: HttpLimits | None = None) -> int:
    """Serve `app` on host:port until Ctrl-C / SIGTERM (uvicorn's graceful shutdown), under the HTTP limits
    (`limits`, else the app's guard's own: dsakv.serve.limits); returns 0."""
    import uvicorn

    from dsakv.serve.limits import uvicorn_settings

    guard = app.state.http_guard
    if limits is not None:
        guard.limits = limits
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False, **uvicorn_settings(guard))
    try:
        _server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    log.info("serve: stopped")
    return 0
