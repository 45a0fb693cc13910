"""The Engine's request API (a mixin of engine.Engine): validate and queue requests (add_request, with params.n
forks), abort, and the disaggregated-serving calls (a decode's prealloc / start_decode, a prefill's pages_of /
release). Every method takes the engine's lock."""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch

from dsakv.cache.hisparse import HiSparsePool
from dsakv.engine.request import Request, RequestOutput, SamplingParams, TokenLogprobs
from dsakv.engine.sampling import validate_sampling
from dsakv.engine.scheduler import Scheduler
from dsakv.errors import ConfigError
from dsakv.spec.model import ModelSpec

log = logging.getLogger("dsakv.engine.engine")


class EngineRequests:
    """Needs (set by Engine.__init__) the attributes below."""

    spec: ModelSpec
    scheduler: Scheduler
    hisparse: HiSparsePool | None
    speculator: Any
    eos_token_ids: tuple[int, ...]
    _lock: threading.RLock
    _rng: random.Random
    _ids: itertools.count[int]
    _arrivals: itertools.count[int]
    _pending: list[RequestOutput]

    # ---- requests ----------------------------------------------------------------------

    def _new_request(
        self, request_id: str | None, prompt_ids: Sequence[int], params: SamplingParams | None, keep_pages: bool
    ) -> Request:
        params = params or SamplingParams()
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        vocab = self.spec.vocab_size
        bad = [t for t in prompt_ids if isinstance(t, int) and not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"request {rid}: prompt token id(s) {bad[:8]} are outside the vocabulary 0..{vocab - 1}")
        try:
            validate_sampling(params, vocab, self.eos_token_ids)
        except ConfigError as e:
            raise ConfigError(f"request {rid}: {e}") from None
        if self.hisparse is not None and params.n > self.scheduler.max_running_requests:
            raise ConfigError(
                f"request {rid}: n = {params.n} sequences need a HiSparse hot buffer each, but this engine runs at "
                f"most {self.scheduler.max_running_requests} requests (one hot buffer each): lower n to at most "
                f"{self.scheduler.max_running_requests}, or give HiSparse more device memory"
            )
        return Request(
            request_id=rid,
            prompt_ids=tuple(prompt_ids),
            params=params,
            eos_token_ids=self.eos_token_ids,
            arrival=next(self._arrivals),
            sampling_seed=params.seed if params.seed is not None else self._rng.getrandbits(63),
            keep_pages=keep_pages,
        )

    def _with_forks(self, req: Request) -> Request:
        """params.n > 1: the other n - 1 sequences as req.forks, ids '<id>/<i>', seed + i, no prompt logprobs."""
        p = req.params
        if p.n > 1:
            if req.keep_pages:
                raise ConfigError(f"request {req.request_id}: n = {p.n} > 1 is not supported with keep_pages")
            child = replace(p, prompt_logprobs=None)
            for i in range(1, p.n):
                req.forks.append(
                    Request(
                        request_id=f"{req.request_id}/{i}",
                        prompt_ids=req.prompt_ids,
                        params=child,
                        eos_token_ids=req.eos_token_ids,
                        arrival=req.arrival,
                        sampling_seed=(req.sampling_seed + i) % 2**63,
                        choice_index=i,
                    )
                )
        return req

    def add_request(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        keep_pages: bool = False,
    ) -> str:
        """Queue a request; returns its id. Raises CapacityError (queuing nothing) if it can never fit.

        keep_pages=True (a prefill worker): when it finishes (stop/length) its pages stay held until
        release(request_id), so its KV can be read (pages_of) and transferred first.

        params.n > 1: n sequences; the returned id is sequence 0, sequence i is '<id>/<i>' (sampling seed + i,
        RequestOutput.choice_index i). They share the prompt's whole pages: sequence 0 prefills the prompt and
        the others start from its pages (refcounted), recomputing only the prompt's last partial page."""
        with self._lock:
            req = self._with_forks(self._new_request(request_id, prompt_ids, params, keep_pages))
            self.scheduler.add(req)
            log.debug("queued %s", req)
            return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request (waiting, running, or waiting for its KV) and free its pages; its final output (reason
        'abort') is returned and also reported by the next step(). None if the id is unknown or finished (a
        finished request's kept pages are released)."""
        with self._lock:
            if request_id in self.scheduler.kept:
                self.scheduler.release(request_id)
                return None
            req = self.scheduler.abort(request_id)
            if req is None:
                return None
            out = RequestOutput.of(req, 0)
            self._pending.append(out)
            return out

    # ---- disaggregated serving --------------------------------------------------------------

    def prealloc(
        self,
        request_id: str,
        prompt_ids: Sequence[int],
        params: SamplingParams | None = None,
        *,
        keep_room: bool = False,
    ) -> npt.NDArray[np.int64]:
        """Decode worker: reserve the pages of a request whose prompt is prefilled elsewhere (prompt + its first
        token), held under request_id; returns their ids, in token order, for the prefill worker to write the KV
        to (token t at slot page_ids[t // page_size] * page_size + t % page_size). Then start_decode() it, or
        abort() it if the transfer fails. Raises CapacityError if it can never fit, NoFreePages if not now
        (`keep_room`: also while running requests would be left no page to grow into: Scheduler.prealloc)."""
        with self._lock:
            req = self._with_forks(self._new_request(request_id, prompt_ids, params, False))
            return self.scheduler.prealloc(req, keep_room=keep_room)

    def start_decode(
        self,
        request_id: str,
        first_token: int,
        first_logprobs: TokenLogprobs | None = None,
        prompt_logprobs: Sequence[TokenLogprobs] = (),
        cached_tokens: int = 0,
        draft_hidden: torch.Tensor | None = None,
    ) -> RequestOutput:
        """Decode worker: the prompt's KV is in the prealloc'd pages and the prefill sampled `first_token` (with
        its logprobs and the prompt's, when the params ask; `cached_tokens`: the prefill's prefix-cache hit, for
        usage); the request now decodes, and with params.n > 1 its other choices start on its prompt pages as
        add_request's do. The returned output (first token; finished if that token stops it) is also reported
        by the next step(). With speculation, `draft_hidden` [H] (the prefill's draft output at the prompt's last
        entry, engine.speculative.draft_prefill) lets the first decode step verify a draft."""
        with self._lock:
            req = self.scheduler.start_decode(request_id, first_token)
            if first_logprobs is not None:
                req.output_logprobs = [first_logprobs]
            req.prompt_logprobs = list(prompt_logprobs)
            req.num_cached_tokens = int(cached_tokens)
            if self.speculator is not None and draft_hidden is not None and not req.is_finished:
                self.speculator.seed(req, draft_hidden)
            out = RequestOutput.of(req, 1)
            self._pending.append(out)
            return out

    def pages_of(self, request_id: str) -> npt.NDArray[np.int64]:
        """Page ids a request holds, in token order (running, waiting for KV, or finished with keep_pages)."""
        with self._lock:
            return self.scheduler.pages_of(request_id)

    def release(self, request_id: str) -> bool:
        """Prefill worker: free the pages a finished keep_pages request holds. False if it holds none."""
        with self._lock:
            return self.scheduler.release(request_id) is not None

    def get_request(self, request_id: str) -> Request | None:
        with self._lock:
            return self.scheduler.requests.get(request_id)

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_unfinished()
