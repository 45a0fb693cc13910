"""The decode's inbound-KV path (a mixin of decode.worker.DecodeWorker): PREALLOC reserves a request's pages and
signs its grant (with a staging slot when its destination is fragmented), KV_FAILED fails it, and once every stage
reported (DecodeWorker.stage_done) the staging slot is scattered into its pages and the request starts decoding."""

from __future__ import annotations

import hmac
import logging
import threading
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from dsakv.config import DecodeConfig, Timeouts
from dsakv.disagg.decode.inbound import InboundBook
from dsakv.disagg.decode.outputs import DecodeOutputs
from dsakv.disagg.decode.stats import DecodeStats
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.lifecycle import InboundKv, Ledger, Phase
from dsakv.disagg.protocol.messages import KvFailed, Prealloc, Preallocated, StageDoneReply
from dsakv.disagg.protocol.wire import page_list
from dsakv.disagg.transfer.backends.base import TransferBackend
from dsakv.disagg.transfer.bootstrap import StageRegistry
from dsakv.disagg.transfer.manifest import Manifest
from dsakv.disagg.transfer.staging import StagingSlots, offer_slot, written_keys
from dsakv.engine.engine import Engine
from dsakv.errors import ConfigError, NoFreePages
from dsakv.util import ceil_div

if TYPE_CHECKING:
    from dsakv.disagg.decode.stage import DecodePipeline

log = logging.getLogger("dsakv.disagg.decode.worker")


def draft_hidden_of(inb: InboundKv, hidden_size: int) -> torch.Tensor | None:
    """The prefill's draft hidden state (MTP) of `inb` as a tensor [H]; None if none came or it is malformed
    (then the first decode step drafts nothing, which changes no output)."""
    raw = inb.draft_hidden
    if raw is None:
        return None
    if len(raw) != 4 * hidden_size:
        log.warning("request %s: a %d-byte draft hidden state, expected %d: unused", inb.rid, len(raw), 4 * hidden_size)
        return None
    return torch.from_numpy(np.frombuffer(raw, dtype=np.float32).copy())


