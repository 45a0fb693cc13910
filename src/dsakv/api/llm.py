"""`dsakv.LLM`: an engine built from a checkpoint directory and the options of `dsakv generate`, with
`generate(prompts, sampling)` returning one `Completion` per prompt (token ids, text, logprobs).

    with dsakv.LLM("/tmp/tiny", page_size=16, kv_budget="64MiB", prefix_cache=True) as llm:
        out = llm.generate([[5, 6, 7, 8], "Hello"], dsakv.SamplingParams(max_new_tokens=16))
        out[0].token_ids, out[1].text

The options go through the CLI's own parser and checks (api/options.py, cli/generate_cmd.check_engine_args), and
the engine is the one `dsakv generate` builds (cli/generate_cmd.build_engine). `tp_size=T` starts ranks 1..T-1
as `dsakv serve` rank processes following this one's steps (engine/ranks.py: RankedEngine, follow); close() (or
leaving the `with`) stops them and frees the engine.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsakv.api import options as api_options
from dsakv.cli import generate_cmd
from dsakv.engine.request import RequestOutput, SamplingParams, TokenLogprobs
from dsakv.errors import ConfigError

WHAT = "dsakv.LLM"


@dataclass(frozen=True)
class Completion:
    """One prompt's result. `logprobs`: one TokenLogprobs per output token when SamplingParams.logprobs is set
    (else None); `prompt_logprobs` likewise for prompt tokens 1.. with SamplingParams.prompt_logprobs."""

    index: int
    prompt: str | None  # the text given, None for token ids
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[TokenLogprobs] | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    cumulative_logprob: float | None = field(default=None)


def _prompt_list(prompts: Any) -> list[str | list[int]]:
    """One prompt (a str, or a sequence of token ids) or a list of them -> a list."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or isinstance(prompts, bytes):
        raise ConfigError(f"prompts {prompts!r}: give a str, a list of token ids, or a list of those")
    items = list(prompts)
    if items and all(isinstance(t, int) and not isinstance(t, bool) for t in items):
        return [items]  # type: ignore[list-item]
    out: list[str | list[int]] = []
    for i, p in enumerate(items):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Sequence) and not isinstance(p, bytes):
            out.append(list(p))
        else:
            raise ConfigError(f"prompt #{i} {p!r}: give a str or a list of token ids")
    return out


