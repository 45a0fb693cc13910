"""`dsakv generate`: run the reference DSA engine on a checkpoint and print the generated token ids.

Imports torch, transformers and the engine inside run() only (`dsakv --help` stays light).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dsakv.cli import options
from dsakv.cli.validate import validate_checkpoint, validate_generate, validate_pool
from dsakv.errors import ConfigError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.description = (
        "Run the reference DSA engine (continuous batching, chunked prefill, paged KV pool with index-K elision) "
        "on a GLM-5.x / DeepSeek-V3.2 checkpoint and print each prompt's generated token ids. All prompts run "
        "together in one engine. Greedy by default; --temperature > 0 samples (seeded with --seed)."
    )
    p.epilog = (
        "examples:\n"
        "  dsakv make-tiny /tmp/tiny\n"
        "  dsakv generate --model /tmp/tiny --prompt-ids 5,6,7,8 --prompt-ids 9,10 --max-new-tokens 16\n"
        "  dsakv generate --model /tmp/tiny --prompt-ids 5,6,7 --no-elide --kv-format fp8-656 --index-format fp8-132\n"
        "  dsakv generate --model /tmp/tiny --prompt-ids 5,6,7 --temperature 0.8 --top-p 0.95 --seed 1\n"
        "  dsakv generate --model DIR_WITH_TOKENIZER --prompt 'Hello'   (text needs a tokenizer in DIR)\n"
        "  dsakv generate --model /tmp/tiny --prompt-ids 5,6,7,8 --pp-size 2 --pp-partition 7,5   (2 processes)\n"
        "  dsakv generate --model /tmp/tiny --prompt-ids 5,6,7,8 --pp-size 2 --tp-size 2   (2 stages x 2 TP ranks)\n"
        "  dsakv generate --model /tmp/tiny --prompt-ids 5,6,7,8,9 --prompt-ids 5,6,7,8,10 --sequential \\\n"
        "      --page-size 4 --hicache-ratio 2 --hicache-write-policy write_back --stats\n"
        "\n"
        "output: one line per prompt, '#i prompt=N finish=REASON ids=a,b,c' (plus 'text:' with a tokenizer);\n"
        "--json prints a list of {prompt_ids, output_ids, finish_reason[, text]} instead."
    )
    p.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (config.json + safetensors)")
    src = p.add_argument_group("prompts (give at least one; repeat for a batch)")
    src.add_argument("--prompt-ids", action="append", default=[], metavar="IDS", help="token ids, e.g. 1,2,3")
    src.add_argument("--prompt", action="append", default=[], metavar="TEXT", help="text (needs a tokenizer in DIR)")
    smp = p.add_argument_group("sampling")
    smp.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate per prompt (default 32)")
    smp.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); > 0 samples")
    smp.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    smp.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens (default off)")
    smp.add_argument("--seed", type=int, default=None, help="seed of each request's sampler (default random)")
    smp.add_argument("--stop-token-ids", default="", metavar="IDS", help="extra stop tokens, e.g. 7,8")
    smp.add_argument("--ignore-eos", action="store_true", help="do not stop at the checkpoint's eos token")
    kv = p.add_argument_group("KV pool (size it with --kv-budget, --num-pages or --max-tokens)")
    options.add_layout_arguments(kv)
    options.add_pool_arguments(kv)
    hc = options.add_cache_arguments(p)
    hc.add_argument(
        "--sequential", action="store_true", help="run the prompts one after another (later ones reuse prefixes)"
    )
    run_g = p.add_argument_group("engine")
    options.add_engine_arguments(run_g)
    options.add_speculative_argument(run_g)
    options.add_parallel_arguments(run_g)
    options.add_colocated_pipeline_arguments(run_g)
    options.add_hisparse_arguments(p)
    run_g.add_argument("--json", action="store_true", help="print JSON")
    run_g.add_argument("--stats", action="store_true", help="also print pool and token counters (stderr)")


def parse_ids(text: str, what: str) -> list[int]:
    parts = [t.strip() for t in text.replace(" ", ",").split(",") if t.strip()]
    try:
        ids = [int(t) for t in parts]
    except ValueError:
        raise ConfigError(f"{what} {text!r} must be comma-separated token ids, e.g. 1,2,3") from None
    if any(i < 0 for i in ids):
        raise ConfigError(f"{what} {text!r}: token ids are integers >= 0")
    return ids


def load_tokenizer(model_dir: Path):  # type: ignore[no-untyped-def]
    if not any((model_dir / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"--prompt needs a tokenizer in {str(model_dir)!r} ({' / '.join(TOKENIZER_FILES)}) and there is "
            "none: pass token ids with --prompt-ids 1,2,3 instead (checkpoints from `dsakv make-tiny` have no "
            "tokenizer), or copy the model's tokenizer files into the directory"
        )
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


def step_ranks(engine: Any, lockstep: bool, ranks: Any = None) -> Iterator[Any]:
    """Step the engine until no request is unfinished (with `lockstep`, on any DP rank: an idle rank runs its
    share of each step's expert-parallel collectives with no tokens); yields every step's outputs. TP `ranks`
    with MTP or HiSparse: every step's drafts and accepted counts, HiSparse rows copied and hot-buffer residency
    are checked equal on every rank (engine/tp_spec.agree_step: RanksDiverged)."""
    from dsakv.engine.dp import LockstepEngine

    if isinstance(engine, LockstepEngine):  # DP attention x PP (pipeline/dp_stage.py): rounds until none is active
        from dsakv.engine.ranks import RankDown

        while True:
            yield from engine.step()
            if engine.down is not None:
                raise RankDown(engine.down)
            if engine.rows and not any(r["active"] for r in engine.rows):
                return
    if not lockstep:
        from dsakv.engine.tp_spec import agree_step

        while engine.has_unfinished():
            outs = engine.step()
            if ranks is not None:
                agree_step(engine, ranks)
            yield from outs
        return
    from dsakv.model.parallel import any_rank, idle_forward

    while True:
        active = engine.has_unfinished()
        if not any_rank(active):
            return
        if active:
            yield from engine.step()
        else:
            idle_forward(engine.model)


def check_engine_args(args: argparse.Namespace) -> Path:
    """The checks `dsakv generate` runs on its engine options before anything loads (dsakv.LLM runs the same):
    a checkpoint directory, the option ranges (cli/validate.py), the pool against the checkpoint."""
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} has no config.json: pass a checkpoint directory")
    validate_generate(args)
    validate_pool(args, validate_checkpoint(model_dir))
    return model_dir


def check_tp_split(args: argparse.Namespace, model_dir: Path) -> None:
    """Refuse a TP size the checkpoint cannot be split over before starting any rank."""
    if args.tp_size > 1:
        from dsakv.model.loader import load_config
        from dsakv.model.parallel import divide, shard_config

        cfg = load_config(model_dir)
        if args.enable_dp_attention:
            divide("n_routed_experts", int(cfg.get("n_routed_experts") or 0), args.ep_size, "--ep-size")
        else:
            shard_config(cfg, args.tp_size)


def build_engine(args: argparse.Namespace, ranks: Any, model_dir: Path, loaded: Any = None) -> Any:
    """This rank's Engine for the parsed options: DP attention (own pool, MoE expert-parallel), a TP shard, or
    the whole model (`loaded`: a (spec, model) already in memory, for one rank)."""
    import torch

    from dsakv.engine.engine import Engine

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    dp = args.dp_size if args.enable_dp_attention else 1
    if dp > 1:  # DP attention: each rank the whole attention of its own requests; MoE expert-parallel
        from dsakv.model.loader import load_model
        from dsakv.model.parallel import attach_ep

        spec, model = load_model(model_dir, dtype=dtype)
        return Engine(
            (spec, attach_ep(model, ranks.rank, args.ep_size)), options.engine_config(args), model_dir=model_dir
        )
    if ranks.size > 1:  # a TP shard (with MTP: the draft layer sharded the same way)
        from dsakv.engine.tp_spec import tp_engine

        return tp_engine(model_dir, ranks.group, options.engine_config(args))
    if loaded is not None:
        return Engine(loaded, options.engine_config(args), model_dir=model_dir)
    return Engine(model_dir, options.engine_config(args))


def run(args: argparse.Namespace) -> int:
    model_dir = Path(args.model)
    if not (model_dir / "config.json").is_file():
        raise ConfigError(f"--model {args.model!r} has no config.json: pass a checkpoint directory")
    from dsakv.spec.v4 import is_v4

    if is_v4(args.model):
        from dsakv.cli.generate_v4 import run_v4

        v4_prompts = [parse_ids(t, "--prompt-ids") for t in args.prompt_ids]
        v4_prompts += [list(load_tokenizer(model_dir).encode(t)) for t in args.prompt]
        if not v4_prompts or any(not p for p in v4_prompts):
            raise ConfigError("no prompt, or an empty one: give --prompt-ids 1,2,3 (repeatable) or --prompt TEXT")
        return run_v4(args, v4_prompts, parse_ids(args.stop_token_ids, "--stop-token-ids"))
    check_engine_args(args)
    prompts = [parse_ids(t, "--prompt-ids") for t in args.prompt_ids]
    tokenizer = None
    if args.prompt:
        tokenizer = load_tokenizer(model_dir)
        prompts += [list(tokenizer.encode(t)) for t in args.prompt]
    if not prompts:
        raise ConfigError("no prompt: give --prompt-ids 1,2,3 (repeatable) or --prompt TEXT")
    if any(not p for p in prompts):
        raise ConfigError("a prompt is empty: every prompt needs at least one token")

    from dsakv.engine.ranks import start_ranks
    from dsakv.engine.request import SamplingParams

    check_tp_split(args, model_dir)
    if args.pp_size > 1:  # what a colocated pipeline refuses: before any rank or stage starts
        from dsakv.pipeline.colocated import check_refusal

        check_refusal(options.engine_config(args), args.pp_size)
    dp = args.dp_size if args.enable_dp_attention else 1
    if dp > 1 and args.pp_size > 1:  # DP attention x PP: each later stage's EP group gets a port (pipeline/dp_stage)
        from dsakv.pipeline.dp_stage import reserve_stage_ports

        reserve_stage_ports(args.pp_size)
    label = "DP" if dp > 1 and args.pp_size > 1 else "TP"
    ranks = start_ranks(args.tp_size, getattr(args, "_argv", None) or sys.argv[1:], label=label)
    seed = args.seed
    if ranks.size > 1 and seed is None and args.temperature > 0:  # one draw for every rank
        import random

        seed = ranks.broadcast(random.randrange(2**63))
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=seed,
        stop_token_ids=tuple(parse_ids(args.stop_token_ids, "--stop-token-ids")),
        ignore_eos=args.ignore_eos,
    )
    if args.pp_size > 1:  # stage 0 of a colocated pipeline; a stage process runs its stage and exits here
        from dsakv.pipeline.colocated import start_pipeline
        from dsakv.pipeline.dp_stage import pipeline_lockstep

        argv = getattr(args, "_argv", None) or sys.argv[1:]
        ec, pipe = options.engine_config(args), options.pipeline_config(args)
        piped = start_pipeline(model_dir, ec, pipe, argv, ranks, dp=dp > 1)
        if isinstance(piped, int):  # a later stage (or one of its TP / EP ranks): stopped; its group leaves
            if piped == 0:
                ranks.close()
            return piped
        try:  # DP x PP: every DP rank's stage 0 stops its own pipeline before the DP group leaves
            engine = pipeline_lockstep(piped, ranks) if dp > 1 else piped
            return _generate(args, ranks, engine, prompts, params, dp, tokenizer, piped.close if dp > 1 else None)
        finally:
            piped.close()
    engine = build_engine(args, ranks, model_dir)
    try:
        return _generate(args, ranks, engine, prompts, params, dp, tokenizer)
    except Exception as e:  # a collective broken by a dead rank: RankDown naming it and its exit status
        if ranks.size == 1:
            raise
        err = ranks.guard(e)
        if ranks.down is not None:
            ranks.close()  # kills the surviving ranks; raises RankDown
        raise err from e


def _generate(
    args: argparse.Namespace,
    ranks: Any,
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    dp: int,
    tokenizer: Any,
    before_close: Any = None,
) -> int:
    mine = [i for i in range(len(prompts)) if i % dp == ranks.rank % dp]  # DP rank r: prompts r, r + dp, ...
    ids: dict[int, str] = {}
    final = {}
    import time

    t0 = time.perf_counter()
    batches = [[i] for i in mine] if args.sequential else [mine]
    if dp > 1 and args.sequential:  # every DP rank steps the same rounds (a rank out of prompts idles through)
        batches += [[]] * (-(-len(prompts) // dp) - len(batches))
    for batch in batches:
        ids.update({i: engine.add_request(prompts[i], params) for i in batch})
        for out in step_ranks(engine, dp > 1, ranks):
            if out.finished:
                final[out.request_id] = out
    seconds = time.perf_counter() - t0
    engine.check_integrity()
    generated = ranks.gather(engine.stats().generated_tokens) if dp > 1 else [engine.stats().generated_tokens]
    # DP x PP (a LockstepEngine): per DP rank, the rounds it ran no forward in (IDLE down its pipeline)
    idle = ranks.gather(engine.idle_forwards) if dp > 1 and hasattr(engine, "idle_forwards") else None
    ranks_steps = ranks.gather(engine.stats().steps) if idle is not None else None
    hs_ranks = None  # TP with HiSparse: every rank's own pool, its counters, residency and pages held at the end
    if dp == 1 and ranks.size > 1 and engine.hisparse_stats() is not None:
        hs = {**engine.hisparse_stats(), "residency": engine.hisparse.residency_digest()}
        hs_ranks = ranks.gather(hs | {"pages_used": engine.stats().pages_used})
    got = {i: (list(final[rid].output_ids), str(final[rid].finish_reason), final[rid].error) for i, rid in ids.items()}
    where: dict[int, int] = {}  # DP attention: prompt -> the DP rank that ran it (as that rank reports it)
    if dp > 1:
        parts = ranks.gather((ranks.rank, got))
        where = {i: r for r, part in parts for i in part}
        got = {i: v for _, part in parts for i, v in part.items()}
    else:
        ranks.agree(got, "output tokens")
    if before_close is not None:
        before_close()
    ranks.close()
    if not ranks.lead:  # a rank process: its group is closed (it exits without finalization: cli/main.py)
        return 0
    rows = []
    for i, prompt in enumerate(prompts):
        out_ids, reason, error = got[i]
        row: dict[str, Any] = {"prompt_ids": prompt, "output_ids": out_ids, "finish_reason": reason}
        if i in where:
            row["dp_rank"] = where[i]
        if error:
            row["error"] = error
        if tokenizer is not None:
            row["text"] = tokenizer.decode(out_ids)
        rows.append(row)
        if not args.json:
            print(f"#{i} prompt={len(prompt)} finish={reason} ids={','.join(map(str, out_ids))}")
            if "text" in row:
                print(f"   text: {row['text']!r}")
            if error:
                print(f"   error: {error}")
    if args.json:
        print(json.dumps(rows))
    if args.stats:
        fig = {"tp": args.tp_size, "dp": dp, "ep": args.ep_size, "seconds": round(seconds, 6)}
        fig |= {"generated_tokens": sum(generated), "kv_pool_bytes_per_rank": engine.stats().pool_bytes}
        if idle is not None:
            fig |= {"steps_per_rank": ranks_steps, "idle_rounds_per_rank": idle}
        print(json.dumps({"ranks": fig}), file=sys.stderr)
        print(json.dumps(engine.stats().as_dict()), file=sys.stderr)
        if engine.cache_stats() is not None:
            print(json.dumps({"prefix_cache": engine.cache_stats()}), file=sys.stderr)
        if engine.hisparse_stats() is not None:
            print(json.dumps({"hisparse": engine.hisparse_stats()}), file=sys.stderr)
        if hs_ranks is not None:
            print(json.dumps({"hisparse_per_rank": hs_ranks}), file=sys.stderr)
        if engine.spec_stats() is not None:
            print(json.dumps({"speculative": engine.spec_stats()}), file=sys.stderr)
    return 1 if any("error" in r for r in rows) else 0
