"""Run an ASGI app (dsakv.serve.app.create_app) with uvicorn until interrupted; shared by every serving role."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("dsakv.serve")


def run_http(app: Any, host: str, port: int, log_level: str = "info") -> int:
    """Serve `app` on host:port until Ctrl-C / SIGTERM (uvicorn's graceful shutdown); returns 0."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)
    try:
        uvicorn.Server(config).run()
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    log.info("serve: stopped")
    return 0
