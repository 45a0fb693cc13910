"""A DeepSeek-V4 request of the V4Engine, and how its next token is drawn (greedy, or seeded sampling).

Imports torch, numpy and dsakv.engine.{request, sampling}; must not import model, disagg, serve or cli.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from dsakv.engine.request import SamplingParams
from dsakv.engine.sampling import filter_logits, token_seed


@dataclass
class V4Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)
    num_computed: int = 0
    slot: int = -1
    page_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    eos: tuple[int, ...] = ()
    cached_tokens: int = 0  # prompt tokens a prefix hit (device, host or L3) supplied
    park: bool = False  # a PD prefill's request: once done it keeps its pages and slot (parked) until sent
    sampling: SamplingParams | None = None  # None or temperature 0: greedy
    seed: int = 0  # output token i is drawn with token_seed(seed, i), as the DSA engine draws it

    @property
    def done(self) -> bool:
        return len(self.output) >= self.max_new_tokens or bool(self.output and self.output[-1] in self.eos)

    @property
    def finish_reason(self) -> str:
        return "stop" if self.output and self.output[-1] in self.eos else "length"


def draw(logits: torch.Tensor, req: V4Request) -> int:
    """The request's next token from its logits row: the argmax (greedy), else a draw from the temperature /
    top-k / top-p distribution with a generator seeded by (seed, output index) alone, so the same seed gives the
    same tokens whatever shares the batch, and a PD decode continues a prefill's draw (token 0 there, 1.. here)."""
    p = req.sampling
    if p is None or p.greedy:
        return int(logits.argmax())
    probs = torch.softmax(filter_logits(logits, p), dim=-1)
    gen = torch.Generator(device=logits.device)
    gen.manual_seed(token_seed(req.seed, len(req.output)))
    return int(torch.multinomial(probs, 1, generator=gen).item())
