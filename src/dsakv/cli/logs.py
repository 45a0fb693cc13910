"""The commands' logging set-up (serve, store-master): one format on stderr, resolved at each record."""

from __future__ import annotations

import logging
import sys


class _CurrentStderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler that writes to sys.stderr as it is at each record, not the stream it was at set-up: main() run
    in-process (a test's capsys, a notebook) must not leave the root logger writing to a closed stream."""

    @property  # type: ignore[override]
    def stream(self) -> object:
        return sys.stderr

    @stream.setter
    def stream(self, _value: object) -> None:  # StreamHandler.__init__ assigns it
        pass


def setup_logging(level: str) -> None:
    """The commands' log format on stderr (`level`: debug / info / warning / error)."""
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[_CurrentStderr()]
    )
