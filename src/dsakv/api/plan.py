"""`dsakv.plan(model, **options)`: the capacity table `dsakv plan` prints, as data (what `dsakv plan --json`
prints): options are the command's flags as keywords (`role="decode"`, `kv_budget="96.33GiB"`,
`draft_layers=1`, `pp_partition=[20, 20, 20, 18]`), parsed and checked by the command's own parser. No torch."""

from __future__ import annotations

from typing import Any

from dsakv.api import options as api_options
from dsakv.cli import plan_cmd

REFUSED = {"json": "plan() always returns data", "model": "the model is plan()'s first argument"}


def plan(model: str, **options: Any) -> dict[str, Any]:
    """The plan of `model` (a preset name, a config.json, or a model directory) for one role: per stage
    (`stages`: bytes per token and tokens, dense and elided, host / L3 / HiSparse figures when asked), the
    worker's totals (`max_total_num_tokens_dense` / `_elided`), the rank grid; `balance` with balance=True."""
    parser = api_options.parser_for(plan_cmd.add_arguments, "dsakv plan")
    argv = api_options.to_argv(parser, options, "dsakv.plan", REFUSED)
    return plan_cmd.plan_data(api_options.parse(parser, [str(model), *argv]))
