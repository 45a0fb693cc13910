"""Serving benchmark: does index-K elision's extra KV capacity become throughput when the KV pool binds?

    python bench/serve.py                      # defaults: budgets 20MiB (KV-bound) and 128MiB (KV-ample), ~4 min
    python bench/serve.py --runs 3 --window 10 --warmup 4 --concurrency 16 --budgets 20MiB,24MiB,128MiB

For each configuration (KV-bound: a small KV byte budget; KV-ample: a large one) and each arm (elision on, off),
it starts `dsakv serve` (tiny checkpoint, prefix cache on, 1 torch thread) as a subprocess on 127.0.0.1 with the
SAME --kv-budget: the pool's page count comes from the planner's bytes per token, so the elided arm gets more pages.
A closed-loop load generator (asyncio + httpx, streaming completions) keeps --concurrency agentic sessions going
(--warmup seconds, then a measured --window): session turn t's prompt = turn t-1's prompt + its output + new
user tokens, after a system prefix shared by every session. Arms rotate on/off/ctl (--runs per arm, fresh server
each; ctl, the control arm, is elision on again: on / ctl must read 1.0 within its spread, --no-control drops it).
Reported per arm, as min/mean/max over runs: requests/s and output tokens/s inside the window, output
tokens per server CPU-second (robust to other load on the machine), TTFT and TPOT p50/p90/p99 (client side),
pool usage, running/waiting requests (sampled from /health), prefix-cache hit rate and preemptions (from
/metrics). The planner's predicted capacity gain is printed and plotted beside the measured throughput gain.
Writes bench/results/serve.{json,md,png} (the markdown holds the exact command). Never asserts on time.
This process imports no torch (the checkpoint is made by `dsakv make-tiny` in a subprocess).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from dsakv.cli import options
from dsakv.config import LayoutConfig
from dsakv.plan.capacity import Deployment, plan
from dsakv.plan.units import fmt_bytes, parse_size
from dsakv.spec.model import ModelSpec
from dsakv.util.procs import Proc, dsakv_cmd, free_ports

RESULTS = Path(__file__).resolve().parent / "results"


# ---- workload ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    system_tokens: int
    first_user_tokens: int
    user_tokens: int
    output_tokens: int
    turns: int
    vocab: int
    seed: int

    @property
    def max_context(self) -> int:
        return self.system_tokens + self.first_user_tokens + self.turns * (self.output_tokens + self.user_tokens)

    def system(self) -> list[int]:
        return random.Random(self.seed).choices(range(2, self.vocab), k=self.system_tokens)

    def user(self, session: int, turn: int) -> list[int]:
        n = self.first_user_tokens if turn == 0 else self.user_tokens
        return random.Random(self.seed * 1_000_003 + session * 101 + turn).choices(range(2, self.vocab), k=n)


@dataclass
class RunStats:
    start: float  # measurement window [start, end): before it, --warmup seconds of the same load
    end: float
    completed: int = 0  # requests that finished inside the window
    tokens: int = 0  # output tokens received inside the window (finished requests or not)
    ttft: list[float] = field(default_factory=list)  # of requests finished inside the window
    tpot: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # server CPU seconds at window start and end

    @property
    def window(self) -> float:
        return self.end - self.start


async def _request(client: httpx.AsyncClient, prompt: list[int], w: Workload, st: RunStats) -> list[int] | None:
    """One streaming completion; its output ids, or None if the window closed first (then it is cancelled)."""
    body = {"prompt": prompt, "max_tokens": w.output_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []

    async def go() -> None:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                st.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    st.errors.append(str(chunk["error"])[:300])
                    return
                new = chunk["choices"][0]["token_ids"]
                if new:
                    now = time.perf_counter()
                    if st.start <= now < st.end:
                        st.tokens += len(new)
                    stamps.append(now)
                    ids.extend(new)

    try:
        await asyncio.wait_for(go(), timeout=max(st.end - time.perf_counter(), 0.001))
    except TimeoutError:
        return None
    if len(ids) != w.output_tokens:
        return None
    if stamps[-1] >= st.start:
        st.completed += 1
        st.ttft.append(stamps[0] - t0)
        if len(stamps) > 1:
            st.tpot.append((stamps[-1] - stamps[0]) / (len(ids) - 1))
    return ids


async def _session_worker(client: httpx.AsyncClient, w: Workload, st: RunStats, next_session: list[int]) -> None:
    system = w.system()
    while time.perf_counter() < st.end:
        sid = next_session[0]
        next_session[0] += 1
        prompt = system + w.user(sid, 0)
        for turn in range(w.turns):
            out = await _request(client, prompt, w, st)
            if out is None:
                if st.errors:
                    await asyncio.sleep(0.05)
                break
            prompt = prompt + out + w.user(sid, turn + 1)


async def _sample(client: httpx.AsyncClient, st: RunStats, cpu_seconds: Any) -> None:
    """/health every 0.25 s inside the window; the server's CPU time at its start and end."""
    await asyncio.sleep(max(st.start - time.perf_counter(), 0))
    st.cpu.append(cpu_seconds())
    while time.perf_counter() < st.end:
        try:
            st.health.append((await client.get("/health")).json())
        except httpx.HTTPError:
            pass
        await asyncio.sleep(min(0.25, max(st.end - time.perf_counter(), 0)))
    st.cpu.append(cpu_seconds())


