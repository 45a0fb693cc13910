"""A prefill's cache events: the chained page hashes its prefix cache holds, for the router's prefix affinity.

    events = PrefixEvents(page_size)
    events.query(radix, since, capacity)      # CacheEvents: pages stored / removed after `since` (or the whole set)

The set is read from the RadixCache itself when the router asks (under the engine lock, in the RPC thread, so the
step loop pays nothing): every whole page of every node on the device or the host tier, named like the router
names a prompt's pages (page_hashes.page_hashes: blake2b chained from the root, int64 tokens). Each node's hashes are
memoised by (node id, key length, parent's last hash), so a walk hashes only pages that are new since the last
one. What changed since the last walk goes to a bounded CacheEventLog (page_hashes.py), from which each caller gets the
net change after its cursor. Imports dsakv.disagg.protocol.{page_hashes, messages} only; duck-typed over the radix tree
(dsakv.cache.radix), so no numpy or torch import here.
"""

from __future__ import annotations

from typing import Any

from dsakv.disagg.protocol.messages import CacheEvents
from dsakv.disagg.protocol.page_hashes import CacheEventLog, chain_hash, pack, root_hash


class PrefixEvents:
    def __init__(self, page_size: int, max_events: int = 1 << 16) -> None:
        self.page_size = page_size
        self.root = root_hash(page_size)
        self.log = CacheEventLog(max_events)
        self._memo: dict[int, tuple[int, bytes, list[bytes]]] = {}
        self.walks = 0

    def hashes(self, radix: Any) -> list[bytes]:
        """Every cached whole page of `radix` (device or host copy), as chained page hashes, parents first."""
        ps = self.page_size
        out: list[bytes] = []
        memo: dict[int, tuple[int, bytes, list[bytes]]] = {}
        stack = [(c, self.root) for c in radix.root.children.values()]
        while stack:
            node, prev = stack.pop()
            key = node.key
            got = self._memo.get(node.id)
            if got is not None and got[0] == key.size and got[1] == prev:
                hs = got[2]
            else:
                hs, h = [], prev
                raw = key.tobytes()
                step = ps * 8  # int64 tokens
                for i in range(key.size // ps):
                    h = chain_hash(h, raw[i * step : (i + 1) * step])
                    hs.append(h)
            memo[node.id] = (key.size, prev, hs)
            out += hs
            if hs:
                stack.extend((c, hs[-1]) for c in node.children.values())
        self._memo = memo  # only live nodes: bounded by the tree
        self.walks += 1
        return out

    def query(self, radix: Any | None, since: int, capacity: int, boot: str, epoch: str | None) -> CacheEvents:
        """The reply to CACHE_EVENTS(since): the set is re-read first (radix None: no prefix cache, empty)."""
        self.log.update(self.hashes(radix) if radix is not None else ())
        d = self.log.since(since)
        return CacheEvents(
            boot=boot,
            epoch=epoch,
            page_size=self.page_size,
            cursor=d.cursor,
            reset=d.reset,
            stored=pack(d.stored),
            removed=pack(d.removed),
            pages=d.pages,
            capacity=capacity,
        )
