"""What every attention layer of one step shares (StepContext: token positions, slot tables, rope, the pool, and
what several layers derive from them, memoised), the top-k type and the RowSource hook HiSparse implements.
Re-exported by model.attention. Imports torch, dsakv.cache and dsakv.model.rope."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from dsakv.cache.kv_access import TokenAccess
from dsakv.model.rope import rotation_matrix

# Bound on the elements of one score (or gathered-row) block; longer prefills are split into query blocks.
SCORE_BLOCK_ELEMS = 1 << 24
# Dense (expanded) attention runs queries in blocks of this many, each against its causal key prefix only: a
# t-token chunk then scores ~t^2/2 (query, key) pairs instead of t^2. Shorter chunks run as one block.
ATTN_QUERY_BLOCK = 128

TopK = torch.Tensor  # int64 [T, index_topk]: selected key positions per token, ascending, -1 padded


class RowSource(Protocol):
    """Where the absorbed path reads the selected KV rows instead of pool-by-slot (HiSparse: a hot device buffer,
    dsakv.cache.hisparse.HiSparseStep): told each producer's top-k first, then asked for the rows."""

    def on_topk(self, producer: int, topk: TopK, mla_path: str) -> None: ...

    def read_selected(
        self, layer: int, sel: torch.Tensor, valid: torch.Tensor, table: torch.Tensor, tok_seq: torch.Tensor, q0: int
    ) -> torch.Tensor: ...


