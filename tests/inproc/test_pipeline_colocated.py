"""The colocated pipeline in one process: stage 0 (PipelinedEngine) here, the later stages (colocated.run_stage)
in threads, over real gloo groups on 127.0.0.1. Tokens equal the single-process engine's (greedy and seeded, a
batch, chunked prefill, preemption in a small pool), and so do prompt logprobs; STOP ends every stage with exit
code 0; a malformed step breaks the link naming the field; bad options are refused before any
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


@pytest.mark.parametrize("partition", [(6, 6), (7, 3, 2)])
def test_prompt_logprobs_equal_single_process_engine(partition: tuple[int, ...]) -> None:
    """The last stage sends the prompt positions' logits back: chunked prefill (8-token chunks) over 2 and 3
    stages gives the single-process engine's prompt logprobs (ids exact, values within 1e-5) and tokens."""
    prompts = prompts_for([13, 5, 22], seed=7)
    params = [replace(GREEDY, prompt_logprobs=3, logprobs=2), replace(SEEDED, prompt_logprobs=1)]

    def run(eng) -> list[tuple]:  # noqa: ANN001
        """Per prompt: (output ids, prompt logprobs, output logprobs, error)."""
        ids = [eng.add_request(p, params[i % 2]) for i, p in enumerate(prompts)]
        plp: dict[str, tuple] = {}
        lps: dict[str, list] = {r: [] for r in ids}
        done = {}
        while len(done) < len(ids):
            for o in eng.step():
                lps[o.request_id] += o.new_logprobs
                if o.prompt_logprobs is not None:
                    plp[o.request_id] = o.prompt_logprobs
                if o.finished:
                    done[o.request_id] = o
        return [(list(done[r].output_ids), plp.get(r), lps[r], done[r].error) for r in ids]

    def close(a, b) -> bool:  # noqa: ANN001  (TokenLogprobs: ids exact, values within 1e-5)
        return (
            a.token_id == b.token_id
            and abs(a.logprob - b.logprob) < 1e-5
            and [i for i, _ in a.top] == [i for i, _ in b.top]
            and all(abs(x - y) < 1e-5 for (_, x), (_, y) in zip(a.top, b.top, strict=True))
        )

    want = run(Engine(tiny_model(ARCH), TREE))
    eng, codes, threads = _pipeline(PipelineConfig(pp_size=len(partition), partition=partition))
    try:
        got = run(eng)
        assert eng.stats().pages_used == 0
    finally:
        eng.close()
    for t in threads:
        t.join(30)
    assert codes == [0] * (len(partition) - 1)
    for (g_ids, g_plp, g_lps, g_err), (w_ids, w_plp, w_lps, _), p, par in zip(
        got, want, prompts, params * 2, strict=False
    ):
        assert g_err is None and g_ids == w_ids
        assert g_plp is not None and w_plp is not None and len(g_plp) == len(w_plp) == len(p) - 1
        assert all(len(x.top) == par.prompt_logprobs for x in g_plp)
        assert all(close(a, b) for a, b in zip(g_plp, w_plp, strict=True))
        assert len(g_lps) == len(w_lps) and all(close(a, b) for a, b in zip(g_lps, w_lps, strict=True))


def test_malformed_step_names_the_field() -> None:
    with pytest.raises(StageLinkError, match=r"stage 1: malformed pipeline step: kind 'go' is not one of"):
        PipeStep.of_meta({"kind": "go"}, "stage 1")
    with pytest.raises(StageLinkError, match=r"a step without its batch"):
        PipeStep.of_meta({"kind": STEP}, "stage 1")
    with pytest.raises(StageLinkError, match=r"hold is not a map of request id -> page ids"):
        PipeStep.of_meta({"kind": "tick", "hold": {"r1": ["x"]}}, "stage 1")
    step = PipeStep(STEP, {"input_ids": [[1], b"\0" * 8]}, {"r1": [3, 4]}, ["r0"])
    assert PipeStep.of_meta(step.meta(), "stage 1") == step
    step = PipeStep(STEP, {"input_ids": [[1], b"\0" * 8]}, {}, [], None, [[0, 5, 7], []])
    assert PipeStep.of_meta(step.meta(), "stage 1") == step
    for kind, bad in ((STEP, {"positions": [[8]]}), (STEP, [[0.5]]), (STEP, [3]), ("tick", [[0]])):
        with pytest.raises(StageLinkError, match=r"stage 1: malformed pipeline step: logits_at .* is not a list of"):
            PipeStep.of_meta({**step.meta(), "kind": kind, "logits_at": bad}, "stage 1")


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
