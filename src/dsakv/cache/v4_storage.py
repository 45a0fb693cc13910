"""V4Storage: the L3 tier (cache/storage: a Mooncake Store, or the page-file disk tier) for DeepSeek-V4 prefixes.

A V4 prefix of k whole pages is reusable only with every kind its layers read, so L3 keeps two kinds of objects,
each through one StorageBackend of the project's (the same record, word sum and keyed MAC as V3.2 pages, checked
on every read; nothing of the format is forked here):

    page i      every paged kind of page i, each only on the layers that read it (CSA_KV and CSA_INDEX_K of CSA
                layers, HCA_KV of HCA layers, in layout order): `layout.bytes_per_page` bytes, named by the
                chained hash h[i] of the tokens up to its end (`V4StoredLayout(layout, "pages")`)
    state @ k   the request's state at the boundary k x page_size (the window ring of every layer, the CSA /
                indexer / HCA compressor state of the layers that have one): `layout.state_bytes_per_request`
                bytes, named by h[k-1] under the state layout's own identity (`V4StoredLayout(layout, "state")`)

`put` writes pages 0..k-1 then the state at k; `lookup` is the longest k whose pages are all present and whose
state at k is; `load` reads them into device pages and a slot. A read that fails any check (missing, another
identity or size, word sum, MAC) is counted and loads nothing: the request computes the whole prompt (a shorter
prefix is no use without the state at its own boundary). Pages move through a CPU staging V4Pool of
`staging_pages` pages and one slot (the memory the backend registers), in chunks of that many pages.
Imports torch and dsakv.cache (storage, v4_pool); must not import model or engine.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch

from dsakv.cache.storage import Segments, StorageBackend, StorageError, make_storage
from dsakv.cache.v4_pool import V4Pool
from dsakv.config import StorageConfig
from dsakv.spec.v4_layout import V4Layout
from dsakv.util.stats import Stats

log = logging.getLogger(__name__)
PARTS = ("pages", "state")


@dataclass(frozen=True)
class V4StoredLayout:
    """What the storage tier sees of a V4 layout: its paged kinds per page (`part="pages"`) or one request's
    boundary state (`part="state"`) as a 'page' of page_size tokens. `identity()` names every key it holds."""

    layout: V4Layout
    part: str = "pages"

    def __post_init__(self) -> None:
        if self.part not in PARTS:
            raise ValueError(f"V4 stored part {self.part!r}: use one of {', '.join(PARTS)}")

    @property
    def page_size(self) -> int:
        return self.layout.page

    @property
    def bytes_per_page(self) -> int:
        lay = self.layout
        return lay.bytes_per_page if self.part == "pages" else lay.state_bytes_per_request

    @property
    def bytes_per_token(self) -> Fraction:
        return Fraction(self.bytes_per_page, self.page_size)

    def identity(self) -> dict[str, object]:
        lay = self.layout
        bufs = (
            [[b.key.layer, b.key.kind.value, b.page_bytes] for b in lay.paged]
            if self.part == "pages"
            else [[s.key.layer, s.key.kind.value, s.slot_bytes] for s in lay.states]
        )
        return {"arch": "deepseek_v4", "part": self.part, **lay.identity(), "keys": bufs}


@dataclass
class L3Stats(Stats):
    """The L3 tier's counters (the V4 engine's cache stats show them by these names)."""

    l3_page_writes: int = 0  # pages stored
    l3_state_writes: int = 0  # prefix states stored
    l3_hits: int = 0  # prefixes loaded
    l3_hit_tokens: int = 0  # ... their tokens
    l3_refused: int = 0  # loads refused (a page or state missing or failing its check)
    l3_errors: int = 0  # storage errors (store, lookup, load)


class V4Storage:
    """L3 of one V4 engine (see module docstring). `stats`: pages / states written, hits, refused reads."""

    def __init__(
        self, layout: V4Layout, model_hash: str | None, config: StorageConfig, staging_pages: int = 16
    ) -> None:
        self.layout = layout
        self.stage = V4Pool(layout, max(1, staging_pages), 1, "cpu")
        self.pages: StorageBackend = make_storage(V4StoredLayout(layout, "pages"), model_hash, config)
        try:
            self.states: StorageBackend = make_storage(V4StoredLayout(layout, "state"), model_hash, config)
            for b in layout.paged:  # the memory each backend reads into and writes from
                self.pages.register(self.stage.paged(b.key).data_ptr(), self.stage.nbytes_of(b.key))
            for st in layout.states:
                self.states.register(self.stage.state(st.key).data_ptr(), self.stage.nbytes_of(st.key))
        except BaseException:
            self.pages.close()
            if hasattr(self, "states"):
                self.states.close()
            raise
        self.stats = L3Stats()
        self.last_refusal = ""

    # ---- segments of the staging pool ------------------------------------------------

    def _page_segs(self, i: int) -> Segments:
        return [(int(self.stage.paged(b.key)[i].data_ptr()), b.page_bytes) for b in self.layout.paged]

    def _state_segs(self) -> Segments:
        return [(int(self.stage.state(s.key)[0].data_ptr()), s.slot_bytes) for s in self.layout.states]

    def hashes(self, tokens: Sequence[int], num_pages: int) -> list[str]:
        return self.pages.page_hashes(np.asarray(tokens[: num_pages * self.layout.page], dtype=np.int64))

    # ---- write: pages 0..k-1 of the prefix, then the state at its boundary --------------

    def put(self, tokens: Sequence[int], pool: V4Pool, page_ids: np.ndarray, slot: int) -> bool:
        """Store the prefix of len(page_ids) whole pages of `tokens` from `pool` (pages `page_ids`, state in
        `slot`, taken at the boundary). False (logged, counted) when the store fails: nothing is a hit then."""
        k = len(page_ids)
        hs = self.hashes(tokens, k)
        n = self.stage.num_pages
        try:
            for s in range(0, k, n):
                ids = torch.from_numpy(np.asarray(page_ids[s : s + n], dtype=np.int64)).to(pool.device)
                m = int(ids.numel())
                for b in self.layout.paged:
                    self.stage.paged(b.key)[:m] = pool.paged(b.key)[ids].to("cpu")
                self.stats.l3_page_writes += self.pages.put(hs[s : s + m], [self._page_segs(i) for i in range(m)])
            for st in self.layout.states:
                self.stage.state(st.key)[0] = pool.state(st.key)[slot].to("cpu")
            self.stats.l3_state_writes += self.states.put([hs[-1]], [self._state_segs()])
        except StorageError as e:
            self.stats.l3_errors += 1
            log.warning("V4 L3: storing a %d-page prefix failed (%s); it is not a hit", k, e)
            return False
        return True

    # ---- read ---------------------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], max_pages: int) -> int:
        """The longest k <= max_pages whose pages 0..k-1 and state at k are all stored (0: none)."""
        if max_pages < 1:
            return 0
        hs = self.hashes(tokens, max_pages)
        try:
            n = self.pages.count_present(hs)
            for k in range(n, 0, -1):
                if self.states.count_present([hs[k - 1]]) == 1:
                    return k
        except StorageError as e:
            self.stats.l3_errors += 1
            log.warning("V4 L3: lookup failed (%s); computing instead", e)
        return 0

    def load(self, tokens: Sequence[int], k: int, pool: V4Pool, page_ids: np.ndarray, slot: int) -> bool:
        """Read the prefix of k pages into `pool` pages `page_ids[:k]` and `slot`; True when every page and the
        state passed every check (False: counted, the caller computes; what was copied is overwritten then)."""
        hs = self.hashes(tokens, k)
        n = self.stage.num_pages
        try:
            res = self.states.get([hs[-1]], [self._state_segs()])
            if res.n < 1:
                return self._refused(res.reason, "state")
            for s in range(0, k, n):
                m = min(n, k - s)
                res = self.pages.get(hs[s : s + m], [self._page_segs(i) for i in range(m)])
                if res.n < m:
                    return self._refused(res.reason, f"page {s + res.n}")
                ids = torch.from_numpy(np.asarray(page_ids[s : s + m], dtype=np.int64)).to(pool.device)
                for b in self.layout.paged:
                    pool.paged(b.key)[ids] = self.stage.paged(b.key)[:m].to(pool.device)
        except StorageError as e:
            self.stats.l3_errors += 1
            log.warning("V4 L3: loading a %d-page prefix failed (%s); computing instead", k, e)
            return False
        for st in self.layout.states:  # the states object was read first, and the staging slot is not reused
            pool.state(st.key)[slot] = self.stage.state(st.key)[0].to(pool.device)
        self.stats.l3_hits += 1
        self.stats.l3_hit_tokens += k * self.layout.page
        return True

    def _refused(self, reason: str, what: str) -> bool:
        self.stats.l3_refused += 1
        self.last_refusal = f"{what}: {reason or 'missing'}"
        log.warning("V4 L3: %s refused (%s); computing the prompt instead", what, reason or "missing")
        return False

    def close(self) -> None:
        self.pages.close()
        self.states.close()
