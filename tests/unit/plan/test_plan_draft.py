"""Planner: where draft (MTP) layers sit across PP stages, and both accountings shown when they differ."""

from __future__ import annotations

import json

import pytest

from dsakv.cli.main import main as cli_main
from dsakv.errors import ConfigError
from dsakv.plan.capacity import Deployment, plan
from dsakv.spec.presets import load_spec

GIB = 2**30


def test_draft_on_every_stage_or_the_last_only():
    spec = load_spec("glm-5.2")
    every = plan(Deployment(spec, role="prefill", partition=(20, 20, 20, 18), draft_layers=1, kv_budget=98 * GIB))
    last = plan(
        Deployment(
            spec, role="prefill", partition=(20, 20, 20, 18), draft_layers=1, kv_budget=98 * GIB, draft_placement="last"
        )
    )
    assert [s.draft_layers for s in every.stages] == [1, 1, 1, 1]
    assert [s.draft_layers for s in last.stages] == [0, 0, 0, 1]
    # stage 0 binds either way; without its draft layer (656 + 132 B/token) it holds more tokens
    assert every.stages[0].bytes_per_token_elided == 14832 and last.stages[0].bytes_per_token_elided == 14832 - 788
    assert every.tokens_elided == 7_094_528 and last.tokens_elided == 7_492_608 == (98 * GIB // 14044) // 64 * 64
    assert last.stages[3].bytes_per_token_elided == every.stages[3].bytes_per_token_elided
    with pytest.raises(ConfigError, match="draft placement 'first'"):
        Deployment(spec, draft_layers=1, kv_budget=GIB, draft_placement="first")


def test_plan_cli_shows_both_placements(capsys):
    args = [
        "plan",
        "glm-5.2",
        "--role",
        "prefill",
        "--pp-partition",
        "20,20,20,18",
        "--draft-layers",
        "1",
        "--kv-budget",
        "98GiB",
    ]
    assert cli_main(args) == 0
    out = capsys.readouterr().out
    assert (
        "draft placement every: a draft set on every stage (the seeds' accounting): binding stage 0, 7,094,528" in out
    )
    assert "draft placement last: drafts on the last stage only (dsakv's engine): binding stage 0, 7,492,608" in out
    assert cli_main(args + ["--json", "--draft-placement", "last"]) == 0
    js = json.loads(capsys.readouterr().out)
    assert js["draft_placement"] == "last" and js["max_total_num_tokens_elided"] == 7_492_608
    assert js["other_draft_placement"] == {
        "draft_placement": "every",
        "binding_stage_elided": 0,
        "max_total_num_tokens_elided": 7_094_528,
    }
