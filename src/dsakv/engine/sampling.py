"""Token sampling (greedy, temperature / top-k / top-p) and stop conditions.

Output token i of a sampled request is drawn with a torch.Generator seeded from
(request seed, i) alone, so a seed gives the same tokens whatever else shares the
batch, after a preemption (recomputing draws nothing), and when the request moves
from a prefill worker (token 0) to a decode worker (tokens 1..). Greedy rows take
the argmax, as transformers' generate(do_sample=False) does (first index on ties).
Imports torch and dsakv.engine.request; must not import model, disagg, serve or cli.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dsakv.engine.request import FinishReason, Request, SamplingParams

MASK64 = (1 << 64) - 1


def token_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for output token `index` of a request seeded with `seed` (splitmix64)."""
    z = (seed + (index + 1) * 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return (z ^ (z >> 31)) >> 1


def _generator(req: Request, device: torch.device) -> torch.Generator:
    if req.generator is None or req.generator.device != device:
        req.generator = torch.Generator(device=device)
    req.generator.manual_seed(token_seed(req.sampling_seed, req.num_output_tokens))
    return req.generator


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row of logits -> temperature-scaled logits with top-k / top-p rejects set to -inf."""
    x = logits.float() / params.temperature
    if params.top_k is not None and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        drop_sorted = before >= params.top_p  # the top token always stays (before == 0)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample(logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
    """logits [B, vocab] (row b belongs to reqs[b]) -> one token id per request."""
    if logits.dim() != 2 or logits.shape[0] != len(reqs):
        raise ValueError(f"sample: logits of shape {tuple(logits.shape)} for {len(reqs)} requests")
    out = logits.argmax(dim=-1).tolist()
    for b, req in enumerate(reqs):
        if req.params.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[b], req.params), dim=-1)
        out[b] = int(torch.multinomial(probs, 1, generator=_generator(req, logits.device)).item())
    return [int(t) for t in out]


def stop_reason(req: Request, token: int, max_seq_len: int | None = None) -> FinishReason | None:
    """Why `req` stops after appending `token` to its output (the token is kept), or None to go on."""
    p = req.params
    if not p.ignore_eos and token in req.eos_token_ids:
        return FinishReason.STOP
    if token in p.stop_token_ids:
        return FinishReason.STOP
    if req.num_output_tokens >= p.max_new_tokens:
        return FinishReason.LENGTH
    if max_seq_len is not None and req.num_tokens >= max_seq_len:
        return FinishReason.LENGTH
    return None