async def drive(url: str, w: Workload, concurrency: int, warmup: float, window: float, cpu_seconds: Any) -> RunStats:
    now = time.perf_counter()
    st = RunStats(now + warmup, now + warmup + window)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits) as client:
        next_session = [0]
        await asyncio.gather(
            _sample(client, st, cpu_seconds),
            *(_session_worker(client, w, st, next_session) for _ in range(concurrency)),
        )
    return st


# ---- servers -------------------------------------------------------------------------------------------


class Server:
    """`dsakv serve` in a subprocess on a free 127.0.0.1 port."""

    def __init__(self, model: Path, budget: str, elide: bool, args: argparse.Namespace, log: Path) -> None:
        self.port = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = dsakv_cmd(
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--kv-budget",
            budget,
            *options.layout_argv(replace(options.layout_config(args), elide=elide)),
            "--prefix-cache",
            "--threads",
            "1",
            "--log-level",
            "warning",
            "--max-batch-tokens",
            str(args.max_batch_tokens),
        )
        log.write_text("")
        self.log = log
        # SIGINT to the server alone (uvicorn's graceful shutdown), as a user's Ctrl-C would
        self.proc = Proc("serve", self.cmd, log, env={**os.environ, "OMP_NUM_THREADS": "1"}, new_session=False)
        self.proc.start()

    def wait_ready(self, timeout: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.poll()}); see {self.log.name}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2)
                if r.status_code == 200:
                    return dict(r.json())
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready within {timeout} s; see {self.log.name}")
            time.sleep(0.1)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def cpu_seconds(self) -> float:
        """user + system CPU seconds of the server process so far (Linux /proc)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.stop(timeout=30, sig=signal.SIGINT)


# ---- one run, one arm ----------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def wait_for_quiet(max_load: float | None, max_wait: float) -> None:
    """Wait (up to max_wait s) until the 1-minute load average is below max_load: other work skews wall-clock
    throughput on a shared machine."""
    if max_load is None:
        return
    end = time.monotonic() + max_wait
    while os.getloadavg()[0] > max_load and time.monotonic() < end:
        time.sleep(2)


def one_run(model: Path, budget: str, elide: bool, w: Workload, args: argparse.Namespace, tag: str) -> dict:
    wait_for_quiet(args.max_load, args.max_wait)
    load0 = os.getloadavg()[0]
    srv = Server(model, budget, elide, args, Path(args.log_dir) / f"{tag}.log")
    try:
        h0 = srv.wait_ready()
        # warm-up outside the window: one short request (first-call overheads), not part of the workload
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2}, timeout=120)
        m0 = srv.metrics()
        st = asyncio.run(drive(srv.url, w, args.concurrency, args.warmup, args.window, srv.cpu_seconds))
        m1 = srv.metrics()
    finally:
        srv.stop()
    used = [h["pages_used"] / h["pages_total"] for h in st.health] or [float("nan")]

    def delta(k: str) -> float:
        return m1.get(k, 0.0) - m0.get(k, 0.0)

    looked = delta("dsakv_prefix_cache_lookup_tokens")
    return {
        "elide": elide,
        "load_1m": (load0 + os.getloadavg()[0]) / 2,
        "pages_total": h0["pages_total"],
        "capacity_tokens": h0["capacity_tokens"],
        "req_per_s": st.completed / st.window,
        "out_tok_per_s": st.tokens / st.window,
        "out_tok_per_cpu_s": st.tokens / (st.cpu[1] - st.cpu[0]) if st.cpu[1] > st.cpu[0] else float("nan"),
        "server_cpu_util": (st.cpu[1] - st.cpu[0]) / st.window,
        "completed": st.completed,
        "ttft_p50": _pct(st.ttft, 0.5),
        "ttft_p90": _pct(st.ttft, 0.9),
        "ttft_p99": _pct(st.ttft, 0.99),
        "tpot_p50": _pct(st.tpot, 0.5),
        "tpot_p90": _pct(st.tpot, 0.9),
        "tpot_p99": _pct(st.tpot, 0.99),
        "pool_used_mean": statistics.fmean(used),
        "pool_used_max": max(used),
        "running_mean": statistics.fmean([h["running"] for h in st.health]) if st.health else float("nan"),
        "waiting_mean": statistics.fmean([h["waiting"] for h in st.health]) if st.health else float("nan"),
        "prefix_hit_rate": delta("dsakv_prefix_cache_hit_tokens_total") / looked if looked else 0.0,
        "preemptions": delta("dsakv_engine_preemptions_total"),
        "prefill_tokens": delta("dsakv_engine_prefill_tokens_total"),
        "errors": st.errors[:5],
        "num_errors": len(st.errors),
    }


METRICS = [
    ("req_per_s", "req/s", "{:.2f}"),
    ("out_tok_per_s", "out tok/s", "{:.1f}"),
    ("out_tok_per_cpu_s", "out tok per server CPU-s", "{:.1f}"),
    ("server_cpu_util", "server CPU (cores)", "{:.2f}"),
    ("ttft_p50", "TTFT p50 s", "{:.3f}"),
    ("ttft_p90", "TTFT p90 s", "{:.3f}"),
    ("ttft_p99", "TTFT p99 s", "{:.3f}"),
    ("tpot_p50", "TPOT p50 s", "{:.4f}"),
    ("tpot_p90", "TPOT p90 s", "{:.4f}"),
    ("tpot_p99", "TPOT p99 s", "{:.4f}"),
    ("pool_used_mean", "pool used (mean)", "{:.0%}"),
    ("running_mean", "running (mean)", "{:.1f}"),
    ("waiting_mean", "waiting (mean)", "{:.1f}"),
    ("prefix_hit_rate", "prefix hit rate", "{:.0%}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("prefill_tokens", "prefill tokens computed", "{:.0f}"),
    ("load_1m", "machine load avg (1 min)", "{:.1f}"),
]


def spread(runs: list[dict], key: str) -> dict[str, float]:
    xs = [r[key] for r in runs]
    return {"min": min(xs), "mean": statistics.fmean(xs), "max": max(xs)}


def predicted_gain(spec: ModelSpec, budget: int, args: argparse.Namespace) -> dict[str, float]:
    d = Deployment(
        spec=spec,
        role="colocated",
        kv_format=args.kv_format,
        index_format=args.index_format,
        page_size=args.page_size,
        kv_budget=budget,
    )
    rp = plan(d)
    return {
        "tokens_dense": rp.tokens_dense,
        "tokens_elided": rp.tokens_elided,
        "gain": rp.tokens_elided / rp.tokens_dense,
    }


def run_config(name: str, budget: str, model: Path, spec: ModelSpec, w: Workload, args: argparse.Namespace) -> dict:
    pred = predicted_gain(spec, parse_size(budget, "budget"), args)
    print(
        f"\n== {name}: KV budget {budget} -> dense {pred['tokens_dense']} tokens, elided {pred['tokens_elided']} "
        f"tokens (planner gain x{pred['gain']:.3f}); workload needs up to {args.concurrency} x {w.max_context} = "
        f"{args.concurrency * w.max_context} tokens",
        flush=True,
    )
    # "ctl" is the control arm: elision on again, a second copy of "on" run in the same rotation; on / ctl
    # must read 1.0 within its spread, else the method (order, warm-up, shared state) is biased
    arms = ("on", "off", "ctl") if args.control else ("on", "off")
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    discarded: list[dict] = []
    for i in range(args.runs):
        for arm in arms[i % len(arms) :] + arms[: i % len(arms)]:  # each arm takes each slot of the rotation
            for attempt in range(args.retries + 1):
                r = one_run(model, budget, arm != "off", w, args, f"{name}-{arm}-{i}-{attempt}")
                r["attempt"] = attempt
                r["disturbed"] = r["server_cpu_util"] < args.min_cpu
                print(
                    f"  run {i} elide={arm:3s}: {r['pages_total']} pages, {r['out_tok_per_s']:.1f} tok/s, "
                    f"{r['req_per_s']:.2f} req/s, TTFT p50 {r['ttft_p50']:.3f}s, pool {r['pool_used_mean']:.0%}, "
                    f"hit {r['prefix_hit_rate']:.0%}, preempt {r['preemptions']:.0f}, errors {r['num_errors']}, "
                    f"{r['out_tok_per_cpu_s']:.1f} tok/CPU-s, server {r['server_cpu_util']:.2f} cores, "
                    f"load {r['load_1m']:.1f}" + (" -> DISTURBED" if r["disturbed"] else ""),
                    flush=True,
                )
                if not r["disturbed"] or attempt == args.retries:
                    break
                discarded.append({"run": i, "arm": arm, **r})
            runs[arm].append(r)
    summary = {arm: {k: spread(rs, k) for k, _, _ in METRICS} for arm, rs in runs.items()}
    on, off = runs["on"], runs["off"]
    tput = [a["out_tok_per_s"] / b["out_tok_per_s"] for a, b in zip(on, off, strict=True)]
    eff = [a["out_tok_per_cpu_s"] / b["out_tok_per_cpu_s"] for a, b in zip(on, off, strict=True)]
    measured = {
        "cpu_mean_ratio": statistics.fmean(r["out_tok_per_cpu_s"] for r in on)
        / statistics.fmean(r["out_tok_per_cpu_s"] for r in off),
        "cpu_paired_min": min(eff),
        "cpu_paired_max": max(eff),
        "mean_ratio": statistics.fmean(r["out_tok_per_s"] for r in on)
        / statistics.fmean(r["out_tok_per_s"] for r in off),
        "paired_min": min(tput),
        "paired_max": max(tput),
        "req_ratio": statistics.fmean(r["req_per_s"] for r in on) / statistics.fmean(r["req_per_s"] for r in off),
    }
    if args.control:
        ctl = runs["ctl"]
        same = [a["out_tok_per_s"] / b["out_tok_per_s"] for a, b in zip(on, ctl, strict=True)]
        measured["control_mean_ratio"] = statistics.fmean(r["out_tok_per_s"] for r in on) / statistics.fmean(
            r["out_tok_per_s"] for r in ctl
        )
        measured["control_paired_min"], measured["control_paired_max"] = min(same), max(same)
    print(
        f"  -> on/off: tok/s x{measured['mean_ratio']:.3f} (paired {measured['paired_min']:.3f}.."
        f"{measured['paired_max']:.3f}), tok per CPU-s x{measured['cpu_mean_ratio']:.3f} (paired "
        f"{measured['cpu_paired_min']:.3f}..{measured['cpu_paired_max']:.3f}); planner capacity x{pred['gain']:.3f}",
        flush=True,
    )
    if args.control:
        print(
            f"  -> control on/on: tok/s x{measured['control_mean_ratio']:.3f} (paired "
            f"{measured['control_paired_min']:.3f}..{measured['control_paired_max']:.3f}; 1.0 expected)",
            flush=True,
        )
    return {
        "name": name,
        "budget": budget,
        "predicted": pred,
        "measured": measured,
        "summary": summary,
        "runs": runs,
        "discarded": discarded,
    }


# ---- report --------------------------------------------------------------------------------------------


def markdown(results: list[dict], w: Workload, args: argparse.Namespace, command: str, elapsed: float) -> str:
    lines = [
        "# Serving benchmark: elision on vs off, same KV byte budget",
        "",
        f"Command: `{command}`",
        "",
        f"Model: tiny (make-tiny, 12 layers, 5 index-K producers), KV {args.kv_format}, index-K {args.index_format}, "
        f"page {args.page_size} tokens; `dsakv serve` colocated, prefix cache on, 1 torch thread. Load: "
        f"{args.concurrency} concurrent agentic sessions (closed loop, streaming, greedy), {args.warmup:g} s warm-up "
        f"then a {args.window:g} s measured window; {args.runs} runs per arm, a fresh server each, arms alternating. "
        f"Session: a {w.system_tokens}-token system prefix shared by all sessions, {w.first_user_tokens} user "
        f"tokens, then {w.turns} turns of {w.output_tokens} output + {w.user_tokens} new user tokens (turn t's "
        f"prompt = turn t-1's prompt + output + user tokens; up to {w.max_context} tokens). "
        f"Machine: {os.cpu_count()} CPU cores shared with other work. Wall time {elapsed:.0f} s.",
        "",
        "Values are min / mean / max over runs. `out tok/s` counts tokens received inside the window (wall "
        "clock; sensitive to other load on the machine); `out tok per server CPU-s` divides them by the server "
        "process's CPU time in the window (the work each token cost: less sensitive to other load). TTFT/TPOT are "
        "measured by the client on streamed chunks. A run whose server process got less than "
        f"{args.min_cpu:g} of a CPU core (other work on the shared machine) is disturbed and rerun, up to "
        f"{args.retries} times; disturbed runs that were replaced are listed in serve.json (`discarded`).",
        "",
        "| budget | planner capacity gain | measured tok/s gain | measured tok per CPU-s gain | req/s gain | "
        "control (on / on again) tok/s |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        p, m = res["predicted"], res["measured"]
        control = (
            f"x{m['control_mean_ratio']:.3f} (paired {m['control_paired_min']:.2f}..{m['control_paired_max']:.2f})"
            if "control_mean_ratio" in m
            else "-"
        )
        lines.append(
            f"| {res['name']} | x{p['gain']:.3f} ({p['tokens_dense']} -> {p['tokens_elided']} tokens) | "
            f"x{m['mean_ratio']:.3f} (paired {m['paired_min']:.2f}..{m['paired_max']:.2f}) | "
            f"x{m['cpu_mean_ratio']:.3f} (paired {m['cpu_paired_min']:.2f}..{m['cpu_paired_max']:.2f}) | "
            f"x{m['req_ratio']:.3f} | {control} |"
        )
    lines.append("")
    for res in results:
        lines += [
            f"## {res['name']}",
            "",
            "| metric | elision on | elision off |",
            "| --- | --- | --- |",
        ]
        pages = {arm: res["runs"][arm][0]["pages_total"] for arm in ("on", "off")}
        dist = {arm: sum(r["disturbed"] for r in res["runs"][arm]) for arm in ("on", "off")}
        lines.append(
            f"| runs kept still disturbed / replaced | {dist['on']} / "
            f"{sum(d['arm'] == 'on' for d in res['discarded'])} | {dist['off']} / "
            f"{sum(d['arm'] == 'off' for d in res['discarded'])} |"
        )
        lines.append(
            f"| pool pages (tokens) | {pages['on']} ({pages['on'] * args.page_size}) | "
            f"{pages['off']} ({pages['off'] * args.page_size}) |"
        )
        for key, label, fmt in METRICS:
            cells = []
            for arm in ("on", "off"):
                s = res["summary"][arm][key]
                cells.append(" / ".join(fmt.format(s[x]) for x in ("min", "mean", "max")))
            lines.append(f"| {label} | {cells[0]} | {cells[1]} |")
        lines.append("")
    lines += ["![throughput vs capacity](serve.png)", ""]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    names = [r["name"].replace(" (", "\n(") for r in results]
    x = list(range(len(results)))
    bars = [
        ("planner: capacity gain (tokens)", [r["predicted"]["gain"] for r in results], None, "#8fb3d9"),
        ("measured: output tok/s gain", [r["measured"]["mean_ratio"] for r in results], "", "#e69f55"),
        ("measured: tok per server CPU-s gain", [r["measured"]["cpu_mean_ratio"] for r in results], "cpu_", "#6aa56a"),
    ]
    top = 1.0
    for j, (label, vals, key, color) in enumerate(bars):
        err = None
        if key is not None:
            lo = [v - r["measured"][f"{key}paired_min"] for v, r in zip(vals, results, strict=True)]
            hi = [r["measured"][f"{key}paired_max"] - v for v, r in zip(vals, results, strict=True)]
            err = [lo, hi]
            top = max(top, *(v + h for v, h in zip(vals, hi, strict=True)))
        top = max(top, *vals)
        ax1.bar([i + (j - 1) * 0.27 for i in x], vals, 0.27, yerr=err, capsize=3, label=label, color=color)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_xticks(x, names, fontsize=8)
    ax1.set_ylabel("elision on / off (error bars: min..max of paired runs)")
    ax1.set_ylim(0.5, top + 0.15)
    ax1.legend(loc="upper right", fontsize=7)
    ax1.set_title("same KV byte budget: predicted capacity vs measured throughput", fontsize=10)
    for j, arm in enumerate(("on", "off")):
        s = [r["summary"][arm]["out_tok_per_s"] for r in results]
        ax2.bar(
            [i - 0.2 + 0.4 * j for i in x],
            [v["mean"] for v in s],
            0.4,
            yerr=[[v["mean"] - v["min"] for v in s], [v["max"] - v["mean"] for v in s]],
            capsize=4,
            label=f"elision {arm}",
            color="#4c72b0" if arm == "on" else "#aaaaaa",
        )
    ax2.set_xticks(x, names, fontsize=8)
    ax2.set_ylabel("output tokens / s (mean, min..max over runs)")
    ax2.legend(fontsize=8)
    ax2.set_title("throughput", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint DIR (default: a fresh `dsakv make-tiny` in a temp dir)")
    p.add_argument("--runs", type=int, default=3, help="runs per arm (default 3)")
    p.add_argument("--window", type=float, default=10.0, help="seconds measured per run (default 10)")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds of the same load before the window (default 4)")
    p.add_argument("--concurrency", type=int, default=16, help="concurrent sessions (default 16)")
    p.add_argument(
        "--budgets",
        default="20MiB,128MiB",
        help="KV byte budgets, comma-separated; each is KV-bound if the dense pool holds fewer tokens than "
        "concurrency x max session context, else KV-ample (default 20MiB,128MiB)",
    )
    options.add_layout_arguments(p, LayoutConfig(page_size=16), elide=False)  # both elision settings run
    p.add_argument("--max-batch-tokens", type=int, default=512)
    p.add_argument("--system-tokens", type=int, default=384)
    p.add_argument("--first-user-tokens", type=int, default=128)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=12)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--min-cpu",
        type=float,
        default=0.9,
        help="a run whose server got fewer CPU cores than this (other work on the machine) is disturbed: "
        "rerun it (default 0.9)",
    )
    p.add_argument("--retries", type=int, default=3, help="reruns of a disturbed run (default 3)")
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a control arm: elision on twice (on / ctl must read 1.0 within its spread; default on)",
    )
    p.add_argument("--max-load", type=float, default=None, help="before each run, wait for load average < this")
    p.add_argument("--max-wait", type=float, default=120.0, help="at most this many seconds (default 120)")
    p.add_argument("--out", default=str(RESULTS), help="results directory (default bench/results)")
    p.add_argument("--log-dir", default=None, help="server logs (default: a temp dir)")
    args = p.parse_args()

    def _term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt  # so the running server is stopped by one_run's finally

    signal.signal(signal.SIGTERM, _term)
    command = "python bench/serve.py" + "".join(" " + shlex.quote(a) for a in sys.argv[1:])
    t_start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="dsakv-bench-serve-"))
    args.log_dir = args.log_dir or str(tmp)
    Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else tmp / "tiny"
    if not args.model:
        subprocess.run([sys.executable, "-m", "dsakv", "make-tiny", str(model)], check=True, capture_output=True)
    spec = ModelSpec.from_path(model)
    w = Workload(
        args.system_tokens,
        args.first_user_tokens,
        args.user_tokens,
        args.output_tokens,
        args.turns,
        spec.vocab_size,
        args.seed,
    )
    for elide in (True, False):
        lay = replace(options.layout_config(args), elide=elide).layout(spec)
        print(f"elide={elide}: {lay.bytes_per_token} B/token, page {fmt_bytes(lay.bytes_per_token * args.page_size)}")
    demand = args.concurrency * w.max_context
    configs = []
    for budget in args.budgets.split(","):
        dense = predicted_gain(spec, parse_size(budget, "--budgets"), args)["tokens_dense"]
        configs.append((f"{budget} ({'KV-bound' if dense < demand else 'KV-ample'})", budget))
    results = [run_config(name, budget, model, spec, w, args) for name, budget in configs]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    elapsed = time.monotonic() - t_start
    meta = {
        "command": command,
        "workload": w.__dict__,
        "args": {k: v for k, v in vars(args).items()},
        "elapsed_s": elapsed,
        "results": results,
    }
    (out / "serve.json").write_text(json.dumps(meta, indent=1))
    (out / "serve.md").write_text(markdown(results, w, args, command, elapsed))
    plot(results, out / "serve.png")
    print(f"\nwrote {out / 'serve.json'}, {out / 'serve.md'}, {out / 'serve.png'} ({elapsed:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
