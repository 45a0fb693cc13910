"""The colocated pipeline in one process: stage 0 (PipelinedEngine) here, the later stages (colocated.run_stage)
in threads, over real gloo groups on 127.0.0.1. Tokens equal the single-process engine's (greedy and seeded, a
batch, chunked prefill, preemption in a small pool); STOP ends every stage with exit code 0; prompt logprobs are
refused naming the option; a malformed step breaks the link naming the field; bad options are refused before any
stage starts."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from dsakv.config import EngineConfig, LayoutConfig, PipelineConfig, PoolConfig, SchedulerConfig
from dsakv.engine.engine import Engine
from dsakv.engine.request import SamplingParams
from dsakv.errors import ConfigError
from dsakv.pipeline import colocated
from dsakv.pipeline.colocated import PipelinedEngine, run_stage, start_pipeline
from dsakv.pipeline.stage_comm import StageLinkError
from dsakv.pipeline.step import STEP, PipeStep
from dsakv.testing.engines import prompts_for, tiny_model, tiny_path
from dsakv.util.procs import free_ports

ARCH = "glm_moe_dsa"
TREE = EngineConfig(
    layout=LayoutConfig(page_size=4),
    pool=PoolConfig(num_pages=16),  # 64 tokens: the batch below preempts
    scheduler=SchedulerConfig(max_batch_tokens=8),  # chunked prefill
    dtype="float32",
)
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(max_new_tokens=12, ignore_eos=True, temperature=0.9, top_k=40, seed=5)


def _pipeline(pipe: PipelineConfig) -> tuple[PipelinedEngine, list[int], list[threading.Thread]]:
    """Stage 0 here and stages 1..N-1 in threads; the stages' exit codes land in the returned list."""
    port, codes = free_ports(1), []
    threads = [
        threading.Thread(target=lambda k=k: codes.append(run_stage(k, port, tiny_path(ARCH), TREE, pipe)), daemon=True)
        for k in range(1, pipe.pp_size)
    ]
    for t in threads:
        t.start()
    return PipelinedEngine(tiny_path(ARCH), TREE, pipe, port, []), codes, threads


@pytest.mark.parametrize("partition", [(6, 6), (7, 3, 2)])
def test_tokens_equal_single_process_engine(partition: tuple[int, ...]) -> None:
    prompts = prompts_for([13, 5, 22, 9], seed=31)
    one = Engine(tiny_model(ARCH), TREE)
    want = one.generate(prompts, GREEDY) + one.generate(prompts[:2], SEEDED)
    eng, codes, threads = _pipeline(PipelineConfig(pp_size=len(partition), partition=partition))
    try:
        got = eng.generate(prompts, GREEDY) + eng.generate(prompts[:2], SEEDED)
        st = eng.stats()
        assert st.num_preemptions > 0 and st.pages_used == 0  # the small pool preempted; every page came back
        eng.check_integrity()
    finally:
        eng.close()
    for t in threads:
        t.join(30)
    assert got == want
    assert codes == [0] * (len(partition) - 1)  # STOP reached every stage


def test_prompt_logprobs_refused_naming_the_option() -> None:
    eng, _, threads = _pipeline(PipelineConfig(pp_size=2))
    try:
        with pytest.raises(ConfigError, match=r"prompt_logprobs with --pp-size 2 is not supported yet"):
            eng.add_request([5, 6, 7], replace(GREEDY, prompt_logprobs=1))
        assert eng.stats().num_waiting == 0  # nothing kept
    finally:
        eng.close()
    for t in threads:
        t.join(30)


def test_malformed_step_names_the_field() -> None:
    with pytest.raises(StageLinkError, match=r"stage 1: malformed pipeline step: kind 'go' is not one of"):
        PipeStep.of_meta({"kind": "go"}, "stage 1")
    with pytest.raises(StageLinkError, match=r"a step without its batch"):
        PipeStep.of_meta({"kind": STEP}, "stage 1")
    with pytest.raises(StageLinkError, match=r"hold is not a map of request id -> page ids"):
        PipeStep.of_meta({"kind": "tick", "hold": {"r1": ["x"]}}, "stage 1")
    step = PipeStep(STEP, {"input_ids": [[1], b"\0" * 8]}, {"r1": [3, 4]}, ["r0"])
    assert PipeStep.of_meta(step.meta(), "stage 1") == step


@pytest.mark.parametrize(
    ("tree", "pipe", "err"),
    [
        (replace(TREE, speculative_num_steps=2), PipelineConfig(pp_size=2), "--pp-size 2 with --speculative-num-steps"),
        (TREE, PipelineConfig(pp_size=2, partition=(6, 5)), "--pp-partition 6,5 must give every stage >= 1 layer"),
    ],
)
def test_bad_options_refused_before_any_stage_starts(monkeypatch, tree, pipe, err) -> None:  # noqa: ANN001
    started: list[object] = []
    monkeypatch.setattr(colocated, "Proc", lambda *a, **k: started.append(a))
    with pytest.raises(ConfigError, match=err):
        start_pipeline(tiny_path(ARCH), tree, pipe, ["generate"])
    assert started == []
