"""V4ServingEngine: Engine's serving API over a V4Engine, as serve.EngineBackend drives it (in one process)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dsakv.config import CacheConfig, EngineConfig, LayoutConfig, PoolConfig, SchedulerConfig
from dsakv.engine.request import FinishReason, SamplingParams
from dsakv.engine.v4_engine import V4Engine
from dsakv.engine.v4_serve import V4ServingEngine
from dsakv.errors import ConfigError
from dsakv.model.deepseek_v4 import load_v4
from dsakv.model.deepseek_v4_tiny import make_tiny_v4


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return load_v4(make_tiny_v4(tmp_path_factory.mktemp("v4se") / "pro", "pro"))


def _cfg(**cache: object) -> EngineConfig:
    return EngineConfig(
        layout=LayoutConfig(page_size=16), pool=PoolConfig(num_pages=32),
        scheduler=SchedulerConfig(max_batch_tokens=12, max_running_requests=3), cache=CacheConfig(**cache),  # type: ignore[arg-type]
    )  # fmt: skip


def test_step_reports_each_token_once_and_abort_frees(model) -> None:  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(2, 500, (n,), generator=g).tolist() for n in (23, 9))
    plain = V4Engine(model, num_pages=32, max_running=1)
    want = [r.output for p in (a, b) for r in plain.generate([p], 7)]
    eng = V4ServingEngine(model, _cfg())
    sp = SamplingParams(max_new_tokens=7, ignore_eos=True)
    eng.add_request(a, sp, request_id="a")
    eng.add_request(b, sp, request_id="b")
    eng.add_request(b, sp, request_id="c")
    with pytest.raises(ConfigError, match="'a' is already in flight"):
        eng.add_request(a, sp, request_id="a")
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    reasons: dict[str, FinishReason | None] = {}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id] += list(out.new_token_ids)
            assert tuple(got[out.request_id]) == out.output_ids
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        if len(got["c"]) == 2 and "c" not in reasons:
            out = eng.abort("c")
            assert out is not None and out.finish_reason is FinishReason.ABORT and eng.abort("c") is None
    # the abort's output is reported once more by the next step (as Engine does), then nothing
    assert [got["a"], got["b"]] == want and got["c"] == want[1][:2]
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH, "c": FinishReason.ABORT}
    assert eng.step() == []
    st = eng.stats()
    assert (st.pages_used, st.num_running, st.generated_tokens, st.prefill_tokens) == (0, 0, 16, 23 + 9 + 9)
    assert eng.engine.slots.num_free == 3 and eng.cache_stats() is None


def test_refuses_what_v4_does_not_do(model) -> None:  # type: ignore[no-untyped-def]
    eng = V4ServingEngine(model, _cfg(prefix_cache=True))
    with pytest.raises(ConfigError, match="does not take n 2, logprobs 1 yet"):
        eng.add_request([5, 6], SamplingParams(temperature=0.5, n=2, logprobs=1))
    with pytest.raises(ConfigError, match="penalties, logit_bias or min_tokens"):
        eng.add_request([5, 6], SamplingParams(min_tokens=2))
    assert eng.features == frozenset() and eng.cache_stats() is not None
    with pytest.raises(ConfigError, match="--speculative-num-steps 2"):
        V4ServingEngine(model, EngineConfig(layout=LayoutConfig(page_size=16), speculative_num_steps=2))
    with pytest.raises(ConfigError, match="multiple of 16 tokens"):
        V4ServingEngine(model, EngineConfig(layout=LayoutConfig(page_size=24)))


def test_seeded_sampling_is_the_same_alone_or_batched(model) -> None:  # type: ignore[no-untyped-def]
    """Output token i is drawn with (seed, i) alone: a request gets the same tokens alone or beside others, and
    a request of temperature 0 beside sampled ones stays greedy."""
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(2, 500, (n,), generator=g).tolist() for n in (19, 7))
    hot = SamplingParams(max_new_tokens=6, temperature=0.9, top_k=40, top_p=0.95, seed=21, ignore_eos=True)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)

    def run(*reqs: tuple[str, list[int], SamplingParams]) -> dict[str, list[int]]:
        eng = V4ServingEngine(model, _cfg())
        for rid, prompt, sp in reqs:
            eng.add_request(prompt, sp, request_id=rid)
        got: dict[str, list[int]] = {rid: [] for rid, _, _ in reqs}
        while eng.has_unfinished():
            for out in eng.step():
                got[out.request_id] += list(out.new_token_ids)
        return got

    alone = run(("a", a, hot))["a"]
    both = run(("a", a, hot), ("b", b, greedy), ("c", a, replace(hot, seed=22)))
    plain = V4Engine(model, num_pages=32, max_running=1).generate([b], 6)[0].output
    assert both["a"] == alone and both["b"] == plain and both["c"] != alone and len(alone) == 6
