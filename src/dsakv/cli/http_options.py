"""The HTTP limit options of `dsakv serve` (colocated and router): sizes, timeouts, a connection cap.

    add_http_arguments(parser)  ->  --max-request-bytes --max-json-depth --http-header-timeout
                                    --http-body-timeout --keep-alive-timeout --max-connections
    http_limits(args)           ->  dsakv.serve.limits.HttpLimits (validated; a bad value is a ConfigError)

No torch; imports dsakv.plan.units and (inside http_limits) dsakv.serve.limits.
"""

from __future__ import annotations

import argparse
from typing import Any

from dsakv.plan.units import parse_size


def add_http_arguments(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    g = p.add_argument_group("HTTP limits (colocated and router): bad or slow clients get a 4xx, never hold the server")
    g.add_argument(
        "--max-request-bytes",
        default="16MiB",
        metavar="SIZE",
        help="largest request body, e.g. 16MiB (default); larger ones get 413 before they are read",
    )
    g.add_argument("--max-json-depth", type=int, default=64, help="deepest array/object nesting in a body (64)")
    g.add_argument(
        "--http-header-timeout",
        type=float,
        default=10.0,
        help="seconds a client has to send a complete request head; then the connection is closed (10)",
    )
    g.add_argument(
        "--http-body-timeout", type=float, default=30.0, help="seconds to receive a whole request body, else 408 (30)"
    )
    g.add_argument(
        "--keep-alive-timeout", type=float, default=5.0, help="seconds an idle keep-alive connection stays open (5)"
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=1024,
        help="open HTTP connections at most; one more gets 503 and is closed (1024)",
    )
    return g


def http_limits(args: argparse.Namespace) -> Any:
    """The HttpLimits of the options above (defaults where a caller's parser lacks them)."""
    from dsakv.serve.limits import HttpLimits

    d = HttpLimits()
    raw = getattr(args, "max_request_bytes", None)
    return HttpLimits(
        max_request_bytes=parse_size(str(raw), "--max-request-bytes") if raw is not None else d.max_request_bytes,
        max_json_depth=getattr(args, "max_json_depth", d.max_json_depth),
        header_timeout=getattr(args, "http_header_timeout", d.header_timeout),
        body_timeout=getattr(args, "http_body_timeout", d.body_timeout),
        keep_alive_timeout=getattr(args, "keep_alive_timeout", d.keep_alive_timeout),
        max_connections=getattr(args, "max_connections", d.max_connections),
    )
