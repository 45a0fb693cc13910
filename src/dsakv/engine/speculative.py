"""Speculative decoding with the checkpoint's MTP draft layer (--speculative-num-steps K), on the same pool.

One engine step with speculation (chunks from the scheduler; a decoding request with a draft gets
`num_draft` = k <= K extra tokens, their pages taken from free pages only):

    1. chain   the draft layer reused k-1 times: d2..dk from d1 (the draft's own hidden state chained)
    2. verify  one target forward over every chunk; a decode chunk carries [t_n, d1..dk] (k+1 positions)
    3. accept  each position's logits processed as a step without MTP would (bias, penalties counting the
               drafts before it, min_tokens by its output index; accept_with_logprobs), then
               greedy: the longest prefix of drafts equal to the target's argmax, then the target's token;
               sampled: rejection sampling (accept d with prob min(1, p(d)/q(d)), else draw from
               norm(max(p - q, 0)); all accepted: draw the bonus from p), so tokens follow the target's
               distribution; draws seeded by (request seed, output index, purpose): reproducible
    4. extend  the draft layer over every position whose target KV is now valid (entry i = target hidden i +
               token i+1, see model/mtp.py), writing its KV / INDEX_K in the target's slots; its last output
               gives d1 for the next step
    5. rollback (Scheduler.update_spec) num_computed_tokens advances past the accepted tokens only; pages
               beyond them are freed; slots of rejected positions in a kept page lie beyond the sequence, so
               no later step reads them (poison_rejected=True fills them with NaN to prove it)

Pool slots of one decoding request with k = 3 drafts (n = num_computed before the step):

    token pos   ... n-1 |  n    n+1  n+2  n+3
    target KV   valid   | t_n   d1   d2   d3     (written by verify; kept up to n+a, a = accepted drafts)
    draft KV    valid   | d1'   d2'  (chain)     (rewritten by extend for n..n+a)

Disaggregated (PD): the prefill stage holding the last main layer runs `draft_prefill` on every step's batch
(the draft layer's KV / INDEX_K for the prompt, in the same slots, shipped with the other keys) and sends the
draft's output at the prompt's last entry; the decode's `Speculator.seed` turns it into d1, so the decode
drafts from its first step exactly as a colocated engine does after its own prefill step.

Imports torch, dsakv.{cache,model} and dsakv.engine; must not import disagg, serve or cli.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch

from dsakv.cache.device_pool import DevicePool
from dsakv.cache.kv_access import PoolAccess
from dsakv.engine.model_runner import logits_at
from dsakv.engine.request import Request, TokenLogprobs
from dsakv.engine.sampling import SamplingError, filter_logits, process_rows, sample_batch, token_seed, top_logprobs
from dsakv.engine.scheduler import ScheduledChunk
from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import DSAModel
from dsakv.model.mtp import MTPDraft
from dsakv.spec.layout import Kind

log = logging.getLogger(__name__)

# seed salts of the draws that are not the target's own (the target's use token_seed(seed, index) as without MTP)
DRAFT_SALT = 0x5D3A_11F0_9C2B_7E41
ACCEPT_SALT = 0x2B7E_1516_28AE_D2A6
RESIDUAL_SALT = 0x6A09_E667_F3BC_C908


@dataclass
class DraftState:
    """What a request drafts from next: valid while num_computed_tokens == n and num_tokens == n + 1."""

    n: int
    tokens: list[int]  # d1.. (one after extend; the chain adds the rest during the step)
    probs: list[torch.Tensor | None]  # the draft distribution each token was drawn from (None: greedy)
    hidden: torch.Tensor  # [H] the draft's output for the entry that drafted tokens[-1]


@dataclass
class SpecStats:
    verify_steps: int = 0  # decode chunks verified with >= 1 draft token
    draft_tokens: int = 0  # drafts proposed to the target
    accepted_tokens: int = 0  # drafts the target accepted
    emitted_tokens: int = 0  # tokens those decode chunks produced (accepted + the target's own)
    poisoned_slots: int = 0  # rejected positions filled with NaN (poison_rejected)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per verify step (accepted drafts + 1), the usual 'accept length'."""
        return self.emitted_tokens / self.verify_steps if self.verify_steps else 0.0

    def to_dict(self) -> dict[str, float]:
        return {
            "spec_verify_steps": self.verify_steps,
            "spec_draft_tokens": self.draft_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_emitted_tokens": self.emitted_tokens,
            "spec_acceptance_rate": round(self.acceptance_rate, 6),
            "spec_mean_accepted_length": round(self.mean_accepted_length, 6),
        }


