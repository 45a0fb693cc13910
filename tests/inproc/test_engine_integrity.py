"""Page books balance after every engine step, on the real tiny model, through every way a request ends:
finishing, abort mid-prefill and mid-decode, preemption, rejection at submit, and a failing model step."""

from __future__ import annotations

import pytest

from dsakv.engine.engine import GenerationError
from dsakv.engine.request import FinishReason, RequestStatus
from dsakv.errors import CapacityError, ConfigError
from dsakv.testing.engines import drive, engine, greedy_params, hf_greedy, prompts_for


def test_every_way_out_keeps_the_books() -> None:
    eng = engine("glm_moe_dsa", page_size=4, num_pages=16, max_batch_tokens=8)  # 64 tokens
    pa, pb, pc, pd = prompts_for([40, 5, 9, 17], seed=5)
    a = eng.add_request(pa, greedy_params(16), request_id="a")
    b = eng.add_request(pb, greedy_params(30), request_id="b")
    c = eng.add_request(pc, greedy_params(30), request_id="c")
    d = eng.add_request(pd, greedy_params(24), request_id="d")
    with pytest.raises(
        CapacityError,
        match=r"request e: prompt of 70 tokens \+ max_new_tokens 20 = 90 tokens can "
        r"never fit in the KV pool of 16 pages x 4 tokens = 64 tokens",
    ):
        eng.add_request(prompts_for([70])[0], greedy_params(20), request_id="e")
    assert eng.get_request("e") is None
    eng.check_integrity()
    events = []

    def on_step(i, outs):
        ra, rc = eng.get_request("a"), eng.get_request("c")
        if ra is not None and ra.status is RequestStatus.RUNNING and 0 < ra.num_computed_tokens < len(pa):
            events.append(("abort a", ra.num_computed_tokens, len(ra.page_ids)))
            out = eng.abort("a")
            assert out is not None and out.finish_reason is FinishReason.ABORT and out.output_ids == ()
        if rc is not None and rc.status is RequestStatus.RUNNING and rc.num_output_tokens == 3:
            events.append(("abort c", rc.num_computed_tokens, len(rc.page_ids)))
            out = eng.abort("c")
            assert out is not None and len(out.output_ids) == 3
        eng.check_integrity()

    final = drive(eng, on_step)
    assert events[0] == ("abort a", 8, 2)  # mid-prefill: its first 8-token chunk computed, on 2 pages of 4
    assert events[1] == ("abort c", len(pc) + 2, 3)  # mid-decode: 11 computed tokens on 3 pages
    assert final[a].finish_reason == "abort" and final[c].finish_reason == "abort"
    assert eng.abort("a") is None  # already finished
    assert eng.stats().num_preemptions > 0  # b and d need 9 + 11 pages together
    assert list(final[b].output_ids) == hf_greedy("glm_moe_dsa", tuple(pb), 30)
    assert list(final[d].output_ids) == hf_greedy("glm_moe_dsa", tuple(pd), 24)
    assert final[b].finish_reason == final[d].finish_reason == "length"
    st = eng.stats()
    assert (st.pages_used, st.pages_free, st.pages_total) == (0, 16, 16)


def test_abort_is_reported_by_the_next_step() -> None:
    eng = engine("glm_moe_dsa", page_size=4, max_tokens=64)
    rid = eng.add_request([5, 6, 7], greedy_params(8))
    eng.step()
    assert eng.abort(rid).finish_reason == FinishReason.ABORT
    outs = eng.step()
    assert [(o.request_id, o.finished, o.finish_reason) for o in outs] == [(rid, True, FinishReason.ABORT)]
    assert eng.step() == [] and not eng.has_unfinished()
    eng.check_integrity()


class FailingModel:
    """The real model, made to fail on one call (fault injection for the error path)."""

    def __init__(self, model, fail_on: int) -> None:
        self.model, self.fail_on, self.calls = model, fail_on, 0

    def forward(self, batch, pool):
        self.calls += 1
        if self.calls == self.fail_on:
            raise RuntimeError("injected failure")
        return self.model.forward(batch, pool)


@pytest.mark.expect_traceback("an injected model bug must be logged with its traceback")
def test_failed_model_step_fails_its_requests_and_frees_their_pages() -> None:
    eng = engine("glm_moe_dsa", page_size=4, max_tokens=128)
    real = eng.runner.model
    eng.runner.model = FailingModel(real, fail_on=3)
    p1, p2 = prompts_for([6, 11], seed=9)
    r1 = eng.add_request(p1, greedy_params(8))
    r2 = eng.add_request(p2, greedy_params(8))
    final = drive(eng)
    for r in (r1, r2):
        assert final[r].finish_reason == FinishReason.ERROR
        assert final[r].error == "model step failed: RuntimeError: injected failure"
        assert len(final[r].output_ids) == 2
    assert eng.stats().pages_used == 0
    # the engine keeps serving
    eng.runner.model = FailingModel(real, fail_on=2)
    with pytest.raises(GenerationError, match="ended with error: model step failed: RuntimeError: injected failure"):
        eng.generate([p1], greedy_params(4))
    eng.check_integrity()
    eng.runner.model = real
    assert eng.generate([p1], greedy_params(4)) == [hf_greedy("glm_moe_dsa", tuple(p1), 4)]
    eng.check_integrity()


def test_submit_errors_name_the_lengths_and_queue_nothing() -> None:
    eng = engine("glm_moe_dsa", page_size=16, max_tokens=8192)
    with pytest.raises(
        CapacityError,
        match=r"4000 tokens \+ max_new_tokens 200 = 4200 tokens is more than the "
        r"model's 4096 positions \(max_position_embeddings\): shorten the prompt or lower",
    ):
        eng.add_request([2] * 4000, greedy_params(200))
    with pytest.raises(ConfigError, match=r"prompt token id\(s\) \[512, 900\] are outside the vocabulary 0..511"):
        eng.add_request([3, 512, 900], greedy_params(2))
    with pytest.raises(ConfigError, match="the prompt is empty"):
        eng.add_request([], greedy_params(2))
    with pytest.raises(CapacityError, match="request #1: prompt of 9000 tokens"):
        eng.generate([[2, 3], [2] * 9000], greedy_params(2))
    assert not eng.has_unfinished()
    eng.check_integrity()
    with pytest.raises(ConfigError, match=r"give num_pages \(4\) or max_tokens \(64\), not both"):
        engine("glm_moe_dsa", num_pages=4, max_tokens=64)
