"""Serving benchmark: does index-K elision's extra KV capacity become throughput when the KV pool binds?

    python bench/serve.py                      # defaults: budgets 20MiB (KV-bound) and 128MiB (KV-ample), ~12 min
    python bench/serve.py --runs 5 --sessions 32 --concurrency 16 --budgets 20MiB,24MiB,128MiB

For each configuration (KV-bound: a small KV byte budget; KV-ample: a large one) and each arm it starts
`dsakv serve` (tiny checkpoint, prefix cache on, 1 torch thread) as a subprocess on 127.0.0.1 with the SAME
--kv-budget: the pool's page count comes from the planner's bytes per token, so the elided arm gets more pages.
Arms: on (elision on), off (elision off) and ctl, the control arm: elision on again, a second copy of "on" run in
the same rotation (--no-control drops it). on / ctl must read 1.0 within its spread, else the method is biased.

Method (equal work, interleaved pairs):
- Every run sends the SAME fixed request script, to completion: --sessions agentic sessions of --turns turns,
  --concurrency of them at a time (closed loop, streaming, greedy, ignore_eos): session s's turn t prompt = turn
  t-1's prompt + its output + new user tokens, after a system prefix shared by every session. Greedy tokens do
  not depend on elision, so every run of every arm receives the same output tokens and sends the same prompt
  tokens (checked and reported). Throughput = output tokens / the script's makespan; work = the server's CPU
  seconds over the script (out tok per server CPU-s: robust to other load on the machine).
- One discarded run primes the machine (file caches, imports) before the first measured one.
- Before the script, a fixed warm-up (--concurrency short requests whose tokens share nothing with the script)
  takes first-call overheads out of the measurement; each run is a fresh server.
- Runs are grouped in rounds: round r runs every arm once, the arms' order rotating so that each arm takes each
  slot; ratios are formed per round (paired) and reported as the median and min..max of the rounds.
  A run whose server got less than --min-cpu of a core (other work on the shared machine) is rerun.
Reported per arm as min / median / max over rounds: makespan, tokens/s, tokens per server CPU-s, TTFT and TPOT
p50/p90/p99 (client side), pool usage, running/waiting requests (sampled from /health), prefix-cache hit rate,
prefill tokens computed and preemptions (from /metrics), the machine's 1-minute load average. The planner's
predicted capacity gain is printed and plotted beside the measured gains and the control's.
Writes bench/results/serve.{json,md,png} (the markdown holds the exact command). Never asserts on time.
This process imports no torch (the checkpoint is made by `dsakv make-tiny` in a subprocess).

Why this method (bench/results/serve-method.md): the earlier one counted tokens in a 10 s wall-clock window of
an open-ended load; the arms then did different work (a window sees a different phase of the sessions'
turns: prefill tokens per output token 10.1 on vs 12.0 off in the KV-ample case), so it read x1.26 where the
engine does the same work per token.
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
ARMS = ("on", "off", "ctl")
WARMUP_PROMPT_TOKENS = 48
WARMUP_OUTPUT_TOKENS = 4


# ---- workload ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    system_tokens: int
    first_user_tokens: int
    user_tokens: int
    output_tokens: int
    turns: int
    sessions: int
    vocab: int
    seed: int

    @property
    def max_context(self) -> int:
        return self.system_tokens + self.first_user_tokens + self.turns * (self.output_tokens + self.user_tokens)

    @property
    def requests(self) -> int:
        return self.sessions * self.turns

    @property
    def output_total(self) -> int:
        return self.requests * self.output_tokens

    @property
    def prompt_total(self) -> int:
        first = self.system_tokens + self.first_user_tokens
        step = self.output_tokens + self.user_tokens
        return self.sessions * sum(first + t * step for t in range(self.turns))

    def system(self) -> list[int]:
        return random.Random(self.seed).choices(range(2, self.vocab), k=self.system_tokens)

    def user(self, session: int, turn: int) -> list[int]:
        n = self.first_user_tokens if turn == 0 else self.user_tokens
        return random.Random(self.seed * 1_000_003 + session * 101 + turn).choices(range(2, self.vocab), k=n)

    def warmup(self, i: int) -> list[int]:
        """Warm-up prompt i: its own random tokens (a page-sized common prefix with the script is unlikely)."""
        return random.Random(f"warmup-{self.seed}-{i}").choices(range(2, self.vocab), k=WARMUP_PROMPT_TOKENS)


@dataclass
class RunStats:
    start: float = 0.0  # the script's first request
    end: float = 0.0  # its last completion
    completed: int = 0
    tokens: int = 0  # output tokens received
    prompt_tokens: int = 0  # prompt tokens sent
    ttft: list[float] = field(default_factory=list)
    tpot: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    health: list[dict[str, Any]] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)  # server CPU seconds at the script's start and end
    client_cpu: list[float] = field(default_factory=list)  # this process's CPU seconds, same instants
    done: bool = False

    @property
    def makespan(self) -> float:
        return self.end - self.start


async def _request(client: httpx.AsyncClient, prompt: list[int], max_tokens: int, st: RunStats) -> list[int] | None:
    """One streaming greedy completion; its output ids, or None on an error (recorded in st)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    ids: list[int] = []
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            st.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
            return None
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                st.errors.append(str(chunk["error"])[:300])
                return None
            new = chunk["choices"][0]["token_ids"]
            if new:
                stamps.append(time.perf_counter())
                ids.extend(new)
    if len(ids) != max_tokens:
        st.errors.append(f"{len(ids)} tokens, {max_tokens} asked")
        return None
    st.completed += 1
    st.tokens += len(ids)
    st.prompt_tokens += len(prompt)
    st.ttft.append(stamps[0] - t0)
    if len(stamps) > 1:
        st.tpot.append((stamps[-1] - stamps[0]) / (len(ids) - 1))
    return ids


