"""Scheduler on a real PageAllocator: exact chunks and page ids, preemption, abort, rejection, prefix-cache hook.

No model here: each test plays the model's part by feeding update() the sampled tokens.
check_integrity() runs after every step.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from dsakv.cache.allocator import PageAllocator
from dsakv.engine.request import FinishReason, Request, RequestStatus, SamplingParams
from dsakv.engine.scheduler import Scheduler, SchedulerOutput
from dsakv.errors import CapacityError, ConfigError

P = 4  # page size


def make(num_pages: int, budget: int = 8, **kw: object) -> Scheduler:
    return Scheduler(PageAllocator(num_pages), P, max_batch_tokens=budget, **kw)  # type: ignore[arg-type]


def req(rid: str, n_prompt: int, max_new: int, first: int = 10, **kw: object) -> Request:
    return Request(rid, tuple(range(first, first + n_prompt)), SamplingParams(max_new_tokens=max_new, **kw), (1,))


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


def step(s: Scheduler, token: int = 7) -> SchedulerOutput:
    """schedule + update, sampling `token` for every chunk that reaches its request's last token."""
    out = s.schedule()
    s.update(out, [token if c.samples else None for c in out.chunks])
    s.check_integrity()
    return out


def test_chunked_prefill_then_decode_exact_pages() -> None:
    s = make(8, budget=8)
    r = req("a", 10, 3)
    s.add(r)
    s.check_integrity()
    out = s.schedule()
    assert plan(out) == [("a", 0, 8)]
    assert [c.samples for c in out.chunks] == [False]
    assert r.page_ids == [0, 1]
    s.update(out, [None])
    s.check_integrity()
    assert (r.num_computed_tokens, r.output_ids) == (8, [])
    out = step(s, 42)
    assert plan(out) == [("a", 8, 2)]
    assert r.page_ids == [0, 1, 2] and r.output_ids == [42]
    out = step(s, 43)
    assert plan(out) == [("a", 10, 1)] and r.page_ids == [0, 1, 2]
    out = step(s, 44)
    assert plan(out) == [("a", 11, 1)]
    assert r.output_ids == [42, 43, 44]
    assert r.status is RequestStatus.FINISHED and r.finish_reason is FinishReason.LENGTH
    assert r.page_ids == [] and s.allocator.num_free == 8
    assert not s.has_unfinished()
    assert s.schedule().is_empty


def test_decodes_keep_their_token_while_a_long_prompt_is_chunked() -> None:
    s = make(16, budget=8)
    a, b, c = req("a", 3, 8), req("b", 3, 8), req("long", 20, 2)
    for r in (a, b):
        s.add(r)
    assert plan(step(s)) == [("a", 0, 3), ("b", 0, 3)]
    s.add(c)
    # a and b decode (1 each); the long prompt gets the other 6 tokens of the budget
    assert plan(step(s)) == [("a", 3, 1), ("b", 3, 1), ("long", 0, 6)]
    assert plan(step(s)) == [("a", 4, 1), ("b", 4, 1), ("long", 6, 6)]
    assert (a.page_ids, b.page_ids, c.page_ids) == ([0, 4], [1, 5], [2, 3, 6])  # pages come as each grows
    assert plan(step(s)) == [("a", 5, 1), ("b", 5, 1), ("long", 12, 6)]
    out = step(s)
    assert plan(out) == [("a", 6, 1), ("b", 6, 1), ("long", 18, 2)]
    assert c.output_ids == [7] and c.page_ids == [2, 3, 6, 7, 8]


def test_preempts_newest_when_decode_needs_a_page_then_recomputes() -> None:
    s = make(4, budget=16)  # 16 tokens
    a, b = req("a", 6, 6), req("b", 6, 6, first=100)
    s.add(a)
    s.add(b)
    assert plan(step(s, 1000)) == [("a", 0, 6), ("b", 0, 6)]
    assert (a.page_ids, b.page_ids) == ([0, 1], [2, 3])
    assert plan(step(s, 1001)) == [("a", 6, 1), ("b", 6, 1)]
    assert plan(step(s, 1002)) == [("a", 7, 1), ("b", 7, 1)]
    assert s.allocator.num_free == 0
    out = step(s, 1003)  # a's token 8 needs a third page: b (newest) is preempted
    assert plan(out) == [("a", 8, 1)]
    assert out.preempted == [b]
    assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0 and b.page_ids == []
    assert b.output_ids == [1000, 1001, 1002] and b.num_preemptions == 1
    assert a.page_ids == [0, 1, 2]
    # b needs 3 pages to recompute its 9 tokens; one is free: it waits
    assert plan(step(s, 1004)) == [("a", 9, 1)]
    assert plan(step(s, 1005)) == [("a", 10, 1)]
    assert a.is_finished and a.output_ids == [1000, 1001, 1002, 1003, 1004, 1005]
    out = step(s, 2000)  # b comes back: prompt + its 3 outputs recomputed in one chunk, then its 4th token
    assert plan(out) == [("b", 0, 9)]
    assert b.page_ids == [0, 1, 2] and b.output_ids == [1000, 1001, 1002, 2000]
    for _ in range(2):
        step(s, 2001)
    assert b.is_finished and b.output_ids == [1000, 1001, 1002, 2000, 2001, 2001]
    assert s.allocator.num_free == 4 and s.num_preemptions == 1


