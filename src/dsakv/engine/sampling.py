"""Token sampling (penalties, bias, greedy, temperature / top-k / top-p), logprobs, and stop conditions.

    tokens, logprobs = sample_with_logprobs(logits, reqs)   # logits [B, vocab]; logprobs[b] None unless asked

process_logits() turns a batch's raw logits into the logits each row draws from, vectorised over the batch:
logit_bias (one scatter), presence/frequency penalties from the output-token counts (one scatter_add over the
padded output ids), repetition_penalty on every token seen (prompt + output), min_tokens masking eos and
stop_token_ids, then temperature. Logprobs are log_softmax of these processed logits (before top-k/top-p), so
they are the distribution the token is drawn from before truncation; with no penalty and temperature 0 or 1
they are log_softmax of the model's logits.

Output token i of a sampled request is drawn with a torch.Generator seeded from
(request seed, i) alone, so a seed gives the same tokens whatever else shares the
batch, after a preemption (recomputing draws nothing), and when the request moves
from a prefill worker (token 0) to a decode worker (tokens 1..). Greedy rows take
the argmax, as transformers' generate(do_sample=False) does (first index on ties).

No accepted value makes a distribution non-finite (sample_batch):
- +inf logits (raw, or a repetition_penalty near 0 dividing them) are clamped to the float32 maximum;
  a temperature below float32's smallest normal is taken as that (same argmax; the distribution is a point
  mass either way), and a row that would overflow is divided after subtracting its maximum (same softmax);
- top_p always keeps the most likely token (top_p 1e-300 is a point mass, not an empty set);
- a row where every token is masked (stop_token_ids + eos covering the vocabulary under min_tokens; the edge
  refuses that with validate_sampling) falls back to greedy on the raw logits;
- a row of NaN logits, or any exception in one row, fails that row alone (`errors[b]`), never the batch.
Logprobs are finite: a token of probability 0 reports LOGPROB_FLOOR (JSON has no -inf).
Imports torch and dsakv.engine.request; must not import model, disagg, serve or cli.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from dsakv.engine.request import FinishReason, Request, SamplingParams, TokenLogprobs
from dsakv.errors import ConfigError, DsakvError

MASK64 = (1 << 64) - 1
LOGPROB_FLOOR = -9999.0  # the logprob reported for a token of probability 0 (as vLLM's API does)
_F32 = torch.finfo(torch.float32)


class SamplingError(DsakvError):
    """One request's row could not be sampled (its own error; sample_batch reports it per row)."""


class SampleBatch(NamedTuple):
    """sample_batch's answer, per row: the token (0 where the row failed), its logprobs (None unless asked or
    where it failed) and the row's error (None if it was sampled)."""

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None]


def validate_sampling(params: SamplingParams, vocab_size: int, eos_token_ids: Sequence[int] = ()) -> None:
    """Refuse (ConfigError) sampling values that fit SamplingParams but leave this model nothing to draw: under
    min_tokens, stop_token_ids (+ eos unless ignore_eos) banning every token of the vocabulary. The one rule for
    every entry (the engine calls it on add_request / prealloc; an HTTP edge may call it first)."""
    if not params.min_tokens:
        return
    banned = {t for t in params.stop_token_ids if 0 <= t < vocab_size}
    eos = [] if params.ignore_eos else [t for t in eos_token_ids if 0 <= t < vocab_size]
    banned.update(eos)
    if len(banned) >= vocab_size:
        raise ConfigError(
            f"stop_token_ids ({len(params.stop_token_ids)} ids{' + eos' if eos else ''}) cover all {vocab_size} "
            f"tokens of the vocabulary while min_tokens = {params.min_tokens}: no token could be generated before "
            "min_tokens; drop some stop_token_ids or set min_tokens to 0"
        )


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


def _tempered(x: torch.Tensor, temps: torch.Tensor) -> torch.Tensor:
    """x [B, V] (no NaN, no +inf) / temps [B, 1] (> 0, clamped to float32's smallest normal); a row that would
    overflow is divided after subtracting its maximum (the same softmax, and it cannot overflow: every value
    is <= 0)."""
    temps = temps.clamp(min=_F32.tiny)
    y = x / temps
    over = (torch.isinf(y) & torch.isfinite(x)).any(dim=-1)
    if bool(over.any()):
        top = x.amax(dim=-1, keepdim=True)
        shifted = torch.where(x == top, 0.0, (x - top) / temps)  # x == top: 0 even where top is -inf
        y = torch.where(over[:, None], shifted, y)
    return y


