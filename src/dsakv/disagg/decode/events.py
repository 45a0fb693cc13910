"""EventLog: the decode worker's token events, read by routers with a cursor (long-poll over the RPC).

    log.append(rid, tokens, finished, reason, error)      # from the step loop and failure paths
    got = log.since(cursor, wait_s)                       # a router's poll: Events(cursor, events, lost)
    log.wait_read(timeout)                                # until a reader asked past the last event (a leaving rank)

Events (EventRow) are numbered 1, 2, ...; `since(c)` returns those numbered > c (waiting up to wait_s for
one). The log keeps the newest `keep` events; a reader that fell further behind is told so (`lost`).
Imports the standard library and dsakv.disagg.protocol.messages.
"""

from __future__ import annotations

import threading
from collections import deque

from dsakv.disagg.protocol.messages import EventRow, Events, WireLogprobs


class EventLog:
    def __init__(self, keep: int = 200_000) -> None:
        self._events: deque[EventRow] = deque(maxlen=keep)
        self._seq = 0
        self._read = 0  # the highest cursor a reader asked after: every event up to it was read
        self._cond = threading.Condition()

    @property
    def last(self) -> int:
        with self._cond:
            return self._seq

    def append(
        self,
        rid: str,
        tokens: list[int],
        finished: bool,
        reason: str | None = None,
        error: str | None = None,
        *,
        choice: int = 0,
        logprobs: WireLogprobs | None = None,
        prompt_logprobs: WireLogprobs | None = None,
        cached_tokens: int = 0,
    ) -> None:
        with self._cond:
            self._seq += 1
            row = EventRow(
                self._seq, rid, list(tokens), bool(finished), reason, error, choice, logprobs, prompt_logprobs,
                cached_tokens,
            )  # fmt: skip
            self._events.append(row)
            self._cond.notify_all()

    def wait_read(self, timeout: float) -> bool:
        """Wait (up to `timeout` s) until a reader asked after the last event: it has read them all."""
        with self._cond:
            return self._cond.wait_for(lambda: self._read >= self._seq, timeout=timeout)

    def since(self, cursor: int, wait_s: float = 0.0, limit: int = 10_000) -> Events:
        """Events after `cursor` (at most `limit`), waiting up to wait_s for the first."""
        with self._cond:
            if self._read < cursor <= self._seq:  # (a router syncing asks after 1 << 62: not a read)
                self._read = cursor
                self._cond.notify_all()
            if self._seq <= cursor and wait_s > 0:
                self._cond.wait_for(lambda: self._seq > cursor, timeout=wait_s)
            first = self._events[0].seq if self._events else self._seq + 1
            lost = cursor + 1 < first and cursor < self._seq
            if not self._events or self._seq <= cursor:
                return Events(self._seq if cursor > self._seq else cursor, [], False)
            start = max(0, cursor + 1 - first)
            out = [self._events[i] for i in range(start, min(len(self._events), start + limit))]
            return Events(out[-1].seq if out else cursor, out, lost)