class KvIn:
    """Needs (set by DecodeWorker.__init__) the attributes below."""

    cfg: DecodeConfig
    t: Timeouts
    name: str
    boot: str
    engine: Engine
    pipeline: DecodePipeline | None
    backend: TransferBackend
    slots: StagingSlots | None
    manifest: Manifest
    registry: StageRegistry
    grant_key: bytes
    inbound: Ledger[InboundKv]
    book: InboundBook
    outputs: DecodeOutputs
    stats: DecodeStats
    _lock: threading.RLock
    _wake: threading.Event

    def prealloc(self, p: Prealloc) -> Preallocated:
        """Reserve the request's pages (held, waiting for KV) and start tracking its stages' reports."""
        rid, prefill, n, kv_timeout, prompt = p.rid, p.prefill, p.num_stages, p.kv_timeout, p.prompt_ids
        if kv_timeout > self.t.max_kv:  # every held page waits for its KV at most this long (+ grace, quarantine)
            raise ConfigError(
                f"decode {self.name}: request {rid} asks its pages be held {kv_timeout:g}s for its KV, more than "
                f"this decode's --max-kv-timeout {self.t.max_kv:g}s: lower the router's --kv-timeout (or raise "
                "--max-kv-timeout)"
            )
        stages = self.registry.stages_of(prefill, n)
        if self.pipeline is not None and self.pipeline.down_reason is not None:  # the router retries elsewhere
            self.stats.busy += 1
            raise NoFreePages(f"decode {self.name}: its pipeline is not serving ({self.pipeline.down_reason})")
        page_size = self.engine.layout.page_size  # not a stats() snapshot: it takes the engine lock
        with self._lock:
            try:  # the admission rule (room for every running request to grow a page) is the scheduler's
                pages = self.engine.prealloc(rid, prompt, p.params, keep_room=True)
            except NoFreePages as e:
                self.stats.busy += 1
                raise NoFreePages(f"decode {self.name}: {e}") from None
            if self.pipeline is not None:
                self.pipeline.held(rid, page_list(pages))
            inb = InboundKv(
                rid=rid,
                prefill=prefill,
                num_stages=n,
                stage_rpc={e.stage: e.rpc for e in stages},
                stage_boot={e.stage: e.boot for e in stages},
                kv_timeout=kv_timeout,
            )
            self.inbound.add(inb)
            inb.deadline = self.inbound.now() + kv_timeout + self.t.kv_grace
            self.outputs.add(rid, p.params.n)
            written = page_list(pages)[: ceil_div(len(prompt), page_size)]  # what the prefill stages write
            keys = written_keys(self.manifest, stages)
            force = self.cfg.config.transfer.debug_transfer_strategy  # testing: overrides the rule
            inb.slot, wanted = offer_slot(self.slots, self.manifest, rid, written, keys, self.backend.name, force)
            if inb.slot >= 0:
                inb.slot_dst, inb.slot_keys = written, keys
            elif wanted:
                self.stats.staging_no_slot += 1
            inb.grant = grants.sign(
                self.grant_key,
                rid=rid,
                prefill=prefill,
                boot=self.boot,
                pages=page_list(pages),
                expires=time.time() + kv_timeout + self.t.kv_grace,
                slot=inb.slot,
                slot_pages=len(inb.slot_dst),
            )
            self.stats.prealloc += 1
        return Preallocated(pages=page_list(pages), boot=self.boot, grant=inb.grant)

    def _scatter_and_start(self, inb: InboundKv) -> StageDoneReply:
        """Every stage wrote into the request's staging slot: scatter it into its pages, free the slot, start
        decoding (unless the request failed or was aborted meanwhile: then its pages go the failed way)."""
        assert self.slots is not None
        t0 = time.perf_counter()
        err = None
        try:
            nbytes = self.slots.scatter(
                inb.slot,
                self.manifest,
                self.engine.pool.regions(),
                inb.slot_keys,
                inb.slot_dst,  # type: ignore[arg-type]
            )
        except (ValueError, KeyError) as e:
            err = f"request {inb.rid}: scatter of staging slot {inb.slot} failed: {e}"
        with self._lock:
            inb.scattering = False
            if err is None:
                self.stats.staged_in += 1
                log.debug(
                    "decode %s: %s scattered %d B from staging slot %d into %d pages in %.4fs", self.name, inb.rid,
                    nbytes, inb.slot, len(inb.slot_dst), time.perf_counter() - t0,
                )  # fmt: skip
            self._release_slot(inb)  # every stage reported: nothing more lands in it
            if inb.phase is Phase.AWAITING_KV:
                if err is None:
                    self._start(inb)
                    return StageDoneReply(accepted=True, started=True)
                self.book.fail(inb, err)
            if inb.phase is Phase.FAILED:
                self.book.maybe_release(inb)
        return StageDoneReply(accepted=True)

    def _release_slot(self, inb: InboundKv) -> None:
        """Give the request's staging slot back (after its scatter, or once its failed pages are freed)."""
        if inb.slot >= 0 and self.slots is not None:
            self.slots.release(inb.slot, inb.rid)
            inb.slot = -1

    def kv_failed(self, p: KvFailed) -> bool:
        """A prefill stage dropped the request before transferring it: accepted only from the process registered
        for that stage of the request, with the request's grant (Forbidden otherwise)."""
        with self._lock:
            inb = self.inbound.get(p.rid)
            if inb is None or inb.phase is not Phase.AWAITING_KV:
                return False
            what = f"kv_failed of {p.rid}"
            if not 0 <= p.stage < inb.num_stages:
                raise self.book.refuse_report(what, f"stage {p.stage} is not one of its {inb.num_stages} stages")
            if p.boot not in self.book.boots(inb, p.stage):
                raise self.book.refuse_report(
                    what, f"boot {p.boot or '(none)'} is not the request's stage {p.stage} (boot "
                    f"{inb.stage_boot.get(p.stage)})",
                )  # fmt: skip
            if not hmac.compare_digest(p.grant, inb.grant):
                raise self.book.refuse_report(what, "it does not carry the request's grant")
            self.book.fail(inb, p.error or f"prefill {inb.prefill} failed the request")
            self.book.maybe_release(inb)
        return True

    # ---- inbound requests ------------------------------------------------------------------------------

    def _start(self, inb: InboundKv) -> None:
        first = inb.first_token if inb.first_token is not None else 0
        self.engine.start_decode(
            inb.rid,
            first,
            inb.first_logprobs,
            inb.prompt_logprobs or (),
            inb.cached_tokens,
            draft_hidden=draft_hidden_of(inb, self.engine.spec.hidden_size),
        )
        self.inbound.move(inb, Phase.DECODING)
        self.stats.started += 1
        self.stats.kv_bytes += inb.bytes
        self._wake.set()