class LLM:
    """An engine on one checkpoint; options = `dsakv generate`'s flags as keywords (api/options.py).
    `loaded_model`: a (spec, model) already loaded from `model` (benches building many engines on one model)."""

    def __init__(self, model: str | Path, *, loaded_model: Any = None, **options: Any) -> None:
        self._engine: Any = None
        self._ranked: Any = None
        self._tokenizer: Any = None
        parser = api_options.parser_for(generate_cmd.add_arguments, "dsakv generate")
        self._argv = api_options.to_argv(parser, options, WHAT)
        args = api_options.parse(parser, ["--model", str(model), *self._argv])
        self.model_dir = Path(model)
        if not (self.model_dir / "config.json").is_file():
            raise ConfigError(f"--model {str(model)!r} has no config.json: pass a checkpoint directory")
        from dsakv.spec.v4 import is_v4

        if is_v4(str(model)):
            raise ConfigError(f"{WHAT}: {model} is a DeepSeek-V4 checkpoint: run it with `dsakv generate` for now")
        generate_cmd.check_engine_args(args)
        if args.enable_dp_attention:
            raise ConfigError(f"{WHAT}: enable_dp_attention is not supported here yet: use `dsakv generate`")
        if getattr(args, "pp_size", 1) > 1:
            raise ConfigError(
                f"{WHAT}: pp_size {args.pp_size} is not supported here yet: use `dsakv generate --pp-size`"
            )
        if args.tp_size > 1 and loaded_model is not None:
            raise ConfigError(f"{WHAT}: loaded_model with tp_size {args.tp_size}: each rank loads its shard")
        self.args: argparse.Namespace = args
        self._start(args, loaded_model)

    def _start(self, args: argparse.Namespace, loaded: Any) -> None:
        from dsakv.engine.ranks import RankedEngine, start_ranks

        generate_cmd.check_tp_split(args, self.model_dir)
        # ranks 1..T-1 run `dsakv serve` with these options: its TP followers (no HTTP) step with this rank
        ranks = start_ranks(args.tp_size, ["serve", "--model", str(self.model_dir), *self._argv])
        try:
            self._engine = generate_cmd.build_engine(args, ranks, self.model_dir, loaded)
        except BaseException:
            for p in ranks.children:
                p.kill()
            raise
        if ranks.size > 1:
            self._ranked = RankedEngine(self._engine, ranks)

    # ---- use -----------------------------------------------------------------------------------------------------

    @property
    def engine(self) -> Any:
        """The Engine (rank 0's in a TP group); ConfigError once closed."""
        if self._engine is None:
            raise ConfigError(f"{WHAT} on {self.model_dir} is closed: make a new one")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        """The checkpoint's tokenizer (serve/tokenizer.py: its HF tokenizer, else the byte fallback)."""
        if self._tokenizer is None:
            from dsakv.serve.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.model_dir, self.engine.spec.vocab_size)
        return self._tokenizer

    def stats(self) -> dict[str, Any]:
        """The engine's counters (what `dsakv generate --stats` prints first)."""
        return dict(self.engine.stats().as_dict())

    def generate(
        self, prompts: Any, sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[Completion]:
        """Run every prompt together (continuous batching) to its end; one Completion per prompt, in order.
        `prompts`: a str (tokenized with the checkpoint's tokenizer), a list of token ids, or a list of those.
        `sampling`: one SamplingParams for all, one per prompt, or None (greedy, 16 tokens)."""
        eng = self._ranked if self._ranked is not None else self.engine
        items = _prompt_list(prompts)
        if not items:
            return []
        params = self._params(sampling, len(items))
        ids_of = [self.tokenizer.encode(p) if isinstance(p, str) else p for p in items]
        if any(not p for p in ids_of):
            raise ConfigError("a prompt is empty: every prompt needs at least one token")
        rids: list[str] = []
        try:
            for p, sp in zip(ids_of, params, strict=True):
                rids.append(eng.add_request(p, sp))
        except BaseException:
            for rid in rids:  # a request that cannot fit (or a bad one): nothing of this call stays queued
                eng.abort(rid)
            raise
        final, logprobs, prompt_lp = self._run(eng, rids)
        out = []
        for i, (item, rid) in enumerate(zip(items, rids, strict=True)):
            o = final[rid]
            lp = logprobs[rid] if params[i].logprobs is not None else None
            out.append(
                Completion(
                    index=i,
                    prompt=item if isinstance(item, str) else None,
                    prompt_token_ids=list(ids_of[i]),
                    token_ids=list(o.output_ids),
                    text=self.tokenizer.decode(list(o.output_ids)),
                    finish_reason=str(o.finish_reason),
                    logprobs=lp,
                    prompt_logprobs=prompt_lp.get(rid),
                    num_cached_tokens=o.num_cached_tokens,
                    error=o.error,
                    cumulative_logprob=sum(t.logprob for t in lp) if lp is not None else None,
                )
            )
        return out

    def _params(self, sampling: Any, n: int) -> list[SamplingParams]:
        if sampling is None:
            sampling = SamplingParams()
        got = [sampling] * n if isinstance(sampling, SamplingParams) else list(sampling)
        if len(got) != n or not all(isinstance(s, SamplingParams) for s in got):
            raise ConfigError(
                f"sampling: give one dsakv.SamplingParams or a list of {n} (one per prompt), not {sampling!r}"
            )
        for s in got:
            if s.n != 1:
                raise ConfigError(
                    f"SamplingParams(n={s.n}): {WHAT}.generate returns one sequence per prompt: "
                    "give n=1 and repeat the prompt"
                )
        return got

    def _run(
        self, eng: Any, rids: list[str]
    ) -> tuple[dict[str, RequestOutput], dict[str, list[TokenLogprobs]], dict[str, list[TokenLogprobs]]]:
        """Step until every request of `rids` finished; their final outputs and the logprobs gathered per step."""
        want = set(rids)
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {r: [] for r in rids}
        prompt_lp: dict[str, list[TokenLogprobs]] = {}
        while len(final) < len(want):
            if not eng.has_unfinished():
                missing = sorted(want - set(final))
                raise ConfigError(f"{WHAT}: the engine has no work left but requests {missing} did not finish")
            for o in eng.step():
                if o.request_id not in want:
                    continue
                logprobs[o.request_id].extend(o.new_logprobs)
                if o.prompt_logprobs is not None:
                    prompt_lp[o.request_id] = list(o.prompt_logprobs)
                if o.finished:
                    final[o.request_id] = o
        return final, logprobs, prompt_lp

    # ---- lifetime ------------------------------------------------------------------------------------------------

    def close(self) -> None:
        """Free the engine: stop the TP rank processes (waiting for their exit), close the prefix cache's storage
        tier. Idempotent; the LLM cannot generate after it."""
        eng, ranked = self._engine, self._ranked
        self._engine = self._ranked = None
        if eng is None:
            return
        try:
            if ranked is not None:
                ranked.close()
        finally:
            close = getattr(eng.prefix_cache, "close", None)
            if close is not None:
                close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._engine is None else f"tp {self.args.tp_size}"
        return f"dsakv.LLM({str(self.model_dir)!r}, {' '.join(self._argv) or 'defaults'}; {state})"
