"""Keyword options -> the CLI's argv -> the CLI's own parser and checks: `dsakv.LLM(path, page_size=16)` and
`dsakv generate --page-size 16` go through the same argparse declarations (dsakv.cli.options) and the same
validation (dsakv.cli.validate), so both accept the same values and refuse the rest with the same message.

A keyword is the flag without its dashes, '-' spelled '_' (the argparse dest): `kv_budget="64MiB"`,
`prefix_cache=True`, `elide=False` (--no-elide), `hicache_ratio=2`. None leaves an option at its default.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dsakv.errors import ConfigError

# generate's options that are not the engine's: per request (SamplingParams) or the command's output
PER_REQUEST = ("max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos")
NOT_OPTIONS = {
    "model": "the model path is LLM's first argument",
    "prompt_ids": "prompts go to generate(prompts)",
    "prompt": "prompts go to generate(prompts)",
    "sequential": "call generate() once per batch instead",
    "json": "generate() returns the results as data",
    "stats": "read LLM.stats() instead",
    "help": "see `dsakv generate --help`",
} | {k: "it is per request: pass it in dsakv.SamplingParams" for k in PER_REQUEST}


def parser_for(add_arguments: Callable[[argparse.ArgumentParser], None], prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, add_help=False)
    add_arguments(p)
    return p


def _flag(action: argparse.Action) -> str:
    return next(s for s in action.option_strings if s.startswith("--"))


def to_argv(
    parser: argparse.ArgumentParser, options: Mapping[str, Any], what: str, refused: Mapping[str, str] = NOT_OPTIONS
) -> list[str]:
    """argv for `options` (keyword = argparse dest); an unknown or refused keyword is a ConfigError naming it and
    what to do instead."""
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    argv: list[str] = []
    for key, value in options.items():
        if key in refused:
            raise ConfigError(f"{what}: {key}= is not an option here: {refused[key]}")
        action = actions.get(key)
        if action is None:
            near = difflib.get_close_matches(key, list(actions), n=3)
            hint = f" (did you mean {', '.join(near)}?)" if near else ""
            raise ConfigError(
                f"{what}: unknown option {key}={value!r}{hint}: the options are the flags of `{parser.prog}` "
                "with '_' for '-' (see its --help)"
            )
        if value is None:
            continue
        flag = _flag(action)
        if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"{what}: {key}={value!r} is a switch ({flag}): give True or False")
            if isinstance(action, argparse.BooleanOptionalAction):
                argv.append(flag if value else "--no-" + flag[2:])
            elif value:
                argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, ",".join(str(v) for v in value)]
        else:
            argv += [flag, str(value)]
    return argv


def parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """parser.parse_args(argv), with argparse's error (what the CLI prints after 'error: ') as a ConfigError."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(list(argv))
    except SystemExit:
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        msg = lines[-1] if lines else "bad options"
        prefix = f"{parser.prog}: error: "
        raise ConfigError(msg[len(prefix) :] if msg.startswith(prefix) else msg) from None