def test_prefill_chunk_shrinks_to_its_pages_then_the_newest_preempts_itself() -> None:
    s = make(5, budget=7)
    a, b = req("a", 3, 8), req("b", 16, 1, first=40)
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [("a", 0, 3), ("b", 0, 4)]
    assert plan(step(s)) == [("a", 3, 1), ("b", 4, 6)]
    assert (a.page_ids, b.page_ids) == ([0], [1, 2, 3])
    out = step(s)  # a takes the last free page; b's chunk shrinks to the 2 slots left in its pages
    assert plan(out) == [("a", 4, 1), ("b", 10, 2)] and out.preempted == []
    assert (a.page_ids, b.page_ids, s.allocator.num_free) == ([0, 4], [1, 2, 3], 0)
    out = step(s)  # b needs a page and is the newest: it preempts itself
    assert plan(out) == [("a", 5, 1)] and out.preempted == [b]
    assert b.status is RequestStatus.WAITING and s.allocator.num_free == 3
    while s.has_unfinished():
        step(s)
    assert len(a.output_ids) == 8 and len(b.output_ids) == 1 and s.allocator.num_free == 5


def test_admission_waits_for_the_pages_of_its_first_chunk() -> None:
    s = make(4, budget=16)
    a = req("a", 6, 2)
    b = req("b", 9, 1, first=40)
    s.add(a)
    s.add(b)
    out = step(s)
    assert plan(out) == [("a", 0, 6)]  # b's chunk of 9 needs 3 pages, 2 are free: not admitted
    assert b.status is RequestStatus.WAITING and b.page_ids == []
    out = step(s)
    assert plan(out) == [("a", 6, 1)] and a.is_finished
    out = s.schedule()
    assert plan(out) == [("b", 0, 9)] and b.page_ids == [0, 1, 2]
    s.update(out, [7])
    assert b.is_finished and b.page_ids == [] and s.allocator.num_free == 4


def test_max_running_requests_bounds_admission() -> None:
    s = make(32, budget=16, max_running_requests=2)
    rs = [req(f"r{i}", 2, 2, first=10 * i) for i in range(3)]
    for r in rs:
        s.add(r)
    assert plan(step(s)) == [("r0", 0, 2), ("r1", 0, 2)]
    assert plan(step(s)) == [("r0", 2, 1), ("r1", 2, 1)]
    assert plan(step(s)) == [("r2", 0, 2)]


@pytest.mark.parametrize(
    "prompt,max_new,pat",
    [
        (
            30,
            3,
            r"prompt of 30 tokens \+ max_new_tokens 3 = 33 tokens can never fit in the KV pool of 8 pages x 4 "
            r"tokens = 32 tokens: shorten the prompt, lower max_new_tokens, or give the engine more pages",
        ),
        (10, 15, r"10 tokens \+ max_new_tokens 15 = 25 tokens is more than the model's 24 positions"),
    ],
)
def test_reject_what_can_never_fit(prompt: int, max_new: int, pat: str) -> None:
    s = make(8, max_seq_len=24)
    s.add(req("ok", 4, 2))
    step(s)
    with pytest.raises(CapacityError, match=pat):
        s.add(req("big", prompt, max_new))
    assert "big" not in s.requests and s.num_waiting == 0
    s.check_integrity()
    assert s.allocator.held_by("big").size == 0


