"""RadixCache: page-granular prefix matching, splits, locks, LRU victims, allocator books."""

from __future__ import annotations

import numpy as np
import pytest

from dsakv.cache.allocator import IntegrityError, PageAllocator
from dsakv.cache.radix import RadixCache

PS = 4


def _request_pages(alloc: PageAllocator, owner: str, n: int) -> np.ndarray:
    ids = alloc.alloc(n)
    alloc.hold(owner, ids)
    return ids


def _cache(num_pages: int = 16) -> tuple[RadixCache, PageAllocator]:
    alloc = PageAllocator(num_pages, "device")
    return RadixCache(PS, alloc), alloc


def test_insert_holds_whole_pages_and_balances_books() -> None:
    cache, alloc = _cache()
    ids = _request_pages(alloc, "r1", 3)  # pages 0, 1, 2
    assert ids.tolist() == [0, 1, 2]
    path, new, adopted = cache.insert(list(range(100, 110)), ids)  # 10 tokens: 2 whole pages
    assert [n.num_pages for n in new] == [2] and adopted == []
    assert new[0].device.tolist() == [0, 1]
    assert alloc.refcount[:3].tolist() == [2, 2, 1]
    alloc.release("r1")
    alloc.check_integrity()
    cache.check_integrity()
    assert alloc.num_free == 14
    assert alloc.held_by(new[0].owner).tolist() == [0, 1]


def test_match_is_page_granular_and_splits() -> None:
    cache, alloc = _cache()
    ids = _request_pages(alloc, "r", 3)
    cache.insert(np.arange(12), ids)
    alloc.release("r")
    assert cache.match(np.arange(3)) == []  # less than a page
    path = cache.match(np.arange(14))
    assert len(path) == 1 and path[0].device.tolist() == [0, 1, 2]
    # diverge inside page 2: the node is split after 2 pages
    path = cache.match([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 11])
    assert len(path) == 1
    head = path[0]
    assert head.key.tolist() == list(range(8)) and head.device.tolist() == [0, 1]
    (tail,) = head.children.values()
    assert tail.device.tolist() == [2] and tail.key.tolist() == [8, 9, 10, 11]
    assert alloc.held_by(head.owner).tolist() == [0, 1] and alloc.held_by(tail.owner).tolist() == [2]
    assert alloc.refcount[:3].tolist() == [1, 1, 1]
    alloc.check_integrity()
    cache.check_integrity()


def test_branches_share_prefix_and_second_insert_frees_duplicates() -> None:
    cache, alloc = _cache()
    a = _request_pages(alloc, "a", 3)  # 0 1 2
    cache.insert(np.arange(12), a)
    alloc.release("a")
    b = _request_pages(alloc, "b", 3)  # 3 4 5: same first page, different after
    toks = np.concatenate([np.arange(4), np.arange(50, 58)])
    path, new, _ = cache.insert(toks, b)
    assert [n.device.tolist() for n in path] == [[0], [4, 5]]
    alloc.release("b")  # page 3 duplicated page 0: it goes back to the free list
    assert alloc.refcount[3] == 0 and alloc.num_free == 16 - 5
    assert sorted(n.key[0] for n in cache.root.children[np.arange(4).tobytes()].children.values()) == [4, 50]
    alloc.check_integrity()
    cache.check_integrity()


def test_locks_protect_and_lru_orders_victims() -> None:
    cache, alloc = _cache()
    for i, owner in enumerate(("x", "y", "z")):
        ids = _request_pages(alloc, owner, 2)
        cache.insert(np.arange(8) + 1000 * (i + 1), ids)
        alloc.release(owner)
    x, y, z = (cache.match(np.arange(8) + 1000 * (i + 1))[0] for i in range(3))
    cache.match(np.arange(8) + 1000)  # x used last
    assert [n.key[0] for n in cache.device_victims(6)] == [2000, 3000, 1000]
    cache.lock(y)
    assert [n.key[0] for n in cache.device_victims(6)] == [3000, 1000]
    with pytest.raises(IntegrityError):
        cache.drop_device(y)
    cache.drop_device(z)
    assert alloc.num_free == 16 - 4 and z.parent is None
    cache.unlock(y)
    with pytest.raises(IntegrityError):
        cache.unlock(y)
    alloc.check_integrity()
    cache.check_integrity()


def test_only_device_leaves_are_victims() -> None:
    cache, alloc = _cache()
    ids = _request_pages(alloc, "r", 4)
    cache.insert(np.arange(16), ids)
    alloc.release("r")
    cache.match([0, 1, 2, 3, 4, 5, 6, 7, 9, 9, 9, 9])  # split after 2 pages
    (v,) = cache.device_victims(1)
    assert v.key[0] == 8 and v.device.tolist() == [2, 3]
    cache.drop_device(v)
    (v,) = cache.device_victims(1)
    assert v.device.tolist() == [0, 1]
    cache.drop_device(v)
    assert alloc.num_free == 16 and list(cache.nodes()) == []
    alloc.check_integrity()
    cache.check_integrity()


def test_insert_adopts_request_pages_for_host_only_nodes() -> None:
    alloc, host = PageAllocator(8, "device"), PageAllocator(8, "host")
    cache = RadixCache(PS, alloc, host)
    ids = _request_pages(alloc, "a", 2)
    (node,), _, _ = cache.insert(np.arange(8), ids)
    alloc.release("a")
    cache.set_host(node, host.alloc(2))
    cache.drop_device(node)
    assert node.device is None and node.host.tolist() == [0, 1] and alloc.num_free == 8
    b = _request_pages(alloc, "b", 2)
    _, new, adopted = cache.insert(np.arange(8), b)
    assert new == [] and adopted == [node] and node.device.tolist() == b.tolist()
    alloc.release("b")
    assert alloc.refcount[b].tolist() == [1, 1]
    cache.drop_host(node)
    assert host.num_free == 8 and node.device is not None
    alloc.check_integrity()
    host.check_integrity()
    cache.check_integrity()
