"""Test support for the model tests: a minimal greedy driver over DSAModel + DevicePool.

Not the engine: it gives each sequence fixed pages up front and builds ForwardBatch by hand,
mixing prefill chunks and decode tokens in one batch when prompt lengths differ.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import DSAModel
from dsakv.spec.layout import KVLayout
from dsakv.util import ceil_div


@dataclass
class SeqRun:
    prompt: list[int]
    slots: torch.Tensor  # int64 [len(prompt) + steps]
    done_prefill: int = 0
    generated: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def cached(self) -> int:
        return self.done_prefill + max(0, len(self.generated) - 1)


def prompts_for(lengths: list[int], seed: int = 1, vocab: int = 512) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=g).tolist() for n in lengths]


def greedy(
    model: DSAModel,
    layout: KVLayout,
    prompts: list[list[int]],
    steps: int,
    *,
    chunk: int | None = None,
    num_pages: int | None = None,
    seed: int = 0,
) -> tuple[list[SeqRun], DevicePool]:
    """Greedy-decode `steps` tokens for each prompt; prefill in chunks of `chunk` tokens (None: whole)."""
    runs, pools = greedy_pp(model, [layout], prompts, steps, chunk=chunk, num_pages=num_pages, seed=seed)
    return runs, pools[0]


def greedy_pp(
    model: DSAModel,
    layouts: list[KVLayout],
    prompts: list[list[int]],
    steps: int,
    *,
    chunk: int | None = None,
    num_pages: int | None = None,
    seed: int = 0,
) -> tuple[list[SeqRun], list[DevicePool]]:
    """greedy() over pipeline stages: one pool per layout, stage_forward chained (one layout: forward)."""
    p = layouts[0].page_size
    need = [ceil_div(len(pr) + steps, p) for pr in prompts]
    num_pages = num_pages or sum(need) + 3
    pools = [DevicePool(lay, num_pages) for lay in layouts]
    perm = torch.randperm(num_pages, generator=torch.Generator().manual_seed(seed))
    runs, used = [], 0
    for pr, n in zip(prompts, need, strict=True):
        pages = perm[used : used + n]
        used += n
        runs.append(SeqRun(pr, (pages[:, None] * p + torch.arange(p)).flatten()[: len(pr) + steps]))
    while any(len(r.generated) < steps for r in runs):
        ids, pos, pre, ext, rows, outs, active = [], [], [], [], [], [], []
        for r in runs:
            if len(r.generated) >= steps:
                continue
            if r.done_prefill < len(r.prompt):
                start = r.done_prefill
                n = len(r.prompt) - start if chunk is None else min(chunk, len(r.prompt) - start)
                new = r.prompt[start : start + n]
            else:
                start = r.cached
                new = [r.generated[-1]]
            ids += new
            pos += list(range(start, start + len(new)))
            pre.append(start)
            ext.append(len(new))
            rows.append(r.slots[: start + len(new)])
            outs.append(r.slots[start : start + len(new)])
            active.append(r)
        width = max(int(x.numel()) for x in rows)
        table = torch.full((len(rows), width), -1, dtype=torch.int64)
        for i, x in enumerate(rows):
            table[i, : x.numel()] = x
        batch = ForwardBatch(
            input_ids=torch.tensor(ids),
            positions=torch.tensor(pos),
            prefix_lens=torch.tensor(pre),
            extend_lens=torch.tensor(ext),
            slot_table=table,
            out_slots=torch.cat(outs),
        )
        if len(pools) == 1:
            logits = model(batch, pools[0])
        else:
            carry = None
            for pool in pools:
                carry = model.stage_forward(batch, pool, carry)
            assert carry is not None and carry.logits is not None
            logits = carry.logits
        for i, r in enumerate(active):
            if r.done_prefill < len(r.prompt):
                r.done_prefill += ext[i]
                if r.done_prefill < len(r.prompt):
                    continue
            r.logits.append(logits[i])
            r.generated.append(int(logits[i].argmax()))
    return runs, pools
