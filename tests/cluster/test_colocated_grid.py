"""The colocated pipeline with TP stages: `dsakv generate --pp-size 2 --tp-size 2` runs 4 processes (stage s, TP
rank r; pipeline/tp_stage.py). Greedy and seeded tokens equal the single-process engine's (one prompt chunked
over several steps), stage 0's pool ends with 0 pages used, every process exits 0 (rank 0 fails otherwise) and
none is left once the command returned."""

from __future__ import annotations

import json
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from dsakv.cli import options
from dsakv.cli.main import build_parser
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.testing.engines import prompts_for, tiny_model, tiny_path
from dsakv.util.procs import CHILD_ENV, dsakv_cmd

ARCH = "glm_moe_dsa"
POOL = ["--page-size", "4", "--num-pages", "40", "--max-batch-tokens", "8", "--threads", "1"]
MARK = "DSAKV_TEST_GRID_RUN"


def _reference(argv: list[str]) -> Engine:
    """A single-process Engine over the very tree `dsakv *argv` builds."""
    return Engine(tiny_model(ARCH), options.engine_config(build_parser([argv[0]]).parse_args(argv)))


def _marked(mark: str) -> list[int]:
    """The pids of live processes whose environment holds MARK=mark (this run's processes, inherited)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARK}={mark}".encode() in env:
            out.append(int(d.name))
    return out


@pytest.mark.parametrize(
    "sampling", [[], ["--temperature", "0.9", "--top-k", "40", "--seed", "5"]], ids=["greedy", "seeded"]
)
def test_generate_pp2_tp2_tokens_equal_single_process(sampling: list[str]) -> None:
    prompts = prompts_for([11, 4], seed=8)  # 11 tokens: prefilled over 2 steps of 8
    argv = ["generate", "--model", str(tiny_path(ARCH)), *POOL, "--max-new-tokens", "6", "--ignore-eos", "--json"]
    argv += sampling
    for q in prompts:
        argv += ["--prompt-ids", ",".join(map(str, q))]
    mark = uuid.uuid4().hex
    r = subprocess.run(
        dsakv_cmd(*argv, "--pp-size", "2", "--tp-size", "2", "--stats"),
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **CHILD_ENV, MARK: mark},
    )  # every rank and stage dies with its parent (parent-death signal) should it time out
    assert r.returncode == 0, r.stderr[-3000:]
    got = [row["output_ids"] for row in json.loads(r.stdout)]
    sp = {"temperature": 0.9, "top_k": 40, "seed": 5} if sampling else {}
    assert got == _reference(argv).generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True, **sp))
    stats = [json.loads(line) for line in r.stderr.splitlines() if line.startswith('{"page_size"')]
    assert [(s["pages_used"], s["pages_free"], s["generated_tokens"]) for s in stats] == [(0, 40, 12)]
    # exit 0 only if every process did: stage 0 waits for its TP rank 1 and stage 1, stage 1 for its TP rank 1
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    assert _marked(mark) == []
