"""Server-side request metrics and the Prometheus text exposition (format 0.0.4), without prometheus_client.

ServerMetrics counts HTTP generation requests and times them (TTFT, TPOT, end-to-end) into histograms;
`render(backend_metrics)` writes those plus the backend's flat gauges, every name prefixed `dsakv_`; a backend key
`name{label="value",...}` is one series of a labelled family (the router's per-instance rows).
Standard library only; thread-safe (one lock).
"""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Sequence

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

_NAME = re.compile(r"[^a-zA-Z0-9_]")


class Histogram:
    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, v: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, v)] += 1
        self.sum += v
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out, cum = [], 0
        for le, c in zip(self.buckets, self.counts, strict=False):
            cum += c
            out.append(f'{name}_bucket{{le="{le:g}"}} {cum}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out.append(f"{name}_sum {_fmt(self.sum)}")
        out.append(f"{name}_count {self.count}")
        return out


def _fmt(v: float) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(float(v)) if v != int(v) else str(int(v))


class ServerMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests_total = 0  # generation requests received (completions + chat)
        self.requests_rejected = 0  # answered 4xx before reaching the backend
        self.requests_running = 0  # submitted to the backend, not finished
        self.requests_failed = 0  # finished with an error or a timeout
        self.finished: dict[str, int] = {}  # finish_reason -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.ttft = Histogram(TTFT_BUCKETS)
        self.tpot = Histogram(TPOT_BUCKETS)
        self.e2e = Histogram(E2E_BUCKETS)

    def received(self) -> None:
        with self._lock:
            self.requests_total += 1

    def rejected(self) -> None:
        with self._lock:
            self.requests_rejected += 1

    def started(self, prompt_tokens: int) -> None:
        with self._lock:
            self.requests_running += 1
            self.prompt_tokens += prompt_tokens

    def tokens(self, n: int) -> None:
        with self._lock:
            self.generation_tokens += n

    def done(self, reason: str, ttft: float | None, tpot: float | None, e2e: float) -> None:
        with self._lock:
            self.requests_running -= 1
            self.finished[reason] = self.finished.get(reason, 0) + 1
            if reason in ("error", "timeout"):
                self.requests_failed += 1
            if ttft is not None:
                self.ttft.observe(ttft)
            if tpot is not None:
                self.tpot.observe(tpot)
            self.e2e.observe(e2e)

    def render(self, backend: dict[str, float], backend_name: str) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_text: str, value: float) -> None:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name} {_fmt(value)}"])

        with self._lock:
            metric("dsakv_requests_total", "counter", "Generation requests received.", self.requests_total)
            metric("dsakv_requests_rejected_total", "counter", "Requests answered 4xx.", self.requests_rejected)
            metric("dsakv_requests_running", "gauge", "Requests in the backend, not finished.", self.requests_running)
            metric(
                "dsakv_requests_failed_total", "counter", "Requests ended by an error or timeout.", self.requests_failed
            )
            lines += [
                "# HELP dsakv_requests_finished_total Requests finished, by reason.",
                "# TYPE dsakv_requests_finished_total counter",
            ]
            for reason in sorted(set(self.finished) | {"stop", "length"}):
                lines.append(f'dsakv_requests_finished_total{{reason="{reason}"}} {self.finished.get(reason, 0)}')
            metric("dsakv_prompt_tokens_total", "counter", "Prompt tokens of submitted requests.", self.prompt_tokens)
            metric("dsakv_generation_tokens_total", "counter", "Tokens generated.", self.generation_tokens)
            for name, h, help_text in (
                ("dsakv_time_to_first_token_seconds", self.ttft, "Request arrival to its first token."),
                ("dsakv_time_per_output_token_seconds", self.tpot, "Mean time between tokens after the first."),
                ("dsakv_e2e_request_latency_seconds", self.e2e, "Request arrival to its last token."),
            ):
                lines += [f"# HELP {name} {help_text}", f"# TYPE {name} histogram", *h.lines(name)]
        lines += [f'dsakv_backend_info{{backend="{backend_name}"}} 1']
        taken = {ln.split(" ", 1)[0].split("{", 1)[0] for ln in lines if not ln.startswith("#")}
        typed: set[str] = set()
        for key in sorted(backend):
            base, brace, labels = key.partition("{")  # 'name{label="v",...}': one series of a labelled family
            name = "dsakv_" + _NAME.sub("_", base)
            if name in taken or name + "_total" in taken:
                continue
            if name not in typed:
                typed.add(name)
                lines.append(f"# TYPE {name} {'counter' if name.endswith('_total') else 'gauge'}")
            lines.append(f"{name}{brace}{labels} {_fmt(backend[key])}")
        return "\n".join(lines) + "\n"


__all__ = ["Histogram", "ServerMetrics"]
