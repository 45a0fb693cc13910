"""The decode worker's engine outputs -> its EventLog: one event stream per request, with the choices of an
n > 1 request in it, and nothing from a request that failed before decoding.

    outputs = DecodeOutputs(events, stats, lock)
    outputs.add(rid, n)             at PREALLOC: choice 0 runs as `rid`, choice i > 0 as '<rid>/<i>' (the engine
                                    forks them after the first token)
    outputs.engine_ids(rid)         every choice's engine id, the forks first (abort them before choice 0: aborting
                                    choice 0 before it forked would queue them as requests of their own)
    outputs.failed(rid, reason, error)   its one event (finished, error / abort); its engine outputs are dropped
    outputs.forget(rid)             once its pages are freed
    outputs.tracked()               the n > 1 requests still tracked
    outputs.publish(engine.step())  each output as an event of its request and choice; returns how many

Imports dsakv.disagg.{events, messages} and engine.request; no torch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from dsakv.disagg.decode.events import EventLog
from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.protocol.messages import WireLogprobs
from dsakv.engine.request import RequestOutput


class DecodeOutputs:
    def __init__(self, events: EventLog, stats: DecodeStats, lock: threading.RLock) -> None:
        self.events, self.stats, self.lock = events, stats, lock
        self._suppress: set[str] = set()  # failed while inbound: their abort output is not an event
        self._choices: dict[str, int] = {}  # n > 1 requests: how many choices (the forks '<rid>/<i>' abort with it)
        self._forks_left: dict[str, int] = {}  # ... and how many of its forks have not finished

    def add(self, rid: str, n: int) -> None:
        if n > 1:
            self._choices[rid] = n
            self._forks_left[rid] = n - 1

    def tracked(self) -> list[str]:
        """The n > 1 requests whose choices are still tracked (read-only view: tests, integrity)."""
        return sorted(self._choices)

    def engine_ids(self, rid: str) -> list[str]:
        return [f"{rid}/{i}" for i in range(self._choices.get(rid, 1) - 1, 0, -1)] + [rid]

    @staticmethod
    def engine_id(rid: str, choice: int) -> str:
        return rid if choice == 0 else f"{rid}/{choice}"

    def failed(self, rid: str, reason: str, error: str) -> None:
        self._suppress.update(self.engine_ids(rid))
        self.events.append(rid, [], True, reason, error if reason == "error" else None)

    def drop(self, engine_id: str) -> None:
        """The engine's outputs for `engine_id` (one choice) are not events: its request already has its one."""
        self._suppress.add(engine_id)

    def forget(self, rid: str) -> None:
        self._choices.pop(rid, None)
        self._forks_left.pop(rid, None)

    def publish(self, outs: Sequence[RequestOutput]) -> int:
        for o in outs:
            if o.request_id in self._suppress:
                if o.finished:
                    self._suppress.discard(o.request_id)
                continue
            self.stats.tokens += len(o.new_token_ids)
            if o.finished:
                self.stats.finished += 1
            self._event(o)
        return len(outs)

    def _event(self, o: RequestOutput) -> None:
        """One engine output as an event of its request (choice i > 0 of an n > 1 request runs as '<rid>/<i>')."""
        rid, i = o.request_id, o.choice_index
        if i:
            rid = rid[: -len(f"/{i}")]
            if o.finished:
                with self.lock:
                    left = self._forks_left.get(rid, 1) - 1
                    if left > 0:
                        self._forks_left[rid] = left
                    else:  # every fork finished: an abort of the request is choice 0's alone now
                        self.forget(rid)
        reason = o.finish_reason.value if o.finish_reason is not None else None
        self.events.append(
            rid,
            list(o.new_token_ids),
            o.finished,
            reason,
            o.error,
            choice=i,
            logprobs=WireLogprobs.pack(o.new_logprobs) if o.new_logprobs else None,
            prompt_logprobs=WireLogprobs.pack(o.prompt_logprobs) if o.prompt_logprobs is not None else None,
            cached_tokens=o.num_cached_tokens if i == 0 else 0,
        )
