"""PageAllocator: exact page ids, refcounts of shared pages, integrity failures detected."""

from __future__ import annotations

import numpy as np
import pytest

from dsakv.cache.allocator import IntegrityError, PageAllocator
from dsakv.errors import CapacityError


def ids(a: np.ndarray) -> list[int]:
    return [int(x) for x in a]


def test_alloc_gives_lowest_ids_first_and_reuses_freed_lowest_first() -> None:
    a = PageAllocator(8)
    assert ids(a.alloc(3, owner="r1")) == [0, 1, 2]
    assert ids(a.alloc(2, owner="r2")) == [3, 4]
    assert (a.num_free, a.num_used) == (3, 5)
    a.release("r1")
    assert a.num_free == 6
    assert ids(a.alloc(4, owner="r3")) == [0, 1, 2, 5]
    a.check_integrity()
    assert ids(a.held_by("r3")) == [0, 1, 2, 5]
    assert a.refcount.tolist() == [1, 1, 1, 1, 1, 1, 0, 0]


def test_alloc_zero_and_too_many() -> None:
    a = PageAllocator(4, name="dev")
    assert a.alloc(0).size == 0
    a.alloc(3, owner="x")
    with pytest.raises(CapacityError, match=r"dev: asked for 2 pages but only 1 of 4 are free"):
        a.alloc(2)
    assert a.num_free == 1  # a failed alloc takes nothing
    with pytest.raises(ValueError, match="alloc\\(-1\\)"):
        a.alloc(-1)
    with pytest.raises(CapacityError, match="at least one page"):
        PageAllocator(0)
    a.check_integrity()


def test_shared_prefix_refcounts() -> None:
    a = PageAllocator(6)
    first = a.alloc(3, owner="req-a")  # pages 0,1,2
    shared = first[:2]
    a.incref(shared)
    a.hold("req-b", shared)
    own = a.alloc(1, owner="req-b")
    assert ids(own) == [3]
    assert a.refcount.tolist() == [2, 2, 1, 1, 0, 0]
    a.check_integrity()
    a.release("req-a")
    assert a.refcount.tolist() == [1, 1, 0, 1, 0, 0]
    assert a.num_free == 3  # only page 2 came back
    a.check_integrity()
    a.release("req-b")
    assert a.num_free == 6
    assert a.refcount.tolist() == [0] * 6
    assert a.owners == {}
    a.check_integrity()
    # the free list is a stack: the last release (0, 1, 3) comes out first, lowest id first
    assert ids(a.alloc(6)) == [0, 1, 3, 2, 4, 5]


def test_unhold_and_drop_remove_one_occurrence_each() -> None:
    a = PageAllocator(4)
    p = a.alloc(2, owner="o")
    a.incref(p[:1])
    a.hold("o", p[:1])  # "o" holds page 0 twice
    assert sorted(ids(a.held_by("o"))) == [0, 0, 1]
    a.drop("o", np.array([0, 1]))
    assert ids(a.held_by("o")) == [0]
    assert a.refcount.tolist() == [1, 0, 0, 0]
    a.check_integrity()
    with pytest.raises(IntegrityError, match=r"owner 'o' does not hold page\(s\) \[3\]"):
        a.unhold("o", np.array([3]))
    with pytest.raises(IntegrityError, match="holds nothing"):
        a.unhold("nobody", np.array([0]))
    a.drop("o", np.array([0]))
    assert a.owners == {} and a.num_free == 4


def test_double_free_is_detected_and_changes_nothing() -> None:
    a = PageAllocator(4)
    p = a.alloc(2, owner="r")
    a.release("r")
    with pytest.raises(IntegrityError, match=r"double free of page\(s\) \[0, 1\]"):
        a.free(p)
    assert a.refcount.tolist() == [0, 0, 0, 0] and a.num_free == 4
    a.check_integrity()
    q = a.alloc(1, owner="s")
    with pytest.raises(IntegrityError, match=r"double free of page\(s\) \[0\]"):
        a.free(np.array([0, 0]))
    assert a.refcount[q].tolist() == [1]
    a.check_integrity()


def test_incref_of_free_page_is_rejected() -> None:
    a = PageAllocator(3)
    with pytest.raises(IntegrityError, match=r"incref of free page\(s\) \[2\]"):
        a.incref(np.array([2]))


def test_leak_is_detected() -> None:
    a = PageAllocator(5)
    a.alloc(2, owner="r")
    a.alloc(1)  # page 2 allocated, held by nobody
    with pytest.raises(IntegrityError, match=r"page\(s\) \[2\] are allocated .* held by no owner: a page leaked"):
        a.check_integrity()


def test_holder_refcount_mismatch_is_detected() -> None:
    a = PageAllocator(5)
    p = a.alloc(2, owner="r")
    a.incref(p[:1])  # a second reference nobody recorded
    msg = r"refcounts do not match holders at page\(s\) \[0\] \(refcount \[2\], held \[1\]\)"
    with pytest.raises(IntegrityError, match=msg):
        a.check_integrity()


def test_holding_a_free_page_is_detected() -> None:
    a = PageAllocator(5)
    a.hold("ghost", np.array([4]))
    with pytest.raises(IntegrityError, match=r"refcounts do not match holders at page\(s\) \[4\]"):
        a.check_integrity()


def test_corrupt_free_list_is_detected() -> None:
    a = PageAllocator(4)
    a.alloc(1, owner="r")
    a._free[0] = a._free[1]  # same page on the free list twice
    with pytest.raises(IntegrityError, match="on the free list twice"):
        a.check_integrity()


def test_release_unknown_owner_is_a_no_op_and_vectorised_paths_scale() -> None:
    a = PageAllocator(10_000)
    assert a.release("nobody").size == 0
    p = a.alloc(10_000, owner="big")
    a.incref(p)
    a.hold("twin", p)
    a.drop("twin", p[::-1])
    a.check_integrity()
    assert a.release("big").size == 10_000
    assert a.num_free == 10_000
    a.check_integrity()
