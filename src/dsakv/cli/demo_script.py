"""What `dsakv demo` runs against its deployment (cli/demo_cmd.py starts it): the demo's engine configuration and
prompts, the checked batch of completions and the streamed chat against a colocated Engine, the prefill's
prefix-cache check and the table of the KV each PP stage moved. Imports torch only inside its functions."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dsakv.cli import options
from dsakv.config import CacheConfig, EngineConfig, LayoutConfig, PoolConfig
from dsakv.errors import ConfigError
from dsakv.util import ceil_div

if TYPE_CHECKING:
    from dsakv.disagg.protocol.messages import DecodeHealth, PrefillHealth

DEMO_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]
DEMO_CHAT = [{"role": "user", "content": "Hello, sparse attention!"}]
HOST_TIER_RATIO = 2.0
DEMO_LAYOUT = LayoutConfig(page_size=16)


def demo_engine_config(args: argparse.Namespace, host_tier: bool) -> EngineConfig:
    """The decode worker's (and the colocated reference's) engine: the demo's layout and pool, with the host tier
    (write_back, ratio HOST_TIER_RATIO) when `host_tier`."""
    cache = CacheConfig(hicache_ratio=HOST_TIER_RATIO, write_policy="write_back") if host_tier else CacheConfig()
    return EngineConfig(
        layout=options.layout_config(args, DEMO_LAYOUT), pool=PoolConfig(num_pages=args.num_pages), cache=cache
    )


def _say(args: argparse.Namespace, text: str) -> None:
    print(text, file=sys.stderr if args.json else sys.stdout, flush=True)


def demo_prompts(n: int) -> list[list[int]]:
    """n deterministic prompts: half share a 32-token prefix, lengths 8..60 (longer than the tiny index_topk 16)."""
    shared = [(7 * i + 3) % 500 + 2 for i in range(32)]
    out = []
    for i in range(n):
        tail = [(13 * i + 5 * j + 11) % 500 + 2 for j in range(4 + 7 * i % 29)]
        out.append(shared + tail if i % 2 == 0 else tail + [5, 6, 7, 8])
    return out


def _complete(url: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    import httpx

    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    r.raise_for_status()
    return dict(r.json()["choices"][0])


def _prefill_health(addr: str) -> PrefillHealth:
    from dsakv.disagg.protocol.messages import prefill_health

    return prefill_health(addr, timeout=10)


def _decode_health(addr: str) -> DecodeHealth:
    from dsakv.disagg.protocol.messages import decode_health

    return decode_health(addr, timeout=10)


def _script(args: argparse.Namespace, url: str, model_dir: Path, ports: dict[str, int], status: Any) -> dict[str, Any]:
    """The scripted requests; returns the summary (checks included)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from dsakv.engine.engine import Engine
    from dsakv.engine.request import SamplingParams

    out: dict[str, Any] = {"router": url}
    prompts = demo_prompts(args.requests)
    if args.speculative_num_steps:  # two prompts the fitted MTP layer predicts well (the others: ~0 acceptance)
        from dsakv.engine.mtp_fit import fit_prompts
        from dsakv.spec.model import ModelSpec

        prompts += fit_prompts(ModelSpec.from_path(model_dir).vocab_size, 2)
    status.update(f"sending {len(prompts)} concurrent completions through the router")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        choices = list(pool.map(lambda p: _complete(url, p, args.max_tokens), prompts))
    dt = time.perf_counter() - t0
    got = [list(c["token_ids"]) for c in choices]
    _say(
        args,
        f"[1] {len(prompts)} concurrent POST /v1/completions (greedy, prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens, half sharing a 32-token prefix)",
    )
    _say(args, f"    -> {sum(map(len, got))} tokens in {dt:.2f} s; first: {got[0]}")

    status.update("streaming a chat completion")
    _say(args, f"[2] POST /v1/chat/completions (stream) {DEMO_CHAT[0]['content']!r}")
    chat = {
        "messages": DEMO_CHAT,
        "max_tokens": args.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    chunks, text, done = 0, "", False
    chat_ids: list[int] = []
    chat_prompt: list[int] = []
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=chat, timeout=120) as resp:
        resp.raise_for_status()
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: {"):
                ev = json.loads(line[6:])
                if "error" in ev:
                    raise ConfigError(f"the streamed chat failed: {ev['error']}")
                chat_prompt = ev.get("prompt_token_ids") or chat_prompt
                ch = ev["choices"][0]
                chunks += 1
                text += ch["delta"].get("content") or ""
                chat_ids += ch.get("token_ids", [])
    _say(args, f"    -> {chunks} SSE chunks, {len(chat_ids)} tokens, [DONE]={done}")
    out.update(chat_ids=chat_ids, chat_prompt_ids=list(chat_prompt), chat_text=text, chat_stream_done=done)

    status.update("running the same requests on a colocated engine")
    ref_engine = Engine(model_dir, demo_engine_config(args, args.host_tier))
    params = SamplingParams(max_new_tokens=args.max_tokens, ignore_eos=True)
    ref = ref_engine.generate([*prompts, list(chat_prompt)], params)
    matched = sum(a == b for a, b in zip([*got, chat_ids], ref, strict=True))
    total = len(ref)
    _say(
        args,
        f"[3] colocated engine, same checkpoint and layout{' + host tier' if args.host_tier else ''}: "
        f"{matched}/{total} requests token-for-token identical",
    )
    out.update(
        completion_ids=got[0],
        reference_ids=ref[0],
        tokens_equal_colocated=matched == total,
        requests=total,
        requests_matched=matched,
    )
    if ref_engine.cache_stats():
        cs = ref_engine.cache_stats() or {}
        out["colocated_cache"] = {k: cs[k] for k in ("hit_tokens", "host_hit_tokens", "offload_bytes") if k in cs}

    status.update("reading transfer figures from the prefill stages")
    prompt_pages = sum(ceil_div(len(p), args.page_size) for p in [*prompts, list(chat_prompt)])
    rows = []
    for k in range(args.pp_size):
        h = _prefill_health(f"127.0.0.1:{ports['prefill'] + k}")
        rows.append({"stage": k, "layers": h.layers, **(asdict(h.transfer) if h.transfer else {})})
    _print_transfers(args, rows, model_dir, prompt_pages)
    out["transfer"] = rows
    if args.prefill_prefix_cache:
        out["prefill_prefix_cache"] = pc = _prefill_cache_check(args, url, ports["prefill"], prompts[0], got[0])
    dec = _decode_health(f"127.0.0.1:{ports['decode']}")
    out["decode_integrity"] = dec.integrity
    if args.speculative_num_steps:
        out["speculative"] = sp = dec.spec or {}
        _say(
            args,
            f"    MTP (K={args.speculative_num_steps}) on the decode, drafting from its first step on the prefill's "
            f"draft KV: {sp.get('spec_accepted_tokens', 0):g} of {sp.get('spec_draft_tokens', 0):g} drafts accepted "
            f"(rate {sp.get('spec_acceptance_rate', 0):.3f}), {sp.get('spec_mean_accepted_length', 0):.2f} tokens "
            f"per verify step",
        )

    metrics: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            metrics[name] = float(value)
    keep = (
        "dsakv_requests_total",
        "dsakv_generation_tokens_total",
        "dsakv_pool_pages_total",
        "dsakv_pool_pages_used",
        "dsakv_pairs_ready",
        "dsakv_decode_workers_up",
        "dsakv_prefill_workers_up",
    )
    shown = {k: metrics[k] for k in keep if k in metrics}
    _say(args, "[5] GET /metrics: " + ", ".join(f"{k[6:]}={v:g}" for k, v in shown.items()))
    _say(
        args,
        f"    decode worker integrity: {dec.integrity} ({dec.pages_used} of "
        f"{dec.pages_total} pages held{', by the prefix cache' if args.host_tier else ''})",
    )
    out["metrics"] = shown
    out["ok"] = bool(matched == total and done and len(chat_ids) == args.max_tokens and dec.integrity == "ok")
    if args.prefill_prefix_cache:
        out["ok"] = out["ok"] and pc["repeat_equal"] and pc["integrity"] == "ok"
    if args.speculative_num_steps:
        out["ok"] = out["ok"] and out["speculative"].get("spec_verify_steps", 0) > 0
    return out


def _prefill_cache_check(
    args: argparse.Namespace, url: str, port: int, prompt: list[int], want: list[int]
) -> dict[str, Any]:
    """Send request 0 again (its prefix is in the prefill's cache by now) and read stage 0's prefix-cache counters
    (the prefill "health" RPC) before and after."""
    before = (_prefill_health(f"127.0.0.1:{port}").prefix_cache or {}).get("hit_tokens", 0)
    again = list(_complete(url, prompt, args.max_tokens)["token_ids"])
    h = _prefill_health(f"127.0.0.1:{port}")
    stats = h.prefix_cache or {}
    out = {
        "hit_tokens": stats.get("hit_tokens", 0),
        "lookup_tokens": stats.get("lookup_tokens", 0),
        "inserted_tokens": stats.get("inserted_tokens", 0),
        "repeat_hit_tokens": stats.get("hit_tokens", 0) - before,
        "repeat_equal": again == want,
        "cache_pages": h.cache_pages or 0,
        "integrity": h.integrity,
    }
    _say(
        args,
        f"    prefill prefix cache (stage 0): {out['hit_tokens']} of {out['lookup_tokens']} looked-up prompt tokens "
        f"hit, {out['cache_pages']} pages cached; request 0 again: {out['repeat_hit_tokens']} of {len(prompt)} "
        f"prompt tokens reused on every stage, tokens {'identical' if again == want else 'DIFFERENT'}",
    )
    return out


def _print_transfers(args: argparse.Namespace, rows: list[dict[str, Any]], model_dir: Path, pages: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from dsakv.spec.model import ModelSpec

    spec = ModelSpec.from_path(model_dir)
    layout = options.layout_config(args, DEMO_LAYOUT)
    t = Table(title="[4] KV moved prefill -> decode (each PP stage sends its own layers)", title_justify="left")
    for col in ("stage", "layers", "index-K layers", "transfers", "bytes", "layout figure", "seconds", "MB/s"):
        t.add_column(col, justify="left" if col in ("layers", "index-K layers") else "right")
    for r in rows:
        lo, hi = (r.get("layers") or [0, spec.num_layers - 1])[:2]
        drafts = 1 if args.speculative_num_steps and hi == spec.num_layers - 1 else 0  # MTP: the last stage's
        lay = layout.layout(spec, lo, hi + 1, draft_layers=drafts)
        idx = [k.layer for k in lay.keys if k.kind.value == "index_k"]
        nbytes, secs = int(r.get("bytes", 0)), float(r.get("seconds", 0.0))
        t.add_row(
            str(r["stage"]),
            f"{lo}-{hi}" + (f" +draft {spec.num_layers}" if drafts else ""),
            ",".join(map(str, idx)),
            str(r.get("count", 0)),
            f"{nbytes:,}",
            f"{pages * lay.bytes_per_page:,}",
            f"{secs:.3f}",
            f"{nbytes / secs / 1e6:.1f}" if secs else "-",
        )
    Console(file=sys.stderr if args.json else sys.stdout, width=160).print(t)
    _say(args, f"    layout figure = {pages} prompt pages x the stage's bytes per page (index-K only on producers)")