def filter_logits(logits: torch.Tensor, params: SamplingParams, *, scaled: bool = False) -> torch.Tensor:
    """One row of logits -> temperature-scaled logits (already scaled if `scaled`) with top-k / top-p rejects
    set to -inf (the most likely token always stays). Finite for any accepted temperature; NaN logits raise
    SamplingError (`scaled` logits are process_logits' rows: checked there, once per batch)."""
    x = logits.float()
    if not scaled and bool(torch.isnan(x).any()):
        raise SamplingError(f"the model's logits hold NaN at {int(torch.isnan(x).sum())} of {x.numel()} tokens")
    x = x.clamp(max=_F32.max)
    if not scaled and params.temperature != 1.0:
        temp = torch.tensor([[max(params.temperature, _F32.tiny)]], dtype=torch.float32, device=x.device)
        x = _tempered(x[None], temp)[0]
    if params.top_k is not None and params.top_k < x.numel():
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        before = torch.cumsum(probs, dim=-1) - probs  # mass of the tokens ranked above each one
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False  # the top token always stays (top_p below float32's smallest value included)
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def process_logits(
    logits: torch.Tensor, reqs: Sequence[Request], pending: Sequence[Sequence[int]] | None = None
) -> torch.Tensor:
    """Raw logits [B, vocab] -> float32 processed logits (module docstring); rows of requests without penalties
    or bias are logits / temperature (greedy rows: unchanged). Never NaN nor +inf (see _process).
    `pending[b]`: tokens taken as already appended to reqs[b]'s output (a speculative position's state: the
    penalties count them, min_tokens counts them); a request may appear in several rows."""
    return _process(logits, reqs, pending)[0]


def _process(
    logits: torch.Tensor, reqs: Sequence[Request], pending: Sequence[Sequence[int]] | None = None
) -> tuple[torch.Tensor, list[bool], list[str | None]]:
    """process_logits, and per row whether it fell back to greedy on its raw logits (every token masked) and
    its error (NaN logits, or no finite logit at all; the row's values are then 0)."""
    if pending is not None and len(pending) != len(reqs):
        raise ValueError(f"process_logits: {len(pending)} pending token lists for {len(reqs)} rows")
    x = logits.float()
    nan = torch.isnan(x)
    errors: list[str | None] = [None] * len(reqs)
    if bool(nan.any()):
        counts = nan.sum(dim=-1).tolist()
        for b, n in enumerate(counts):
            if n:
                errors[b] = f"the model's logits for this request hold NaN at {n} of {x.shape[-1]} tokens"
        x = torch.where(nan.any(dim=-1, keepdim=True), 0.0, x)
    raw = x = x.clamp(max=_F32.max)
    rows = [b for b, r in enumerate(reqs) if r.params.penalised]
    if rows:
        x = x.clone()
        _penalise(x, rows, reqs, pending)
    temps = [r.params.temperature if not r.params.greedy else 1.0 for r in reqs]
    if any(t != 1.0 for t in temps):
        x = _tempered(x, torch.tensor(temps, dtype=torch.float32, device=x.device)[:, None])
    fallback = [False] * len(reqs)
    empty = ~torch.isfinite(x).any(dim=-1)
    if bool(empty.any()):
        x = x.clone() if x is raw else x
        raw_empty = (~torch.isfinite(raw).any(dim=-1)).tolist()
        for b in empty.nonzero()[:, 0].tolist():
            if errors[b] is not None:
                continue
            if raw_empty[b]:
                errors[b] = "the model's logits for this request are -inf at every token: nothing to sample"
                x[b] = 0.0
            else:  # every token masked (min_tokens bans): greedy on the raw logits
                fallback[b] = True
                x[b] = raw[b]
    return x, fallback, errors


def process_rows(
    logits: torch.Tensor, reqs: Sequence[Request], pending: Sequence[Sequence[int]] | None = None
) -> tuple[torch.Tensor, list[bool], list[str | None]]:
    """process_logits with, per row, whether it falls back to greedy on its raw logits (every token masked) and
    its error: what sample_batch draws from, for a caller that draws itself (speculative verification)."""
    return _process(logits, reqs, pending)