def test_abort_mid_prefill_mid_decode_and_waiting() -> None:
    s = make(6, budget=4)
    a, b, c = req("a", 10, 4), req("b", 2, 8, first=30), req("c", 3, 2, first=60)
    for r in (a, b, c):
        s.add(r)
    assert plan(step(s)) == [("a", 0, 4)]
    assert a.page_ids == [0]
    got = s.abort("a")  # mid-prefill
    assert got is a and a.finish_reason is FinishReason.ABORT and a.page_ids == []
    s.check_integrity()
    assert s.allocator.num_free == 6
    assert plan(step(s)) == [("b", 0, 2), ("c", 0, 2)]
    assert plan(step(s)) == [("b", 2, 1), ("c", 2, 1)]
    assert b.num_output_tokens == 2 and b.page_ids == [0]
    assert s.abort("b") is b  # mid-decode
    s.check_integrity()
    d = req("d", 3, 1)
    s.add(d)
    assert s.abort("d") is d and d.status is RequestStatus.FINISHED  # while waiting
    assert s.abort("d") is None and s.abort("nope") is None
    s.check_integrity()
    while s.has_unfinished():
        step(s)
    assert s.allocator.num_free == 6 and s.allocator.owners == {}


def test_stop_reasons() -> None:
    s = make(16, budget=16)
    eos, stop, ign = req("eos", 2, 9), req("stop", 2, 9, stop_token_ids=[5]), req("ign", 2, 3, ignore_eos=True)
    for r in (eos, stop, ign):
        s.add(r)
    out = s.schedule()
    s.update(out, [1, 5, 1])
    assert (eos.finish_reason, eos.output_ids) == (FinishReason.STOP, [1])
    assert (stop.finish_reason, stop.output_ids) == (FinishReason.STOP, [5])
    assert ign.status is RequestStatus.RUNNING
    step(s, 1)
    step(s, 1)
    assert (ign.finish_reason, ign.output_ids) == (FinishReason.LENGTH, [1, 1, 1])
    s.check_integrity()


def test_duplicate_id_and_bad_limits() -> None:
    s = make(8)
    s.add(req("x", 2, 2))
    with pytest.raises(ConfigError, match="'x' is already in use"):
        s.add(req("x", 2, 2))
    with pytest.raises(ConfigError, match="max_running_requests = 9 must be in 1..max_batch_tokens \\(8\\)"):
        make(8, budget=8, max_running_requests=9)


