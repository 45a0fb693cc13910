"""ForwardBatch: what one model step computes, in token slots of the paged pool.

A token slot is page_id * page_size + offset. Sequence b of the batch has
`prefix_lens[b]` tokens already in the pool and `extend_lens[b]` new tokens
(a prefill chunk, or 1 for decode); its cache after the step is
seq_lens[b] = prefix_lens[b] + extend_lens[b] tokens at slots
slot_table[b, :seq_lens[b]].

The model writes the KV (and, on producer layers, the index-K) of the new tokens
to `out_slots`, then attends over all seq_lens[b] slots of the sequence, and
returns logits for the last new token of every sequence.
Imports torch only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # int64 [T], the new tokens of all sequences, concatenated in batch order
    positions: torch.Tensor  # int64 [T], absolute position of each new token
    prefix_lens: torch.Tensor  # int64 [B]
    extend_lens: torch.Tensor  # int64 [B]
    slot_table: torch.Tensor  # int64 [B, max(seq_lens)], token slots of each sequence (padding: -1)
    out_slots: torch.Tensor  # int64 [T], the slot each new token's KV is written to

    @property
    def batch_size(self) -> int:
        return int(self.extend_lens.numel())

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.numel())
