"""RadixCache: the logical prefix index over device (and host) pages, at page granularity.

A node holds a run of whole pages: `key` is its tokens (a multiple of page_size),
`device` / `host` the page ids holding them in each tier (None when absent).
Children are keyed by the tokens of their first page; a node is split at a page
boundary when a match or an insert diverges inside it. Only full pages are
cached or matched: a partial last page is never shared.

    root ── [p0 p1 p2] ── [p3 p4]        device  (both tiers)
                     └─── [p3' ]         host    (offloaded)

Pages are held through the PageAllocators: a node holds one reference to each
of its pages under owner ("radix", node id), so every allocator's
check_integrity() proves free + held-by-requests + held-by-cache == total.

Invariants (check_integrity):
- every node except the root has a copy in at least one tier;
- device copies are prefix-closed: a node on the device has its parent on the device;
- a locked node (lock_ref > 0; locks count up to the root) is never dropped from the device,
  and a locked node with no device copy (a load in progress) keeps its host copy.

Eviction is LRU over the leaves of each tier (see device_victims / host_victims);
what happens to an evicted device copy (offload or drop) is the caller's choice
(dsakv.cache.hicache). Imports numpy and dsakv.cache.allocator only; no torch.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence

import numpy as np
import numpy.typing as npt

from dsakv.cache.allocator import IntArray, IntegrityError, PageAllocator

_EMPTY = np.zeros(0, dtype=np.int64)


def as_tokens(tokens: Sequence[int] | npt.ArrayLike) -> npt.NDArray[np.int64]:
    return np.asarray(tokens, dtype=np.int64).reshape(-1)


class RadixNode:
    __slots__ = ("id", "key", "parent", "children", "device", "host", "lock_ref", "last_access", "hit_count")

    def __init__(self, node_id: int, key: npt.NDArray[np.int64], parent: RadixNode | None) -> None:
        self.id = node_id
        self.key = key
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.device: IntArray | None = None
        self.host: IntArray | None = None
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0

    @property
    def owner(self) -> tuple[str, int]:
        return ("radix", self.id)

    @property
    def num_pages(self) -> int:
        return int(self.device.size if self.device is not None else self.host.size if self.host is not None else 0)

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def on_host(self) -> bool:
        return self.host is not None

    def __repr__(self) -> str:
        where = "+".join(t for t, on in (("device", self.on_device), ("host", self.on_host)) if on) or "none"
        return f"RadixNode(id={self.id}, tokens={self.key.size}, {where}, lock={self.lock_ref})"


class RadixCache:
    """Prefix index over page runs; holds its pages in `device_alloc` (and `host_alloc` when there is a host tier)."""

    def __init__(self, page_size: int, device_alloc: PageAllocator, host_alloc: PageAllocator | None = None) -> None:
        if page_size < 1:
            raise ValueError(f"page_size = {page_size} must be >= 1")
        self.page_size = page_size
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc
        self._ids = itertools.count(1)
        self._clock = itertools.count(1)
        self.root = RadixNode(0, _EMPTY, None)
        self.root.lock_ref = 1
        self.root.device = _EMPTY

    # ---- walking ------------------------------------------------------------------

    def _page_key(self, tokens: npt.NDArray[np.int64], page: int) -> bytes:
        ps = self.page_size
        return tokens[page * ps : (page + 1) * ps].tobytes()

    def _common_pages(self, node: RadixNode, tokens: npt.NDArray[np.int64], page: int) -> int:
        """Whole pages of node.key equal to tokens from page `page` on (>= 1: the first page matched the child key)."""
        ps = self.page_size
        n = min(node.key.size, tokens.size - page * ps) // ps
        same = (node.key[: n * ps] == tokens[page * ps : (page + n) * ps]).reshape(n, ps).all(axis=1)
        bad = np.flatnonzero(~same)
        return int(bad[0]) if bad.size else n

    def match(self, tokens: Sequence[int] | npt.ArrayLike) -> list[RadixNode]:
        """Nodes (root excluded) covering the longest cached run of whole pages of `tokens`, splitting the last one
        if the match ends inside it. Touches them (LRU). Nothing is locked or loaded."""
        toks = as_tokens(tokens)
        n_pages = toks.size // self.page_size
        path: list[RadixNode] = []
        node, page = self.root, 0
        now = next(self._clock)
        while page < n_pages:
            child = node.children.get(self._page_key(toks, page))
            if child is None:
                break
            common = self._common_pages(child, toks, page)
            if common < child.num_pages:
                child = self._split(child, common)
            child.last_access = now
            path.append(child)
            node, page = child, page + common
        return path

    def _split(self, node: RadixNode, pages: int) -> RadixNode:
        """Split `node` after `pages` pages; returns the new parent holding the first part."""
        assert 0 < pages < node.num_pages
        ps = self.page_size
        parent = node.parent
        assert parent is not None
        head = RadixNode(next(self._ids), node.key[: pages * ps], parent)
        head.lock_ref, head.last_access, head.hit_count = node.lock_ref, node.last_access, node.hit_count
        for tier, alloc in (("device", self.device_alloc), ("host", self.host_alloc)):
            ids = getattr(node, tier)
            if ids is None:
                continue
            assert alloc is not None
            # re-book the node's references in two owners without letting any refcount touch 0
            alloc.incref(ids)
            alloc.release(node.owner)
            alloc.hold(head.owner, ids[:pages])
            alloc.hold(node.owner, ids[pages:])
            setattr(head, tier, ids[:pages].copy())
            setattr(node, tier, ids[pages:].copy())
        node.key = node.key[pages * ps :]
        parent.children[self._page_key(head.key, 0)] = head
        head.children[self._page_key(node.key, 0)] = node
        node.parent = head
        return head

    def path_to(self, node: RadixNode) -> list[RadixNode]:
        """Root-excluded path from the root down to `node`."""
        out = []
        n: RadixNode | None = node
        while n is not None and n is not self.root:
            out.append(n)
            n = n.parent
        return out[::-1]

    def prefix_tokens(self, node: RadixNode) -> npt.NDArray[np.int64]:
        """All tokens from the root to the end of `node`."""
        path = self.path_to(node)
        return np.concatenate([n.key for n in path]) if path else _EMPTY

    def nodes(self) -> Iterator[RadixNode]:
        """Every node except the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # ---- insert -------------------------------------------------------------------

    def insert(
        self, tokens: Sequence[int] | npt.ArrayLike, page_ids: npt.ArrayLike
    ) -> tuple[list[RadixNode], list[RadixNode], list[RadixNode]]:
        """Cache the whole pages of `tokens` held in device pages `page_ids` (page i holds tokens
        [i*page_size, (i+1)*page_size)). The cache takes its own reference on every page it keeps.

        Returns (path, new nodes, adopted nodes): adopted nodes were on the host only and now also
        use the caller's device pages (no load needed)."""
        toks = as_tokens(tokens)
        ids = np.asarray(page_ids, dtype=np.int64).reshape(-1)
        n_pages = min(toks.size // self.page_size, ids.size)
        toks = toks[: n_pages * self.page_size]
        path: list[RadixNode] = []
        new: list[RadixNode] = []
        adopted: list[RadixNode] = []
        node, page = self.root, 0
        now = next(self._clock)
        while page < n_pages:
            child = node.children.get(self._page_key(toks, page))
            if child is None:
                child = RadixNode(next(self._ids), toks[page * self.page_size :].copy(), node)
                node.children[self._page_key(child.key, 0)] = child
                self._set_device(child, ids[page:n_pages])
                child.last_access = now
                path.append(child)
                new.append(child)
                break
            common = self._common_pages(child, toks, page)
            if common < child.num_pages:
                child = self._split(child, common)
            if child.device is None:
                self._set_device(child, ids[page : page + common])
                adopted.append(child)
            child.last_access = now
            path.append(child)
            node, page = child, page + common
        return path, new, adopted

    def _set_device(self, node: RadixNode, ids: IntArray) -> None:
        assert node.device is None
        ids = ids.copy()
        self.device_alloc.incref(ids)
        self.device_alloc.hold(node.owner, ids)
        node.device = ids

    def set_device(self, node: RadixNode, ids: IntArray) -> None:
        """Give `node` a device copy in pages `ids`, which the caller allocated (refcount 1, now the cache's)."""
        if node.device is not None or ids.size * self.page_size != node.key.size:
            raise IntegrityError(f"{node}: cannot take {ids.size} device pages")
        self.device_alloc.hold(node.owner, ids)
        node.device = ids.copy()

    def set_host(self, node: RadixNode, ids: IntArray) -> None:
        """Give `node` a host copy in host pages `ids`, which the caller allocated (refcount 1, now the cache's)."""
        assert self.host_alloc is not None
        if node.host is not None or ids.size * self.page_size != node.key.size:
            raise IntegrityError(f"{node}: cannot take {ids.size} host pages")
        self.host_alloc.hold(node.owner, ids)
        node.host = ids.copy()

    def add_child(self, parent: RadixNode, tokens: npt.NDArray[np.int64], device_ids: IntArray) -> RadixNode:
        """A new leaf under `parent` for `tokens` (whole pages, no existing child with that first page),
        on the device in caller-allocated pages `device_ids` (now the cache's)."""
        key = self._page_key(tokens, 0)
        if key in parent.children or tokens.size != device_ids.size * self.page_size or tokens.size == 0:
            raise IntegrityError(f"cannot add a child of {tokens.size} tokens / {device_ids.size} pages to {parent}")
        child = RadixNode(next(self._ids), tokens.copy(), parent)
        parent.children[key] = child
        self.set_device(child, device_ids)
        child.last_access = next(self._clock)
        return child

    # ---- locks --------------------------------------------------------------------

    def lock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None:
            n.lock_ref += 1
            n = n.parent

    def unlock(self, node: RadixNode) -> None:
        n: RadixNode | None = node
        while n is not None:
            if n.lock_ref <= 0 or (n is self.root and n.lock_ref <= 1):
                raise IntegrityError(f"unlock of {n} which is not locked")
            n.lock_ref -= 1
            n = n.parent

    # ---- dropping copies ----------------------------------------------------------

    def drop_device(self, node: RadixNode) -> None:
        """Forget the device copy of `node` (a device leaf, unlocked). A node left with no copy is removed
        with its subtree (whose nodes can then only be on the host)."""
        if node.device is None or node.lock_ref > 0 or any(c.on_device for c in node.children.values()):
            raise IntegrityError(f"cannot drop the device copy of {node}: not an unlocked device leaf")
        self.device_alloc.release(node.owner)
        node.device = None
        if node.host is None:
            self._remove(node)

    def drop_host(self, node: RadixNode) -> None:
        """Forget the host copy of `node`; a node left with no copy is removed with its subtree."""
        assert self.host_alloc is not None
        if node.host is None or (node.device is None and node.lock_ref > 0):
            raise IntegrityError(f"cannot drop the host copy of {node}: not on the host, or a load needs it")
        self.host_alloc.release(node.owner)
        node.host = None
        if node.device is None:
            self._remove(node)

    def _remove(self, node: RadixNode) -> None:
        stack = [node]
        while stack:
            n = stack.pop()
            if n.device is not None or n.lock_ref > 0:
                raise IntegrityError(f"removing {n}: it is on the device or locked")
            if n.host is not None:
                assert self.host_alloc is not None
                self.host_alloc.release(n.owner)
                n.host = None
            stack.extend(n.children.values())
        assert node.parent is not None
        del node.parent.children[self._page_key(node.key, 0)]
        node.parent = None

    # ---- eviction candidates (LRU) ---------------------------------------------------

    def device_victims(self, num_pages: int) -> list[RadixNode]:
        """Unlocked device leaves, least recently used first, until they cover `num_pages` pages."""
        cands = [
            (n.last_access, n.id, n)
            for n in self.nodes()
            if n.on_device and n.lock_ref == 0 and not any(c.on_device for c in n.children.values())
        ]
        return self._take(cands, num_pages)

    def host_victims(self, num_pages: int) -> list[RadixNode]:
        """Host copies that may go, least recently used first, until they cover `num_pages` pages: copies of
        nodes also on the device, and host-only unlocked leaves."""
        cands = [
            (n.last_access, n.id, n)
            for n in self.nodes()
            if n.on_host and (n.on_device or (n.lock_ref == 0 and not n.children))
        ]
        return self._take(cands, num_pages)

    @staticmethod
    def _take(cands: list[tuple[int, int, RadixNode]], num_pages: int) -> list[RadixNode]:
        heapq.heapify(cands)
        out, got = [], 0
        while cands and got < num_pages:
            _, _, n = heapq.heappop(cands)
            out.append(n)
            got += n.num_pages
        return out

    # ---- accounting -----------------------------------------------------------------

    @property
    def device_pages(self) -> int:
        return sum(n.device.size for n in self.nodes() if n.device is not None)

    @property
    def host_pages(self) -> int:
        return sum(n.host.size for n in self.nodes() if n.host is not None)

    @property
    def evictable_device_pages(self) -> int:
        return sum(n.device.size for n in self.nodes() if n.device is not None and n.lock_ref == 0)

    def check_integrity(self) -> None:
        """Raise IntegrityError unless the tree's invariants hold and its pages match the allocators' books."""
        ps = self.page_size
        for n in self.nodes():
            if n.device is None and n.host is None:
                raise IntegrityError(f"{n} has no copy in any tier")
            if n.key.size == 0 or n.key.size % ps:
                raise IntegrityError(f"{n} holds {n.key.size} tokens, not a positive multiple of page size {ps}")
            for tier, ids, alloc in (("device", n.device, self.device_alloc), ("host", n.host, self.host_alloc)):
                if ids is None:
                    continue
                if ids.size * ps != n.key.size:
                    raise IntegrityError(f"{n}: {ids.size} {tier} pages for {n.key.size} tokens")
                assert alloc is not None
                if not np.array_equal(np.sort(alloc.held_by(n.owner)), np.sort(ids)):
                    raise IntegrityError(f"{n}: {tier} allocator books differ from the node's pages")
            assert n.parent is not None
            if n.on_device and not n.parent.on_device:
                raise IntegrityError(f"{n} is on the device but its parent {n.parent} is not")
            if n.lock_ref > n.parent.lock_ref and n.parent is not self.root:
                raise IntegrityError(f"{n} has more locks than its parent {n.parent}")
            if n.parent.children.get(n.key[:ps].tobytes()) is not n:
                raise IntegrityError(f"{n} is not registered under its parent")