def _penalise(
    x: torch.Tensor, rows: list[int], reqs: Sequence[Request], pending: Sequence[Sequence[int]] | None = None
) -> None:
    dev, vocab = x.device, x.shape[1]
    sub = x[rows]
    ps = [reqs[b].params for b in rows]
    extra = [list(pending[b]) if pending is not None else [] for b in rows]

    def col(vals: list[float]) -> torch.Tensor:
        return torch.tensor(vals, dtype=torch.float32, device=dev)[:, None]

    bias = [(i, t, v) for i, p in enumerate(ps) for t, v in p.logit_bias if t < vocab]
    if bias:
        i_, t_, v_ = zip(*bias, strict=True)
        sub.index_put_((torch.tensor(i_, device=dev), torch.tensor(t_, device=dev)), torch.tensor(v_, device=dev), True)
    outs = [reqs[b].output_ids + e for b, e in zip(rows, extra, strict=True)]
    if any(p.presence_penalty or p.frequency_penalty for p in ps) and any(outs):
        counts = _counts(outs, vocab, dev)
        sub -= col([p.frequency_penalty for p in ps]) * counts
        sub -= col([p.presence_penalty for p in ps]) * (counts > 0).float()
    if any(p.repetition_penalty != 1.0 for p in ps):
        seen = _counts([list(reqs[b].prompt_ids) + o for b, o in zip(rows, outs, strict=True)], vocab, dev) > 0
        rp = col([p.repetition_penalty for p in ps]).clamp(min=_F32.tiny).expand_as(sub)  # 1e-300 is 0 in fp32
        sub.copy_(torch.where(seen, torch.where(sub > 0, sub / rp, sub * rp), sub).clamp(max=_F32.max))
    for i, b in enumerate(rows):
        r = reqs[b]
        if r.num_output_tokens + len(extra[i]) < r.params.min_tokens:
            ban = [
                t for t in (*r.params.stop_token_ids, *([] if r.params.ignore_eos else r.eos_token_ids)) if t < vocab
            ]
            if ban:
                sub[i, ban] = float("-inf")
    x[rows] = sub


def _counts(seqs: list[list[int]], vocab: int, dev: torch.device) -> torch.Tensor:
    """[len(seqs), vocab] float32 counts of each token id in each sequence (one scatter_add over padded ids)."""
    width = max(max((len(s) for s in seqs), default=0), 1)
    ids = torch.full((len(seqs), width), vocab, dtype=torch.int64)
    for i, s in enumerate(seqs):
        if s:
            ids[i, : len(s)] = torch.tensor(s, dtype=torch.int64)
    counts = torch.zeros(len(seqs), vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab].to(dev)