async def _session_worker(client: httpx.AsyncClient, w: Workload, st: RunStats, queue: list[int]) -> None:
    system = w.system()
    while queue:
        sid = queue.pop(0)
        prompt = system + w.user(sid, 0)
        for turn in range(w.turns):
            out = await _request(client, prompt, w.output_tokens, st)
            if out is None:
                break
            prompt = prompt + out + w.user(sid, turn + 1)


async def _sample(client: httpx.AsyncClient, st: RunStats) -> None:
    """/health every 0.25 s while the script runs."""
    while not st.done:
        try:
            st.health.append((await client.get("/health")).json())
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.25)


def _client(url: str, concurrency: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    return httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(None), limits=limits)


async def warmup(url: str, w: Workload, concurrency: int) -> list[str]:
    """A fixed batch of `concurrency` short requests sharing nothing with the script; its errors."""
    warm = RunStats()
    async with _client(url, concurrency) as client:
        await asyncio.gather(*(_request(client, w.warmup(i), WARMUP_OUTPUT_TOKENS, warm) for i in range(concurrency)))
    return warm.errors


async def drive(url: str, w: Workload, concurrency: int, cpu_seconds: Any) -> RunStats:
    """The whole script, `concurrency` sessions at a time; its stats."""
    st = RunStats()
    async with _client(url, concurrency) as client:
        queue = list(range(w.sessions))
        st.cpu.append(cpu_seconds())
        st.client_cpu.append(time.process_time())
        st.start = time.perf_counter()
        sampler = asyncio.create_task(_sample(client, st))
        await asyncio.gather(*(_session_worker(client, w, st, queue) for _ in range(concurrency)))
        st.end = time.perf_counter()
        st.cpu.append(cpu_seconds())
        st.client_cpu.append(time.process_time())
        st.done = True
        await sampler
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
        # first-call overheads: one short request, then a fixed warm-up batch; neither is measured
        httpx.post(f"{srv.url}/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 2}, timeout=120)
        warm_errors = asyncio.run(warmup(srv.url, w, args.concurrency))
        m0 = srv.metrics()
        st = asyncio.run(asyncio.wait_for(drive(srv.url, w, args.concurrency, srv.cpu_seconds), args.timeout))
        st.errors += [f"warm-up: {e}" for e in warm_errors]
        m1 = srv.metrics()
    finally:
        srv.stop()
    used = [h["pages_used"] / h["pages_total"] for h in st.health] or [float("nan")]

    def delta(k: str) -> float:
        return m1.get(k, 0.0) - m0.get(k, 0.0)

    looked = delta("dsakv_prefix_cache_lookup_tokens")
    cpu_s = st.cpu[1] - st.cpu[0]
    return {
        "elide": elide,
        "load_1m": (load0 + os.getloadavg()[0]) / 2,
        "pages_total": h0["pages_total"],
        "capacity_tokens": h0["capacity_tokens"],
        "makespan_s": st.makespan,
        "output_tokens": st.tokens,
        "prompt_tokens": st.prompt_tokens,
        "completed": st.completed,
        "req_per_s": st.completed / st.makespan,
        "out_tok_per_s": st.tokens / st.makespan,
        "server_cpu_s": cpu_s,
        "out_tok_per_cpu_s": st.tokens / cpu_s if cpu_s > 0 else float("nan"),
        "server_cpu_util": cpu_s / st.makespan,
        "client_cpu_util": (st.client_cpu[1] - st.client_cpu[0]) / st.makespan,
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
    ("makespan_s", "script makespan s", "{:.2f}"),
    ("out_tok_per_s", "out tok/s", "{:.1f}"),
    ("out_tok_per_cpu_s", "out tok per server CPU-s", "{:.1f}"),
    ("server_cpu_s", "server CPU-s", "{:.2f}"),
    ("server_cpu_util", "server CPU (cores)", "{:.2f}"),
    ("client_cpu_util", "load generator CPU (cores)", "{:.2f}"),
    ("req_per_s", "req/s", "{:.2f}"),
    ("ttft_p50", "TTFT p50 s", "{:.3f}"),
    ("ttft_p90", "TTFT p90 s", "{:.3f}"),
    ("ttft_p99", "TTFT p99 s", "{:.3f}"),
    ("tpot_p50", "TPOT p50 s", "{:.4f}"),
    ("tpot_p90", "TPOT p90 s", "{:.4f}"),
    ("tpot_p99", "TPOT p99 s", "{:.4f}"),
    ("pool_used_mean", "pool used (mean)", "{:.0%}"),
    ("pool_used_max", "pool used (max)", "{:.0%}"),
    ("running_mean", "running (mean)", "{:.1f}"),
    ("waiting_mean", "waiting (mean)", "{:.1f}"),
    ("prefix_hit_rate", "prefix hit rate", "{:.1%}"),
    ("prefill_tokens", "prefill tokens computed", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
    ("load_1m", "machine load avg (1 min)", "{:.2f}"),
]
# paired ratios: (name, numerator arm, denominator arm, per-run value)
RATIOS = [
    ("tok_s", "on", "off", "out_tok_per_s"),
    ("tok_cpu", "on", "off", "out_tok_per_cpu_s"),
    ("ctl_tok_s", "on", "ctl", "out_tok_per_s"),
    ("ctl_tok_cpu", "on", "ctl", "out_tok_per_cpu_s"),
]


def spread(xs: list[float]) -> dict[str, float]:
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


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


def _within(s: dict[str, float], x: float = 1.0) -> bool:
    return s["min"] <= x <= s["max"]


def run_config(name: str, budget: str, model: Path, spec: ModelSpec, w: Workload, args: argparse.Namespace) -> dict:
    pred = predicted_gain(spec, parse_size(budget, "budget"), args)
    print(
        f"\n== {name}: KV budget {budget} -> dense {pred['tokens_dense']} tokens, elided {pred['tokens_elided']} "
        f"tokens (planner gain x{pred['gain']:.3f}); {w.sessions} sessions x {w.turns} turns, {args.concurrency} "
        f"at a time, each up to {w.max_context} tokens ({args.concurrency * w.max_context} tokens in flight)",
        flush=True,
    )
    arms = ARMS if args.control else ARMS[:2]
    runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    discarded: list[dict] = []
    for i in range(args.runs):
        for slot, arm in enumerate(arms[i % len(arms) :] + arms[: i % len(arms)]):  # each arm takes each slot
            for attempt in range(args.retries + 1):
                r = one_run(model, budget, arm != "off", w, args, f"{name.split()[0]}-{arm}-{i}-{attempt}")
                r.update(round=i, slot=slot, attempt=attempt, disturbed=r["server_cpu_util"] < args.min_cpu)
                print(
                    f"  round {i} slot {slot} {arm:3s}: {r['pages_total']} pages, {r['makespan_s']:.2f} s, "
                    f"{r['output_tokens']} out / {r['prompt_tokens']} prompt tokens, {r['out_tok_per_s']:.1f} tok/s, "
                    f"{r['out_tok_per_cpu_s']:.1f} tok/CPU-s, server {r['server_cpu_util']:.2f} cores, client "
                    f"{r['client_cpu_util']:.2f}, pool {r['pool_used_mean']:.0%} (max {r['pool_used_max']:.0%}), "
                    f"hit {r['prefix_hit_rate']:.1%}, prefill {r['prefill_tokens']:.0f}, preempt "
                    f"{r['preemptions']:.0f}, errors {r['num_errors']}, load {r['load_1m']:.2f}"
                    + (" -> DISTURBED" if r["disturbed"] else ""),
                    flush=True,
                )
                if not r["disturbed"] or attempt == args.retries:
                    break
                discarded.append({"arm": arm, **r})
            runs[arm].append(r)
    summary = {arm: {k: spread([r[k] for r in rs]) for k, _, _ in METRICS} for arm, rs in runs.items()}
    paired: dict[str, list[float]] = {}
    for key, a, b, metric in RATIOS:
        if a in runs and b in runs:
            paired[key] = [x[metric] / y[metric] for x, y in zip(runs[a], runs[b], strict=True)]
    ratios = {key: spread(v) for key, v in paired.items()}
    every = [r for rs in runs.values() for r in rs]
    equal = {
        "output_tokens": sorted({r["output_tokens"] for r in every}),
        "prompt_tokens": sorted({r["prompt_tokens"] for r in every}),
        "expected_output_tokens": w.output_total,
        "expected_prompt_tokens": w.prompt_total,
    }
    equal["ok"] = equal["output_tokens"] == [w.output_total] and equal["prompt_tokens"] == [w.prompt_total]
    t, c = ratios["tok_s"], ratios["tok_cpu"]
    print(
        f"  -> on/off (median, min..max of {args.runs} paired rounds): tok/s x{t['median']:.3f} ({t['min']:.3f}.."
        f"{t['max']:.3f}), tok per CPU-s x{c['median']:.3f} ({c['min']:.3f}..{c['max']:.3f}); planner capacity "
        f"x{pred['gain']:.3f}; equal tokens in every run: {equal['ok']}",
        flush=True,
    )
    if args.control:
        t, c = ratios["ctl_tok_s"], ratios["ctl_tok_cpu"]
        print(
            f"  -> control on/ctl: tok/s x{t['median']:.3f} ({t['min']:.3f}..{t['max']:.3f}), tok per CPU-s "
            f"x{c['median']:.3f} ({c['min']:.3f}..{c['max']:.3f}); 1.0 within spread: "
            f"{_within(t) and _within(c)}",
            flush=True,
        )
    return {
        "name": name,
        "budget": budget,
        "predicted": pred,
        "ratios": ratios,
        "paired": paired,
        "equal_work": equal,
        "summary": summary,
        "runs": runs,
        "discarded": discarded,
    }


# ---- report --------------------------------------------------------------------------------------------


def _r(s: dict[str, float]) -> str:
    return f"x{s['median']:.3f} ({s['min']:.2f}..{s['max']:.2f})"


def markdown(results: list[dict], w: Workload, args: argparse.Namespace, command: str, elapsed: float) -> str:
    loads = [r["load_1m"] for res in results for rs in res["runs"].values() for r in rs]
    arms = list(results[0]["runs"])
    lines = [
        "# Serving benchmark: elision on vs off, same KV byte budget",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores shared with other work; 1-minute load average over the runs "
        f"{min(loads):.2f} / {statistics.median(loads):.2f} / {max(loads):.2f} (min / median / max). "
        f"Wall time {elapsed:.0f} s.",
        "",
        f"Model: tiny (make-tiny, 12 layers, 5 index-K producers), KV {args.kv_format}, index-K {args.index_format}, "
        f"page {args.page_size} tokens; `dsakv serve` colocated, prefix cache on, 1 torch thread, a fresh server per "
        f"run. Script (identical in every run): {w.sessions} agentic sessions, {args.concurrency} at a time (closed "
        f"loop, streaming, greedy), each a {w.system_tokens}-token system prefix shared by all sessions, "
        f"{w.first_user_tokens} user tokens, then {w.turns} turns of {w.output_tokens} output + {w.user_tokens} new "
        f"user tokens (turn t's prompt = turn t-1's prompt + output + user tokens; up to {w.max_context} tokens): "
        f"{w.requests} requests, {w.output_total} output and {w.prompt_total} prompt tokens per run. Before it, "
        f"{args.concurrency} warm-up requests of {WARMUP_PROMPT_TOKENS} + {WARMUP_OUTPUT_TOKENS} tokens, not measured. "
        f"{args.runs} rounds; each round runs every arm once ({', '.join(arms)}; ctl = elision on again, the "
        "control), the order rotating so that each arm takes each slot.",
        "",
        "Ratios are paired within a round and given as the median (min..max) over rounds. `tok/s` = output tokens / "
        "the script's makespan (wall clock: sensitive to other load on the machine); `tok per CPU-s` = output tokens "
        "/ the server process's CPU seconds over the script (the work the tokens cost). A run whose server got less "
        f"than {args.min_cpu:g} of a core is rerun (up to {args.retries} times; replaced runs are in serve.json, "
        "`discarded`). Method and the diagnosis of the earlier x1.26: [serve-method.md](serve-method.md).",
        "",
        "| budget | planner capacity gain | on / off tok/s | on / off tok per CPU-s | control on / ctl tok/s | "
        "control on / ctl tok per CPU-s | equal tokens |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for res in results:
        p, q = res["predicted"], res["ratios"]
        ctl = (_r(q["ctl_tok_s"]), _r(q["ctl_tok_cpu"])) if "ctl_tok_s" in q else ("-", "-")
        lines.append(
            f"| {res['name']} | x{p['gain']:.3f} ({p['tokens_dense']} -> {p['tokens_elided']} tokens) | "
            f"{_r(q['tok_s'])} | {_r(q['tok_cpu'])} | {ctl[0]} | {ctl[1]} | "
            f"{'yes' if res['equal_work']['ok'] else 'NO'} |"
        )
    lines.append("")
    if "ctl_tok_s" in results[0]["ratios"]:
        for res in results:
            q = res["ratios"]
            ok = _within(q["ctl_tok_s"]) and _within(q["ctl_tok_cpu"])
            lines.append(
                f"- {res['name']}: control reads 1.0 within its spread: **{'yes' if ok else 'NO'}**; on / off "
                f"tok/s median x{q['tok_s']['median']:.3f}, inside the control's spread "
                f"({q['ctl_tok_s']['min']:.2f}..{q['ctl_tok_s']['max']:.2f}): "
                f"{'yes' if _within(q['ctl_tok_s'], q['tok_s']['median']) else 'no'}."
            )
        lines.append("")
    for res in results:
        lines += [
            f"## {res['name']}",
            "",
            "Per arm: min / median / max over rounds.",
            "",
            "| metric | " + " | ".join(f"elision {a}" if a != "ctl" else "ctl (on again)" for a in arms) + " |",
            "| --- |" + " --- |" * len(arms),
        ]
        rows = [
            "| runs kept still disturbed / replaced | "
            + " | ".join(
                f"{sum(r['disturbed'] for r in res['runs'][a])} / {sum(d['arm'] == a for d in res['discarded'])}"
                for a in arms
            )
            + " |",
            "| pool pages (tokens) | "
            + " | ".join(f"{res['runs'][a][0]['pages_total']} ({res['runs'][a][0]['capacity_tokens']})" for a in arms)
            + " |",
        ]
        for key, label, fmt in METRICS:
            cells = [" / ".join(fmt.format(res["summary"][a][key][x]) for x in ("min", "median", "max")) for a in arms]
            rows.append(f"| {label} | " + " | ".join(cells) + " |")
        lines += rows
        lines.append("")
    lines += ["![throughput vs capacity](serve.png)", ""]
    return "\n".join(lines)


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    names = [r["name"].replace(" (", "\n(") for r in results]
    x = list(range(len(results)))
    has_ctl = "ctl_tok_s" in results[0]["ratios"]
    bars: list[tuple[str, str | None, str]] = [
        ("planner: capacity gain (tokens)", None, "#8fb3d9"),
        ("on / off: output tok/s", "tok_s", "#e69f55"),
        ("on / off: tok per server CPU-s", "tok_cpu", "#6aa56a"),
    ]
    if has_ctl:
        bars += [
            ("control on / ctl: tok/s", "ctl_tok_s", "#bbbbbb"),
            ("control on / ctl: tok per CPU-s", "ctl_tok_cpu", "#777777"),
        ]
    width = 0.8 / len(bars)
    top = 1.0
    for j, (label, key, color) in enumerate(bars):
        pos = [i + (j - (len(bars) - 1) / 2) * width for i in x]
        if key is None:
            vals = [r["predicted"]["gain"] for r in results]
            ax1.bar(pos, vals, width, label=label, color=color)
            top = max(top, *vals)
            continue
        s = [r["ratios"][key] for r in results]
        vals = [v["median"] for v in s]
        err = [[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]]
        top = max(top, *(v["max"] for v in s))
        ax1.bar(pos, vals, width, yerr=err, capsize=3, label=label, color=color)
    ax1.axhline(1.0, color="k", lw=0.8)
    ax1.set_xticks(x, names, fontsize=8)
    ax1.set_ylabel("ratio (bar: median of paired rounds; error bar: min..max)")
    ax1.set_ylim(0.5, top + 0.2)
    ax1.legend(loc="upper right", fontsize=7)
    ax1.set_title("same KV byte budget, same request script: capacity vs throughput", fontsize=10)
    arms = list(results[0]["runs"])
    colors = {"on": "#4c72b0", "off": "#aaaaaa", "ctl": "#86a8d6"}
    w = 0.8 / len(arms)
    for j, arm in enumerate(arms):
        s = [r["summary"][arm]["out_tok_per_s"] for r in results]
        ax2.bar(
            [i + (j - (len(arms) - 1) / 2) * w for i in x],
            [v["median"] for v in s],
            w,
            yerr=[[v["median"] - v["min"] for v in s], [v["max"] - v["median"] for v in s]],
            capsize=4,
            label=f"elision {arm}" if arm != "ctl" else "ctl (elision on again)",
            color=colors[arm],
        )
    ax2.set_xticks(x, names, fontsize=8)
    ax2.set_ylabel("output tokens / s over the script (median, min..max)")
    ax2.legend(fontsize=8)
    ax2.set_title("throughput per arm", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="checkpoint DIR (default: a fresh `dsakv make-tiny` in a temp dir)")
    p.add_argument("--runs", type=int, default=4, help="rounds, each running every arm once (default 4)")
    p.add_argument("--sessions", type=int, default=16, help="sessions in the request script (default 16)")
    p.add_argument("--concurrency", type=int, default=16, help="sessions at a time (default 16)")
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
        default=0.85,
        help="a run whose server got fewer CPU cores than this over the script (other work on the machine) is "
        "disturbed: rerun it (default 0.85)",
    )
    p.add_argument("--retries", type=int, default=2, help="reruns of a disturbed run (default 2)")
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a control arm: elision on twice (on / ctl must read 1.0 within its spread; default on)",
    )
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one run's script may take (default 300)")
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
        args.sessions,
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
    # machine warm-up, not reported: the bench's very first server start pays for cold file caches and imports
    prime = one_run(model, configs[0][1], True, replace(w, sessions=args.concurrency, turns=1), args, "prime")
    print(f"prime run (discarded): {prime['makespan_s']:.2f} s, errors {prime['num_errors']}", flush=True)
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
