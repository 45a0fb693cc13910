"""Run an ASGI app (dsakv.serve.app.create_app) with uvicorn until interrupted; shared by every serving role."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dsakv.serve.limits import HttpLimits

log = logging.getLogger("dsakv.serve")


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
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    log.info("serve: stopped")
    return 0