@dataclass
class StepContext:
    """What every layer of one step shares: where each token sits, the slot table, rope tables, the pool.

    Whatever several layers derive from the same inputs (padded slots, the causal mask, the slots and mask
    of a top-k selection, rope matrices) is built once per step and memoised here.
    """

    out_slots: torch.Tensor  # int64 [T]
    cos: torch.Tensor  # [T, rope_dim / 2]
    sin: torch.Tensor
    pool: TokenAccess
    table: torch.Tensor  # int64 [B, S_max] token slots of each sequence (-1 beyond its length)
    seq_lens: torch.Tensor  # int64 [B]
    tok_seq: torch.Tensor  # int64 [T] sequence of each new token
    qpos: torch.Tensor  # int64 [T] position of each new token in its sequence
    s_max: int
    index_topk: int
    mla_path: str  # "absorbed" or "expanded", chosen once per step
    decode_only: bool  # every sequence has one new token (T == B, tok_seq == arange(B))
    # every token has at least min(index_topk, S_max) causal keys (no top-k pick can be non-causal); False
    # when unknown
    full_topk: bool = False
    t_max: int = 1  # most new tokens of one sequence in this step (max extend length)
    _memo: dict[str, torch.Tensor] = field(default_factory=dict)
    _qk_blocks: list[tuple[int, int, int]] | None = None
    _ropes: dict[tuple[int, bool, torch.dtype], torch.Tensor] = field(default_factory=dict)
    rows: RowSource | None = None  # None: selected rows are read from `pool` by slot
    _selections: list[tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]] = field(
        default_factory=list
    )

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.shape[0])

    @property
    def k_sel(self) -> int:
        """Top-k columns any token of the step can fill: min(index_topk, S_max)."""
        return min(self.index_topk, self.s_max)

    def all_causal_topk(self) -> TopK | None:
        """index_topk >= S_max: every causal key of every token is picked whatever the scores, so the top-k is each
        token's causal positions ascending, -1 padded (exactly what canonical_topk makes of any scores); the
        indexer need not score. None when the top-k is a real choice."""
        if self.index_topk < self.s_max:
            return None
        if "allcausal" not in self._memo:
            cols = torch.arange(self.index_topk, device=self.qpos.device)
            self._memo["allcausal"] = torch.where(cols[None, :] <= self.qpos[:, None], cols, -1)
        return self._memo["allcausal"]

    def query_key_blocks(self) -> list[tuple[int, int, int]]:
        """(j0, j1, kend) blocks of the padded queries [B, t_max]: every query in [j0, j1) of every sequence sits
        before key position kend (keys at kend.. are masked for the whole block: causal). One block
        (0, t_max, S_max) when t_max <= ATTN_QUERY_BLOCK. One host read of the positions per step."""
        if self._qk_blocks is None:
            tm = self.t_max
            if tm <= ATTN_QUERY_BLOCK:
                self._qk_blocks = [(0, tm, self.s_max)]
            else:
                last = self.pad_queries(self.qpos).amax(dim=0).tolist()  # [t_max]: the furthest position per column
                spans = [(j0, min(j0 + ATTN_QUERY_BLOCK, tm)) for j0 in range(0, tm, ATTN_QUERY_BLOCK)]
                self._qk_blocks = [(j0, j1, int(last[j1 - 1]) + 1) for j0, j1 in spans]
        return self._qk_blocks

    def padded_slots(self) -> torch.Tensor:
        """int64 [B * S_max] slots of the padded table, padding read as slot 0 (masked by every user)."""
        if "padded" not in self._memo:
            self._memo["padded"] = self.table.clamp(min=0).reshape(-1)
        return self._memo["padded"]

    def causal_mask(self) -> torch.Tensor:
        """bool [T, S_max]: True where key position s lies beyond token t's position (masked)."""
        if "causal" not in self._memo:
            cols = torch.arange(self.s_max, device=self.qpos.device)
            self._memo["causal"] = cols[None, :] > self.qpos[:, None]
        return self._memo["causal"]

    def selection(
        self, topk: TopK, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(positions [T, k] (-1 read as 0), valid [T, k], additive mask [T, 1, k] of dtype (0 or -inf), slots
        [T, k]) of a top-k, k = k_sel; built once per top-k tensor (a producer's, reused by its shared layers)."""
        for t, sel in self._selections:
            if t is topk and sel[2].dtype == dtype:
                return sel
        pos = topk[:, : self.k_sel]
        n, k = int(pos.shape[0]), int(pos.shape[1])
        if self.full_topk:  # every token has k causal picks: no -1 to mask
            valid = torch.ones((n, k), dtype=torch.bool, device=pos.device)
            bias = torch.zeros((n, 1, k), dtype=dtype, device=pos.device)
        else:
            invalid = pos < 0
            pos = pos.clamp(min=0)
            bias = torch.zeros((n, 1, k), dtype=dtype, device=pos.device).masked_fill_(invalid[:, None], float("-inf"))
            valid = ~invalid
        if self.decode_only:
            slots = self.table.gather(1, pos)
        else:
            slots = self.table[self.tok_seq[:, None], pos]
        out = (pos, valid, bias, slots)
        self._selections.append((topk, out))  # holds topk, so `is` cannot match a recycled tensor
        return out

    def padded_queries(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """None when the flat tokens already form a [B, t_max] block (one sequence, or every sequence extends by
        t_max); else (index [B * t_max] of each padded query's flat token, padding repeating its sequence's last
        token; index [T] of each flat token's padded row). Built once per step."""
        b, tm = int(self.table.shape[0]), self.t_max
        if b * tm == self.num_tokens:
            return None
        if "qpad" not in self._memo:
            dev = self.tok_seq.device
            ext = torch.bincount(self.tok_seq, minlength=b)
            first = torch.cumsum(ext, 0) - ext
            j = torch.minimum(torch.arange(tm, device=dev)[None, :], (ext - 1)[:, None])
            self._memo["qpad"] = (first[:, None] + j).reshape(-1)
            t = torch.arange(self.num_tokens, device=dev)
            self._memo["qunpad"] = self.tok_seq * tm + t - first[self.tok_seq]
        return self._memo["qpad"], self._memo["qunpad"]

    def pad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[T, ...] -> [B, t_max, ...] (padding rows repeat their sequence's last token)."""
        pq = self.padded_queries()
        b = int(self.table.shape[0])
        return (x if pq is None else x.index_select(0, pq[0])).view(b, self.t_max, *x.shape[1:])

    def unpad_queries(self, x: torch.Tensor) -> torch.Tensor:
        """[B, t_max, ...] -> [T, ...], the inverse of pad_queries."""
        flat = x.reshape(-1, *x.shape[2:])
        pq = self.padded_queries()
        return flat if pq is None else flat.index_select(0, pq[1])

    def topk_mask(self, topk: TopK, dtype: torch.dtype) -> torch.Tensor:
        """Additive mask [B, 1, t_max, S_max] of dtype: 0 at each token's top-k picks, -inf elsewhere (padded
        queries: their sequence's last token's row); built once per top-k tensor (shared layers reuse it)."""
        key = f"mask{id(topk)}{dtype}"
        hit = self._memo.get(key)
        if hit is not None and self._memo.get(key + "src") is topk:
            return hit
        s = self.s_max
        pos = topk[:, : self.k_sel]
        hits = torch.zeros((pos.shape[0], s + 1), dtype=torch.bool, device=pos.device)
        hits.scatter_(1, torch.where(pos < 0, s, pos), True)  # -1 padding lands in the dropped column s
        mask = torch.zeros((pos.shape[0], s), dtype=dtype, device=pos.device).masked_fill_(~hits[:, :s], float("-inf"))
        out = self.pad_queries(mask).unsqueeze(1)
        self._memo[key], self._memo[key + "src"] = out, topk  # holds topk, so the id cannot be recycled
        return out

    def row_slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots of every cached row of the step, concatenated by sequence [R]; first row of each sequence [B])."""
        if "rows" not in self._memo:
            valid = self.table >= 0
            self._memo["rows"] = self.table[valid]
            self._memo["row0"] = torch.cumsum(self.seq_lens, 0) - self.seq_lens
        return self._memo["rows"], self._memo["row0"]

    def rope(self, width: int, interleaved: bool, dtype: torch.dtype) -> torch.Tensor:
        """The step's rope as [T, width, width] rotation matrices (see rope.rotation_matrix), built once."""
        key = (width, interleaved, dtype)
        rot = self._ropes.get(key)
        if rot is None:
            rot = self._ropes[key] = rotation_matrix(self.cos, self.sin, width, interleaved).to(dtype)
        return rot

    def query_blocks(self, per_token: int) -> list[tuple[int, int]]:
        """Flat token ranges whose per_token elements each stay under SCORE_BLOCK_ELEMS (decode: one block)."""
        t = self.num_tokens
        step = max(1, SCORE_BLOCK_ELEMS // max(1, per_token))
        return [(i, min(i + step, t)) for i in range(0, t, step)]