class PagePrefixCache:
    """A whole-page prefix cache, just enough to exercise the scheduler's hook (the real one is HiCache)."""

    OWNER = ("prefix-cache",)

    def __init__(self, alloc: PageAllocator, page_size: int) -> None:
        self.alloc, self.P = alloc, page_size
        self.pages: dict[tuple[int, ...], int] = {}  # token prefix (whole pages) -> page holding its last page
        self.locks: dict[int, int] = {}
        self.calls: list[str] = []

    def match_prefix(self, token_ids: Sequence[int]) -> _Match:
        ids = []
        for k in range(1, len(token_ids) // self.P + 1):
            page = self.pages.get(tuple(token_ids[: k * self.P]))
            if page is None:
                break
            ids.append(page)
        for p in ids:
            self.locks[p] = self.locks.get(p, 0) + 1
        self.calls.append(f"match {len(ids)}")
        return _Match(np.array(ids, dtype=np.int64), len(ids) * self.P)

    def insert(self, token_ids: Sequence[int], page_ids: np.ndarray) -> None:
        self.calls.append(f"insert {len(token_ids)}")
        for k, p in enumerate(page_ids.tolist(), start=1):
            key = tuple(token_ids[: k * self.P])
            if key not in self.pages:
                self.pages[key] = p
                self.alloc.incref(np.array([p]))
                self.alloc.hold(self.OWNER, np.array([p]))

    def release(self, m: _Match) -> None:
        self.calls.append("release")
        for p in m.page_ids.tolist():
            self.locks[p] -= 1

    def evict(self, num_pages: int) -> int:
        self.calls.append(f"evict {num_pages}")
        freed = 0
        for key, p in sorted(self.pages.items(), key=lambda kv: -len(kv[0])):
            if freed >= num_pages or self.locks.get(p, 0):
                continue
            del self.pages[key]
            before = self.alloc.num_free
            self.alloc.drop(self.OWNER, np.array([p]))
            freed += self.alloc.num_free - before
        return freed


class _Match:
    def __init__(self, page_ids: np.ndarray, num_tokens: int) -> None:
        self.page_ids, self.num_tokens = page_ids, num_tokens


def test_prefix_cache_hook() -> None:
    alloc = PageAllocator(6)
    cache = PagePrefixCache(alloc, P)
    s = Scheduler(alloc, P, max_batch_tokens=16, prefix_cache=cache)
    a = req("a", 9, 1)  # tokens 10..18
    s.add(a)
    step(s)
    assert a.is_finished
    # a's 9 computed tokens -> 2 whole pages go to the cache; its third page is freed
    assert cache.calls == ["match 0", "insert 8", "release"]
    assert alloc.held_by(PagePrefixCache.OWNER).tolist() == [0, 1] and alloc.num_free == 4
    b = req("b", 10, 2)  # shares a's first 8 tokens
    s.add(b)
    out = s.schedule()
    assert plan(out) == [("b", 8, 2)] and b.num_cached_tokens == 8
    assert b.page_ids == [0, 1, 2] and alloc.refcount[:3].tolist() == [2, 2, 1]
    s.update(out, [7])
    s.check_integrity()
    assert cache.locks == {0: 1, 1: 1}
    step(s)
    assert b.is_finished and cache.locks == {0: 0, 1: 0}
    s.check_integrity()
    # a prompt that needs every page: the cache gives up its unlocked pages
    c = req("c", 20, 4, first=200)
    s.add(c)
    assert plan(step(s)) == [("c", 0, 16)] and c.page_ids == [2, 3, 4, 5]
    assert plan(step(s)) == [("c", 16, 4)]
    assert cache.calls[-2:] == ["match 0", "evict 1"] and c.page_ids == [2, 3, 4, 5, 1]
    assert alloc.held_by(PagePrefixCache.OWNER).tolist() == [0]
    while s.has_unfinished():
        step(s)
    # c's first decode token needs a 6th page: the cache gives up page 0 (a's); c's 20 + 3 computed tokens go back
    # as 5 whole pages to the cache, and its last page is freed
    assert c.output_ids == [7, 7, 7, 7] and cache.calls[-4:] == ["evict 1", "evict 1", "insert 20", "release"]
    assert sorted(alloc.held_by(PagePrefixCache.OWNER).tolist()) == [1, 2, 3, 4, 5] and alloc.num_free == 1


def test_prealloc_start_decode_and_abort_while_waiting_for_kv() -> None:
    s = make(6, budget=8)
    a = req("a", 7, 3)
    pages = s.prealloc(a)
    assert pages.tolist() == [0, 1]  # 7 prompt tokens + the first token's KV slot: 8 tokens, 2 pages
    assert a.status is RequestStatus.WAITING_KV and s.pages_of("a").tolist() == [0, 1]
    s.check_integrity()
    assert s.schedule().is_empty  # nothing runs while its KV is in flight
    s.check_integrity()
    b = req("b", 8, 2, first=50)
    assert s.prealloc(b).tolist() == [2, 3, 4]  # 8 + 1 tokens: 3 pages
    with pytest.raises(
        CapacityError,
        match=r"request c: its 5 prompt tokens need 2 pages but only 1 of 6 are free "
        r"now: retry when requests finish",
    ):
        s.prealloc(req("c", 5, 1))
    assert s.abort("b") is b and b.finish_reason is FinishReason.ABORT
    s.check_integrity()
    s.start_decode("a", 99)
    assert a.output_ids == [99] and a.num_computed_tokens == 7 and a.status is RequestStatus.WAITING
    s.check_integrity()
    out = step(s, 100)
    assert plan(out) == [("a", 7, 1)] and a.page_ids == [0, 1]  # the first decode token needs no new page
    out = step(s, 101)
    assert plan(out) == [("a", 8, 1)] and a.is_finished and a.output_ids == [99, 100, 101]
    assert s.allocator.num_free == 6
    with pytest.raises(ConfigError, match="'a' is not waiting for its KV"):
        s.start_decode("a", 1)


def test_prealloc_keep_room_leaves_every_running_request_a_page() -> None:
    """The decode worker's admission rule: a prealloc fits only if each running request still has a page to grow
    into afterwards, counting the last pages its n > 1 choices recompute; refused, it allocates nothing."""
    s = make(8, budget=16)
    s.add(req("a", 4, 6))
    step(s)
    s.add(req("b", 4, 6))
    step(s)
    assert len(s.running) == 2 and s.allocator.num_free == 5
    with pytest.raises(CapacityError) as e:
        s.prealloc(req("c", 12, 2), keep_room=True)  # 12 + 1 tokens: 4 pages; 5 - 4 < 2 running
    assert str(e.value) == "5 free pages, 4 needed + 2 kept for the running requests: retry when requests finish"
    d = req("d", 5, 2)  # 5 + 1 tokens: 2 pages, and 1 page (the 1-token last page recomputed) per other choice
    d.forks.extend(Request(f"d/{i}", d.prompt_ids, d.params, (1,)) for i in (1, 2))
    with pytest.raises(CapacityError) as e:
        s.prealloc(d, keep_room=True)
    assert str(e.value).startswith("5 free pages, 4 needed + 2 kept for the running requests")
    assert s.allocator.num_free == 5 and "c" not in s.requests and "d" not in s.requests
    assert s.prealloc(req("e", 5, 2), keep_room=True).tolist() == [3, 4]  # 5 - 2 >= 2 running
    assert s.prealloc(req("f", 8, 2)).tolist() == [5, 6, 7]  # without the rule every free page may go
    s.check_integrity()


def test_start_decode_with_a_stop_token_finishes_at_once() -> None:
    s = make(4)
    a = req("a", 3, 5)
    s.prealloc(a)
    s.start_decode("a", 1)  # eos
    assert a.finish_reason is FinishReason.STOP and a.output_ids == [1]
    assert s.allocator.num_free == 4
    s.check_integrity()


def test_keep_pages_holds_them_until_release() -> None:
    s = make(6, budget=16)
    a = req("a", 9, 1)
    a.keep_pages = True
    s.add(a)
    step(s, 42)
    assert a.is_finished and a.output_ids == [42] and a.page_ids == [0, 1, 2]
    assert s.pages_of("a").tolist() == [0, 1, 2] and s.allocator.num_free == 3
    s.check_integrity()
    with pytest.raises(ConfigError, match="'a' is already in use"):
        s.add(req("a", 2, 1))
    assert s.release("a") is a and s.allocator.num_free == 6
    assert s.release("a") is None
    with pytest.raises(ConfigError, match="'a' is unknown or finished without keep_pages"):
        s.pages_of("a")
    b = req("b", 3, 1)
    b.keep_pages = True
    s.add(b)
    step(s)
    assert s.abort("b") is b and s.allocator.num_free == 6  # abort of a kept request releases it
    s.check_integrity()


def _with_forks(rid: str, prompt: Sequence[int], n: int, max_new: int = 4) -> Request:
    params = SamplingParams(max_new_tokens=max_new, n=n)
    req = Request(rid, tuple(prompt), params)
    req.forks = [Request(f"{rid}/{i}", tuple(prompt), params, choice_index=i) for i in range(1, n)]
    return req


def test_n_sequences_count_against_max_running_requests() -> None:
    """An n > 1 request takes n running slots at admission (colocated: before its forks join at the fork; PD: its
    forks fork when it is admitted from `ready`, not at start_decode), so the running set never exceeds the cap
    (HiSparse: one hot buffer per running sequence)."""
    s = make(64, budget=64, max_running_requests=3)
    s.add(Request("a", (2,) * 5, SamplingParams(max_new_tokens=8)))
    s.schedule()
    # colocated: 1 running + 3 sequences > 3 -> waits
    s.add(_with_forks("c", (3,) * 9, n=3))
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["a"]
    # PD: prealloc + start_decode; with room for all n its forks fork at once (g: 1 + 2 <= 3) ...
    s.prealloc(_with_forks("g", (5,) * 9, n=2))
    s.start_decode("g", 7)
    assert [r.request_id for r in s.running] == ["a", "g/1"]
    # ... else they stay unforked until it is admitted (f: 2 + 2 > 3)
    s.prealloc(_with_forks("f", (4,) * 9, n=2))
    s.start_decode("f", 7)
    assert [r.request_id for r in s.running] == ["a", "g/1"] and sorted(s.unforked) == ["c/1", "c/2", "f/1"]
    out = s.schedule()  # g is admitted (3 running); f and c wait
    assert [c.request.request_id for c in out.chunks] == ["a", "g/1", "g"]
    s.abort("a")
    out = s.schedule()  # taken 2 + 2 > 3: f still waits
    assert [c.request.request_id for c in out.chunks] == ["g/1", "g"]
    s.abort("g")
    s.abort("g/1")
    out = s.schedule()  # f is admitted and forks (its forks run from the next step); c (3) still waits
    assert [c.request.request_id for c in out.chunks] == ["f"]
    assert [r.request_id for r in s.running] == ["f", "f/1"]
    s.abort("f")
    s.abort("f/1")
    out = s.schedule()
    assert [c.request.request_id for c in out.chunks] == ["c"]
    assert len(s.running) + sum(len(r.forks) for r in s.running) == 3
    s.check_integrity()
