"""Engine StepRetry (elastic EP, engine/dp.py): a step whose collective broke (here: after its forward wrote the
step's KV) is held and run again at the next step: tokens identical to an uninterrupted run, nothing failed, no
page leaked; a request aborted while its step is held leaves the held step (abort reported once, pages freed) and
the others go on to the uninterrupted tokens."""

from __future__ import annotations

from typing import Any

from dsakv.engine.engine import Engine
from dsakv.engine.mtp_fit import fit_mtp, fit_prompts
from dsakv.engine.request import FinishReason, SamplingParams
from dsakv.errors import StepRetry
from dsakv.model.loader import load_model
from dsakv.model.tiny import make_tiny
from dsakv.testing.config import engine_config
from dsakv.testing.engines import engine, prompts_for

ARCH = "glm_moe_dsa"
PARAMS = SamplingParams(max_new_tokens=8, ignore_eos=True)
PROMPTS = prompts_for([7, 12, 5], seed=4)


def breaking(eng: Any, calls: set[int]) -> list[int]:
    """Make the runner's forward calls numbered in `calls` (0-based) raise StepRetry after running (KV written)."""
    run, seen = eng.runner.run, [0]

    def run_then_break(chunks: Any) -> Any:
        out = run(chunks)
        seen[0] += 1
        if seen[0] - 1 in calls:
            raise StepRetry(f"forward {seen[0] - 1}: the group re-forms")
        return out

    eng.runner.run = run_then_break
    return seen


def run_all(eng: Any, on_retry: Any = None) -> tuple[dict[str, Any], int]:
    final, retries = {}, 0
    for _ in range(1000):
        if not eng.has_unfinished():
            break
        try:
            outs = eng.step()
        except StepRetry:
            retries += 1
            if on_retry is not None:
                on_retry(retries)
            continue
        final.update({o.request_id: o for o in outs if o.finished})
    return final, retries


def test_held_step_runs_again_to_the_same_tokens() -> None:
    ref = engine(ARCH, page_size=4, max_tokens=256).generate(PROMPTS, PARAMS)
    eng = engine(ARCH, page_size=4, max_tokens=256)
    seen = breaking(eng, {0, 2, 3})  # the prefill step and two decode steps
    rids = [eng.add_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    final, retries = run_all(eng)
    assert retries == 3
    assert seen[0] == 8 + 3  # 8 steps (one token each), 3 of them twice
    assert [list(final[r].output_ids) for r in rids] == ref
    assert {final[r].finish_reason for r in rids} == {FinishReason.LENGTH}
    st = eng.stats()
    assert (st.pages_used, st.num_running, st.num_waiting) == (0, 0, 0)
    eng.check_integrity()


def test_abort_while_the_step_is_held() -> None:
    ref = engine(ARCH, page_size=4, max_tokens=256).generate(PROMPTS, PARAMS)
    eng = engine(ARCH, page_size=4, max_tokens=256)
    breaking(eng, {2})
    rids = [eng.add_request(p, PARAMS, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    final, retries = run_all(eng, on_retry=lambda _n: eng.abort("r1"))
    assert retries == 1
    assert final["r1"].finish_reason == FinishReason.ABORT and len(final["r1"].output_ids) == 2
    assert [list(final[r].output_ids) for r in ("r0", "r2")] == [ref[0], ref[2]]
    assert final["r0"].finish_reason == final["r2"].finish_reason == FinishReason.LENGTH
    assert sorted(final) == sorted(rids)
    st = eng.stats()
    assert (st.pages_used, st.num_running, st.num_waiting) == (0, 0, 0)
    eng.check_integrity()


def _mtp_engine(ckpt: Any) -> Engine:
    cfg = engine_config(page_size=4, max_tokens=256)
    return Engine(load_model(ckpt), cfg, speculative_num_steps=2, model_dir=ckpt, spec_poison_rejected=True)


def test_held_speculative_step_runs_again_to_the_same_tokens_and_accept_counts(tmp_path) -> None:
    """With MTP (a DP-attention decode speculating): the verify forward's all-to-all breaks after the chain drafted
    and the target wrote its KV; the held step drafts and verifies again: tokens (greedy and seeded) and accept
    counts == an uninterrupted run, nothing failed, no page leaked."""
    ckpt = make_tiny(tmp_path / "mtp", seed=0, mtp=1)
    fit_mtp(ckpt, num_prompts=4, steps=30)
    prompts = fit_prompts(512, 4)[:2] + PROMPTS[:1]
    for params in (PARAMS, SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.9, seed=5)):
        ref_eng = _mtp_engine(ckpt)
        ref = ref_eng.generate(prompts, params)
        eng = _mtp_engine(ckpt)
        target = eng.speculator.target
        forward, seen = target.stage_forward, [0]

        def forward_then_break(*a: Any, _f: Any = forward, _seen: list[int] = seen) -> Any:
            out = _f(*a)
            _seen[0] += 1
            if _seen[0] - 1 in (0, 2, 3):  # the prefill step and two verify steps
                raise StepRetry(f"verify {_seen[0] - 1}: the group re-forms")
            return out

        target.stage_forward = forward_then_break
        rids = [eng.add_request(p, params, request_id=f"r{i}") for i, p in enumerate(prompts)]
        final, retries = run_all(eng)
        assert retries == 3
        assert [list(final[r].output_ids) for r in rids] == ref
        assert eng.spec_stats() == ref_eng.spec_stats() and (eng.spec_stats() or {})["spec_accepted_tokens"] > 0
        st = eng.stats()
        assert (st.pages_used, st.num_running, st.num_waiting) == (0, 0, 0)
        eng.check_integrity()