@dataclass
class _Row:
    """One sequence of a ForwardBatch: tokens `ids` at positions start.. in the pages of `req`."""

    req: Request
    start: int
    ids: list[int]
    hidden: torch.Tensor | None = None  # draft rows: the previous hidden state per token
    t0: int = 0  # first row of this sequence in the batch's tokens


def _batch(rows: Sequence[_Row], page_size: int, *, shift: int = 0) -> ForwardBatch:
    """ForwardBatch of rows (prefix = start, new = ids, at their request's slots); `shift` adds to positions
    (the draft layer's rope position of entry i is i + 1)."""
    ends = np.array([r.start + len(r.ids) for r in rows], dtype=np.int64)
    starts = np.array([r.start for r in rows], dtype=np.int64)
    width = int(ends.max())
    pages = np.full((len(rows), -(-width // page_size)), -1, dtype=np.int64)
    for b, r in enumerate(rows):
        own = r.req.page_ids[: -(-int(ends[b]) // page_size)]
        pages[b, : len(own)] = own
    t = np.arange(width, dtype=np.int64)
    table = pages[:, t // page_size] * page_size + t % page_size
    table[t[None, :] >= ends[:, None]] = -1
    rowix = np.repeat(np.arange(len(rows)), ends - starts)
    pos = np.concatenate([np.arange(r.start, r.start + len(r.ids), dtype=np.int64) for r in rows])
    out_slots = table[rowix, pos]
    if np.any(out_slots < 0):
        raise ValueError("speculative batch: a position has no page (the scheduler did not allocate it)")
    ids = [i for r in rows for i in r.ids]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64),
        positions=torch.from_numpy(pos + shift),
        prefix_lens=torch.from_numpy(starts),
        extend_lens=torch.from_numpy(ends - starts),
        slot_table=torch.from_numpy(table),
        out_slots=torch.from_numpy(out_slots),
    )


def _gen(seed: int, salt: int, index: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(token_seed(seed ^ salt, index))
    return g


def _draw(
    logits: torch.Tensor, req: Request, index: int, pending: Sequence[int] = ()
) -> tuple[int, torch.Tensor | None]:
    """A draft token for output index `index` (`pending`: the tokens before it that the output does not hold
    yet): the draft's logits processed as the target's are (bias, penalties, min_tokens, temperature; a closer
    proposal is accepted more often), then argmax (greedy) or a draw from the filtered distribution.
    A draft is only a proposal: where the draft's logits give no distribution (NaN), it proposes their argmax
    with a point-mass q (rejection sampling stays exact for any q), never failing the request."""
    try:
        x, fallback, errors = process_rows(logits[None], [req], [list(pending)])
        _raise(errors[0])
        if req.params.greedy:
            return int(x[0].argmax()), None
        if fallback[0]:
            raise SamplingError("every token masked")
        q = torch.softmax(filter_logits(x[0], req.params, scaled=True), dim=-1)
        tok = int(torch.multinomial(q, 1, generator=_gen(req.sampling_seed, DRAFT_SALT, index, q.device)).item())
    except (SamplingError, RuntimeError):
        tok = int(torch.nan_to_num(logits.float(), nan=float("-inf")).argmax())
        if req.params.greedy:
            return tok, None
        q = torch.zeros(logits.shape[-1], dtype=torch.float32, device=logits.device)
        q[tok] = 1.0
    return tok, q


def accept_tokens(req: Request, drafts: list[int], qs: list[torch.Tensor | None], logits: torch.Tensor) -> list[int]:
    """The tokens of accept_with_logprobs (module docstring, step 3)."""
    return accept_with_logprobs(req, drafts, qs, logits)[0]


def accept_with_logprobs(
    req: Request, drafts: list[int], qs: list[torch.Tensor | None], logits: torch.Tensor
) -> tuple[list[int], list[TokenLogprobs] | None]:
    """Tokens a decode chunk yields, and their logprobs when the params ask: logits [k+1, vocab] of the target
    at [t_n, d1..dk], drafts d1..dk.

    Position i goes through the same processing as a step without speculation would at output index base + i
    (logit_bias, penalties counting the output so far plus d1..di, min_tokens by base + i, temperature; one
    batched process_rows over the k+1 rows). Greedy: the drafts up to the first one unequal to the processed
    argmax, then that argmax. Sampled: speculative rejection sampling against the processed, top-k / top-p
    filtered target distribution (the output follows it); a position where every token is masked takes its
    argmax, as sample_batch does. The bonus token (every draft accepted) is drawn exactly as without MTP.
    Logprobs: log_softmax of the processed row of each emitted token (as sample_batch reports them)."""
    k = len(drafts)
    base = req.num_output_tokens
    params = req.params
    x, fallback, errors = process_rows(logits, [req] * (k + 1), [drafts[:i] for i in range(k + 1)])
    out: list[int] = []
    if params.greedy:
        target = x.argmax(dim=-1).tolist()
        for i in range(k):
            if drafts[i] != target[i]:
                break
            out.append(drafts[i])
        out.append(int(target[len(out)]))
    else:
        seed = req.sampling_seed
        for i in range(k + 1):
            _raise(errors[i])
            if fallback[i]:  # every token masked: sample_batch takes the argmax; a point mass here
                p = torch.zeros(x.shape[-1], dtype=torch.float32, device=x.device)
                p[int(x[i].argmax())] = 1.0
            else:
                p = torch.softmax(filter_logits(x[i], params, scaled=True), dim=-1)
            if i == k:  # every draft accepted: the bonus token from the target, drawn as without MTP
                g = _gen(seed, 0, base + k, p.device)
                out.append(int(x[i].argmax()) if fallback[i] else int(torch.multinomial(p, 1, generator=g).item()))
                break
            q = qs[i]
            assert q is not None
            d = drafts[i]
            u = torch.rand((), generator=_gen(seed, ACCEPT_SALT, base + i, p.device), device=p.device)
            if float(u) * float(q[d]) < float(p[d]):
                out.append(d)
                continue
            resid = (p - q.to(p.device)).clamp_min(0)
            total = float(resid.sum())
            resid = resid / total if total > 0 else p
            g = _gen(seed, RESIDUAL_SALT, base + i, p.device)
            out.append(int(torch.multinomial(resid, 1, generator=g).item()))
            break
    for e in errors[: len(out)]:
        _raise(e)
    if params.logprobs is None:
        return out, None
    lp = torch.log_softmax(x[: len(out)], dim=-1)
    return out, top_logprobs(lp, out, [int(params.logprobs)] * len(out))


def _raise(error: str | None) -> None:
    if error is not None:
        raise SamplingError(error)


def draft_prefill(
    target: DSAModel, draft: MTPDraft, pool: DevicePool, batch: ForwardBatch, hidden: torch.Tensor, after: Sequence[int]
) -> torch.Tensor:
    """A prefill step's draft extend (PD, the stage with the last main layer): the draft layer's KV / INDEX_K for
    every new token of `batch` (the target's batch, just run), written at the target's own slots.

    `hidden` [T, H] is the target's residual stream after its last layer (this function norms it); entry i pairs
    hidden i with token i+1: inside a sequence the batch's next token, after sequence b's last token `after[b]`
    (the next prompt token of a chunk that does not end the prompt, or the sampled first token). Returns the
    draft's output [B, H] at each sequence's last entry (the hidden state the decode drafts d1 from, and the
    "previous hidden" its chain continues with) -- what the colocated _extend keeps in DraftState.hidden.
    """
    if len(after) != batch.batch_size:
        raise ValueError(f"draft_prefill: {len(after)} next tokens for a batch of {batch.batch_size} sequences")
    ends = torch.cumsum(batch.extend_lens, 0) - 1
    ids = batch.input_ids.clone()
    ids[:-1] = batch.input_ids[1:]
    ids[ends] = torch.tensor(list(after), dtype=ids.dtype)
    shifted = replace(batch, input_ids=ids, positions=batch.positions + 1)
    with torch.inference_mode():
        normed = target.model.norm(hidden.to(target.device, target.dtype))
    out = draft.step(target, shifted, normed, pool)
    return out[ends.to(out.device)]


class Speculator:
    """Drafts with the MTP layer and verifies with the target, for the engine's step (see module docstring)."""

    def __init__(
        self,
        target: DSAModel,
        draft: MTPDraft,
        pool: DevicePool,
        num_steps: int,
        *,
        max_seq_len: int | None = None,
        poison_rejected: bool = False,
    ) -> None:
        if num_steps < 1:
            raise ValueError(f"speculative num_steps = {num_steps} must be >= 1")
        missing = [
            lid for lid in draft.layer_ids[:1] if not pool.layout.owns_index_k(lid) or lid not in pool.layout.layers
        ]
        if missing:
            raise ValueError(
                f"the pool's layout {pool.layout.describe_range()} holds no buffers for draft layer(s) {missing}: "
                "build it with draft_layers=1"
            )
        self.target = target
        self.draft = draft
        self.pool = pool
        self.num_steps = num_steps
        self.max_seq_len = max_seq_len
        self.poison_rejected = poison_rejected
        self.states: dict[str, DraftState] = {}
        self.errors: dict[int, str] = {}  # the last run()'s failed rows (chunk index -> error): they failed alone
        # the last run()'s logprobs per request id, one per produced token (the engine keeps those update_spec kept)
        self.logprobs: dict[str, list[TokenLogprobs]] = {}
        self.prompt_logits: list[torch.Tensor] = []  # the last run()'s logits at the positions it was asked for
        self.stats = SpecStats()
        self._access = PoolAccess(pool)

    # ---- scheduler hook --------------------------------------------------------------------

    def lookahead(self, req: Request) -> int:
        """Draft tokens `req` can verify this step (0: no valid draft, or no room left for one)."""
        st = self.states.get(req.request_id)
        if st is None or st.n != req.num_computed_tokens or req.num_tokens != st.n + 1:
            return 0
        k = min(self.num_steps, req.params.max_new_tokens - req.num_output_tokens - 1)
        if self.max_seq_len is not None:
            k = min(k, self.max_seq_len - req.num_tokens - 1)
        return max(k, 0)

    def forget(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def prune(self, live: Collection[str]) -> None:
        """Forget the draft state of every request not in `live` (finished or failed since)."""
        if len(self.states) > len(live):
            for rid in [rid for rid in self.states if rid not in live]:
                self.forget(rid)

    def keep_logprobs(self, req: Request, n: int) -> None:
        """Append to req's output logprobs this step's entries of its n kept tokens (a stop drops the rest)."""
        lps = self.logprobs.get(req.request_id)
        if lps:
            req.output_logprobs.extend(lps[:n])

    def seed(self, req: Request, hidden: torch.Tensor) -> None:
        """A request whose prompt was prefilled elsewhere (PD) starts decoding: `hidden` [H] is the draft's output
        at the prompt's last entry (draft_prefill); its d1 is drawn here as the colocated _extend draws it."""
        h = hidden.to(self.target.device).reshape(-1)
        logits = self.draft.logits(self.target, h[None])
        tok, q = _draw(logits[0], req, req.num_output_tokens)
        self.states[req.request_id] = DraftState(req.num_computed_tokens, [tok], [q], h.clone())

    # ---- one step ------------------------------------------------------------------------------

    def run(self, chunks: Sequence[ScheduledChunk], positions: Sequence[Sequence[int]] = ()) -> list[list[int]]:
        """Chain, verify, accept and extend for the scheduled chunks; the tokens each chunk produced. `positions`:
        per chunk, the token positions whose float32 logits the engine wants for prompt logprobs (left in
        `prompt_logits`, from the same forward: ModelRunner.run_with_prompt_logits' rule)."""
        page = self.pool.page_size
        drafts: list[list[int]] = []
        qs: list[list[torch.Tensor | None]] = []
        for c in chunks:
            st = self.states.get(c.request.request_id) if c.num_draft else None
            drafts.append(list(st.tokens[:1]) if st else [])
            qs.append(list(st.probs[:1]) if st else [])
        self._chain(chunks, drafts, qs)
        rows = [_Row(c.request, c.start, c.request.token_ids(c.start, c.end) + drafts[i]) for i, c in enumerate(chunks)]
        batch = _batch(rows, page)
        with torch.inference_mode():
            carry = self.target.stage_forward(batch, self.pool)
            hidden = self.target.model.norm(carry.hidden)
            spans = [(r.start, r.start + len(r.ids)) for r in rows]
            self.prompt_logits = logits_at(self.target, carry.hidden, spans, positions) if any(positions) else []
        produced: list[list[int]] = []
        self.errors = {}
        self.logprobs = {}
        t0 = 0
        for i, (c, r, d, q) in enumerate(zip(chunks, rows, drafts, qs, strict=True)):
            t1 = t0 + len(r.ids)
            toks: list[int] = []
            if c.samples:
                with torch.inference_mode():
                    logits = self.target.lm_head(hidden[t1 - len(d) - 1 : t1]).float()
                lps: list[TokenLogprobs] | None = None
                try:  # one row's logits, penalties or draws fail that request alone (Engine fails it)
                    if d:
                        toks, lps = accept_with_logprobs(c.request, d, q, logits)
                    else:
                        got = sample_batch(logits[-1:], [c.request])
                        _raise(got.errors[0])
                        toks, lp = got.tokens, got.logprobs[0]
                        lps = [lp] if lp is not None else None
                except Exception as e:
                    self.errors[i] = f"{type(e).__name__}: {e}"
                    toks, lps = [], None
                if lps is not None:
                    self.logprobs[c.request.request_id] = lps
                if d and toks:
                    self.stats.verify_steps += 1
                    self.stats.draft_tokens += len(d)
                    self.stats.accepted_tokens += len(toks) - 1
                    self.stats.emitted_tokens += len(toks)
            produced.append(toks)
            r.t0 = t0
            t0 = t1
        ok = [i for i in range(len(chunks)) if i not in self.errors]
        if ok:
            self._extend([chunks[i] for i in ok], [rows[i] for i in ok], hidden, [produced[i] for i in ok])
        if self.poison_rejected:
            self._poison([chunks[i] for i in ok], [produced[i] for i in ok])
        for i in self.errors:
            self.forget(chunks[i].request.request_id)
        return produced

    def _chain(
        self, chunks: Sequence[ScheduledChunk], drafts: list[list[int]], qs: list[list[torch.Tensor | None]]
    ) -> None:
        """Draft tokens 2..k of every decode chunk: the draft layer on its own last token and hidden state."""
        live = [i for i, c in enumerate(chunks) if c.num_draft > 1 and drafts[i]]
        hid = {i: self.states[chunks[i].request.request_id].hidden for i in live}
        for j in range(1, max((chunks[i].num_draft for i in live), default=1)):
            live = [i for i in live if chunks[i].num_draft > j]
            if not live:
                break
            rows = []
            for i in live:
                c = chunks[i]
                pos = c.start + j - 1  # entry index: target position whose successor is drafts[i][-1]
                rows.append(_Row(c.request, pos, [drafts[i][-1]], hid[i][None]))
            batch = _batch(rows, self.pool.page_size, shift=1)
            prev = torch.cat([r.hidden for r in rows if r.hidden is not None])
            out = self.draft.step(self.target, batch, prev, self.pool)
            logits = self.draft.logits(self.target, out)
            for b, i in enumerate(live):
                req = chunks[i].request
                tok, q = _draw(logits[b], req, req.num_output_tokens + j, drafts[i])
                drafts[i].append(tok)
                qs[i].append(q)
                hid[i] = out[b]

    def _extend(
        self, chunks: Sequence[ScheduledChunk], rows: list[_Row], hidden: torch.Tensor, produced: list[list[int]]
    ) -> None:
        """Draft-layer KV for every position whose target KV is valid after this step, and the next d1."""
        drows = []
        for c, r, toks in zip(chunks, rows, produced, strict=True):
            req = c.request
            if c.samples:
                nxt = req.token_ids(c.start + 1, c.end) + toks  # successors of positions start..end-1+len(toks)-1
            else:
                nxt = req.token_ids(c.start + 1, c.end + 1)
            drows.append(_Row(req, c.start, nxt, hidden[r.t0 : r.t0 + len(nxt)]))
        batch = _batch(drows, self.pool.page_size, shift=1)
        prev = torch.cat([r.hidden for r in drows if r.hidden is not None])
        out = self.draft.step(self.target, batch, prev, self.pool)
        last = torch.cumsum(batch.extend_lens, 0) - 1
        want = [b for b, c in enumerate(chunks) if c.samples]
        if not want:
            return
        logits = self.draft.logits(self.target, out[last[want]])
        for row, b in enumerate(want):
            req = chunks[b].request
            toks = produced[b]
            index = req.num_output_tokens + len(toks)  # output index the draft token would take
            tok, q = _draw(logits[row], req, index, toks)
            n = chunks[b].end + len(toks) - 1
            self.states[req.request_id] = DraftState(n, [tok], [q], out[int(last[b])].clone())

    def _poison(self, chunks: Sequence[ScheduledChunk], produced: list[list[int]]) -> None:
        """NaN into every key's rows at the positions written this step beyond the kept sequence."""
        page = self.pool.page_size
        for c, toks in zip(chunks, produced, strict=True):
            if not c.num_draft:
                continue
            req = c.request
            kept = c.end + len(toks) - 1
            top = c.end + c.num_draft
            owned = len(req.page_ids) * page
            pos = [p for p in range(kept, min(top, owned))]
            if not pos:
                continue
            slots = torch.tensor([req.page_ids[p // page] * page + p % page for p in pos], dtype=torch.int64)
            for key in self.pool.layout.keys:
                self._access.write(key, slots, torch.full((len(pos), self._width(key.kind)), float("nan")))
            self.stats.poisoned_slots += len(pos)

    def _width(self, kind: Kind) -> int:
        s = self.pool.layout.spec
        return s.kv_lora_rank + s.qk_rope_head_dim if kind is Kind.KV else s.index_head_dim