def top_logprobs(logprobs: torch.Tensor, ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Rows of log-probabilities [R, vocab], the token of each row and how many alternatives -> TokenLogprobs
    (NaN or -inf reported as LOGPROB_FLOOR: every value is a finite float)."""
    logprobs = torch.nan_to_num(logprobs.float(), nan=LOGPROB_FLOOR, neginf=LOGPROB_FLOOR, posinf=0.0)
    kmax = max(ks, default=0)
    chosen = logprobs.gather(1, torch.tensor(list(ids), dtype=torch.int64, device=logprobs.device)[:, None])
    chosen_l = chosen[:, 0].tolist()
    if kmax:
        vals, idx = torch.topk(logprobs, kmax, dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
    out = []
    for r, (t, k) in enumerate(zip(ids, ks, strict=True)):
        top = tuple(zip(idx_l[r][:k], vals_l[r][:k], strict=True)) if k else ()
        out.append(TokenLogprobs(int(t), float(chosen_l[r]), top))
    return out


def prompt_logprob_positions(params: SamplingParams, start: int, end: int, have: int, prompt_len: int) -> list[int]:
    """The positions of a chunk's tokens [start, end) whose logits give a prompt token's logprob (position t: prompt
    token t + 1), from the first not computed yet (`have` are); none unless params.prompt_logprobs. The one rule
    of the Engine (engine_step) and of a prefill pipeline's last stage."""
    if params.prompt_logprobs is None:
        return []
    return list(range(max(start, have), min(end, prompt_len - 1)))


def first_token_request(
    rid: str, prompt_ids: Sequence[int] | None, params: SamplingParams, seed: int, eos_token_ids: Sequence[int]
) -> Request:
    """The Request a pipeline's last stage draws token 0 of a prompt for (sample_batch), as the Engine on stage 0
    would: the request's seeded stream (token_seed(seed, 0)), its penalties over `prompt_ids` (None when stage 0
    sent none: nothing reads them), bias and min_tokens masking eos."""
    return Request(
        request_id=rid,
        prompt_ids=tuple(prompt_ids) if prompt_ids else (0,),
        params=params,
        sampling_seed=seed,
        eos_token_ids=tuple(eos_token_ids),
    )


def prompt_token_logprobs(
    logits: torch.Tensor, prompt_ids: Sequence[int], positions: Sequence[int], k: int
) -> list[TokenLogprobs]:
    """Prompt logprobs from the prefill pass: the logits [len(positions), vocab] at prompt positions t give prompt
    token t + 1's log_softmax (raw logits: no penalty, no temperature) and its k best alternatives. NaN logits
    raise SamplingError (the request's own error); +inf is clamped to the float32 maximum."""
    ids = [prompt_ids[t + 1] for t in positions]
    x = logits.float()
    if bool(torch.isnan(x).any()):
        raise SamplingError(f"the model's prompt logits hold NaN at {int(torch.isnan(x).sum())} values")
    return top_logprobs(torch.log_softmax(x.clamp(max=_F32.max), dim=-1), ids, [k] * len(ids))


def sample_batch(logits: torch.Tensor, reqs: Sequence[Request]) -> SampleBatch:
    """logits [B, vocab] (row b belongs to reqs[b]) -> per row a token, its TokenLogprobs (when the params ask)
    and an error: a row that cannot be sampled fails alone (its token 0, its error set), the others are exactly
    what they are without it (rows are independent; a failure of the batched pass is retried row by row)."""
    if logits.dim() != 2 or logits.shape[0] != len(reqs):
        raise ValueError(f"sample: logits of shape {tuple(logits.shape)} for {len(reqs)} requests")
    try:
        return _sample_rows(logits, reqs)
    except Exception as e:
        if len(reqs) == 1:
            return SampleBatch([0], [None], [f"sampling failed: {type(e).__name__}: {e}"])
    parts = [sample_batch(logits[b : b + 1], [r]) for b, r in enumerate(reqs)]
    return SampleBatch([p.tokens[0] for p in parts], [p.logprobs[0] for p in parts], [p.errors[0] for p in parts])


def _sample_rows(logits: torch.Tensor, reqs: Sequence[Request]) -> SampleBatch:
    x, fallback, errors = _process(logits, reqs)
    out = x.argmax(dim=-1).tolist()
    for b, req in enumerate(reqs):
        if req.params.greedy or fallback[b] or errors[b] is not None:
            continue
        try:
            probs = torch.softmax(filter_logits(x[b], req.params, scaled=True), dim=-1)
            out[b] = int(torch.multinomial(probs, 1, generator=_generator(req, logits.device)).item())
        except Exception as e:  # this row alone
            errors[b] = f"sampling failed: {type(e).__name__}: {e}"
    tokens = [0 if errors[b] is not None else int(t) for b, t in enumerate(out)]
    lps: list[TokenLogprobs | None] = [None] * len(reqs)
    want = [b for b, r in enumerate(reqs) if r.params.logprobs is not None and errors[b] is None]
    if want:
        lp = torch.log_softmax(x[want], dim=-1)
        got = top_logprobs(lp, [tokens[b] for b in want], [int(reqs[b].params.logprobs or 0) for b in want])
        for b, g in zip(want, got, strict=True):
            lps[b] = g
    return SampleBatch(tokens, lps, errors)


def sample_with_logprobs(logits: torch.Tensor, reqs: Sequence[Request]) -> tuple[list[int], list[TokenLogprobs | None]]:
    """logits [B, vocab] (row b belongs to reqs[b]) -> one token id per request, and its TokenLogprobs for the
    requests whose params ask for logprobs (None for the others). Raises SamplingError naming the first row
    that failed (sample_batch reports failures per row instead)."""
    got = sample_batch(logits, reqs)
    for req, err in zip(reqs, got.errors, strict=True):
        if err is not None:
            raise SamplingError(f"request {req.request_id}: {err}")
    return got.tokens, got.logprobs


def sample(logits: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
    """logits [B, vocab] (row b belongs to reqs[b]) -> one token id per request."""
    return sample_with_logprobs(logits, reqs)[0]


def stop_reason(req: Request, token: int, max_seq_len: int | None = None) -> FinishReason | None:
    """Why `req` stops after appending `token` to its output (the token is kept), or None to go on."""
    p = req.params
    if req.num_output_tokens < p.min_tokens:  # eos / stop ids were masked; length cannot end it before either
        return None
    if not p.ignore_eos and token in req.eos_token_ids:
        return FinishReason.STOP
    if token in p.stop_token_ids:
        return FinishReason.STOP
    if req.num_output_tokens >= p.max_new_tokens:
        return FinishReason.LENGTH
    if max_seq_len is not None and req.num_tokens >= max_seq_len:
        return FinishReason.LENGTH
    return None
