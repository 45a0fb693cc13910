"""ModelRunner: scheduled chunks -> ForwardBatch -> model step -> logits.

Slots: token t of a sequence lives at slot page_ids[t // P] * P + t % P (P = page size).
A chunk of request r covering tokens [start, end) gives one ForwardBatch row:

    prefix_lens[b] = start          extend_lens[b] = end - start
    slot_table[b, :end] = slots of tokens 0..end-1   (padding -1)
    input_ids / positions / out_slots: tokens start..end-1, concatenated over rows

Imports numpy, torch, dsakv.cache, dsakv.model.batch and dsakv.engine.scheduler;
must not import disagg, serve or cli.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hisparse import HiSparsePool
from dsakv.engine.scheduler import ScheduledChunk
from dsakv.errors import CapacityError
from dsakv.model.batch import ForwardBatch
from dsakv.util import ceil_div


class StepModel(Protocol):
    def forward(self, batch: ForwardBatch, pool: Any) -> torch.Tensor: ...


def build_batch(chunks: Sequence[ScheduledChunk], page_size: int) -> ForwardBatch:
    """The ForwardBatch for `chunks` (one row each, in order)."""
    if not chunks:
        raise ValueError("build_batch: no chunks scheduled")
    starts_l = [c.start for c in chunks]
    ends_l = [c.start + c.num_tokens for c in chunks]
    ends = np.array(ends_l, dtype=np.int64)
    starts = np.array(starts_l, dtype=np.int64)
    max_len = max(ends_l)
    max_pages = ceil_div(max_len, page_size)
    page_table = np.full((len(chunks), max_pages), -1, dtype=np.int64)
    ids: list[int] = []
    for b, (c, end) in enumerate(zip(chunks, ends_l, strict=True)):
        pages = c.request.page_ids[: ceil_div(end, page_size)]
        page_table[b, : len(pages)] = pages
        ids.extend(c.request.token_ids(c.start, end))
    t = np.arange(max_len, dtype=np.int64)
    slot_table = page_table[:, t // page_size] * page_size + t % page_size
    slot_table[t[None, :] >= ends[:, None]] = -1
    if len(ids) == len(chunks):  # decode: one token per row, at its start
        positions = starts.copy()  # not shared with prefix_lens
        out_slots = slot_table[np.arange(len(chunks)), positions]
    else:
        rows = np.repeat(np.arange(len(chunks)), ends - starts)
        positions = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in zip(starts_l, ends_l, strict=True)])
        out_slots = slot_table[rows, positions]
    if np.any(out_slots < 0):
        raise ValueError("build_batch: a new token has no page (the scheduler did not allocate it)")
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.from_numpy(positions),
        prefix_lens=torch.from_numpy(starts),
        extend_lens=torch.from_numpy(ends - starts),
        slot_table=torch.from_numpy(slot_table),
        out_slots=torch.from_numpy(out_slots),
    )


class ModelRunner:
    """Runs one model step for the scheduler's chunks on a DevicePool."""

    def __init__(self, model: StepModel, pool: DevicePool) -> None:
        self.model = model
        self.pool = pool

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        """Logits float32 [len(chunks), vocab] for the last new token of every chunk."""
        batch = build_batch(chunks, self.page_size)
        with torch.inference_mode():
            logits = self.model.forward(batch, self.pool)
        if logits.dim() != 2 or logits.shape[0] != len(chunks):
            raise ValueError(f"the model returned logits of shape {tuple(logits.shape)} for {len(chunks)} sequences")
        return logits

    def run_with_prompt_logits(
        self, chunks: Sequence[ScheduledChunk], positions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """run(), plus float32 logits [len(positions[b]), vocab] at the given token positions of each chunk (each
        in chunk.start..chunk.end - 1): the prefill pass's logits for prompt logprobs, from the same forward."""
        stage_forward = getattr(self.model, "stage_forward", None)
        if stage_forward is None:
            raise ValueError(f"{type(self.model).__name__} cannot return logits at every position (prompt logprobs)")
        batch = build_batch(chunks, self.page_size)
        with torch.inference_mode():
            out = stage_forward(batch, self.pool)
            logits = out.logits
            extra = logits_at(self.model, out.hidden, [(c.start, c.end) for c in chunks], positions)
        if logits.dim() != 2 or logits.shape[0] != len(chunks):
            raise ValueError(f"the model returned logits of shape {tuple(logits.shape)} for {len(chunks)} sequences")
        return logits, extra


def logits_at(
    model: object, hidden: torch.Tensor, spans: Sequence[tuple[int, int]], positions: Sequence[Sequence[int]]
) -> list[torch.Tensor]:
    """float32 logits [len(positions[b]), vocab] of the last stage's hidden states `hidden` (the step's tokens,
    row after row; row b holds tokens spans[b] = [start, end)) at the token positions of each row: the prefill
    pass's logits for prompt logprobs (colocated, and the last stage of a PP prefill)."""
    norm = getattr(getattr(model, "model", None), "norm", None)
    head = getattr(model, "lm_head", None)
    if norm is None or head is None:
        raise ValueError(f"{type(model).__name__} cannot return logits at every position (prompt logprobs)")
    offsets = np.cumsum([0] + [end - start for start, end in spans])
    vocab = int(head.weight.shape[0])
    extra = []
    with torch.inference_mode():
        for b, ((start, end), pos) in enumerate(zip(spans, positions, strict=True)):
            if any(not start <= t < end for t in pos):
                raise ValueError(f"positions {list(pos)} are not all in chunk {start}..{end - 1}")
            if not pos:
                extra.append(torch.zeros((0, vocab), dtype=torch.float32))
                continue
            idx = torch.tensor([int(offsets[b]) + t - start for t in pos], dtype=torch.int64, device=hidden.device)
            extra.append(head(norm(hidden[idx])).float())
    return extra


class HiSparseRunner(ModelRunner):
    """ModelRunner on a HiSparsePool: before each step the pool admits / grows the step's requests and releases
    those no longer `running` (finished, aborted, preempted); slots are the pool's logical slots.

    The engine calls prepare_rows(chunks) first: a row the pool cannot take (no free hot buffer) is returned with
    its error and that request fails alone; run() then takes the other rows, already prepared."""

    def __init__(self, model: StepModel, pool: HiSparsePool, running: Callable[[], Iterable[str]]) -> None:
        self.model = model
        self.pool = pool  # type: ignore[assignment]
        self.hisparse = pool
        self.running = running
        self._prepared: list[str] | None = None  # the request ids of the rows prepare_rows kept, until run()

    def prepare_rows(self, chunks: Sequence[ScheduledChunk]) -> dict[int, str]:
        """Admit / grow the step's rows in the pool; the rows that cannot be (by index) with their error."""
        entries = [(c.request.request_id, c.request.page_ids, c.start, c.end) for c in chunks]
        failed = self.hisparse.prepare(entries, self.running()) or {}
        self._prepared = [c.request.request_id for i, c in enumerate(chunks) if i not in failed]
        return {i: f"HiSparse admission failed: {type(e).__name__}: {e}" for i, e in failed.items()}

    def _prepare(self, chunks: Sequence[ScheduledChunk]) -> None:
        prepared, self._prepared = self._prepared, None
        if prepared is not None and prepared == [c.request.request_id for c in chunks]:
            return
        failed = self.prepare_rows(chunks)
        self._prepared = None
        if failed:
            raise CapacityError(next(iter(failed.values())))

    def run(self, chunks: Sequence[ScheduledChunk]) -> torch.Tensor:
        self._prepare(chunks)
        return super().run(chunks)

    def run_with_prompt_logits(
        self, chunks: Sequence[ScheduledChunk], positions: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        self._prepare(chunks)
        return super().run_with_prompt_logits(chunks, positions)
