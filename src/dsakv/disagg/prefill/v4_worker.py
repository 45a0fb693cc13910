"""V4PrefillWorker: the prefill role of disaggregated serving for a DeepSeek-V4 checkpoint.

    router ─ CONNECT(decode) ─► every stage's V4Manifest to the decode (HANDSHAKE, one Hello per stage, this
                                process's boot), each side pairs the keys (check_v4_pair) ◄─ decode manifest
    router ─ SUBMIT(rid, prompt, decode pages, grant) ─► the grant verified (this decode's key; its slot is the
             decode's state slot) ─► V4Engine.add_request(prompt, 1 token, park=True): chunked prefill batched
             with the other prompts; at its last chunk the first token is drawn (greedy, or seeded with the
             router's seed as the decode draws the rest) and the request parks
    sender: stage k ═ v4_blocks: its paged kinds of the prompt's pages + its state keys of the slot ═► decode
            ─ STAGE_DONE(rid, k, ok, bytes; first token on the last stage; cached tokens on stage 0) ─► decode
            then the pages and slot are freed on every stage

With --pp-size N > 1 this one process is stage 0 and the control plane: stage 0's V4Engine holds layers [0, e0)
and steps every row through the stage children (disagg/prefill/v4_stages.py: embed here, each stage's layers
there, the head here), which hold their layers' kinds only and send them over their own transfer engines.
The prefix cache (and its host / L3 tiers) runs with --pp-size 1 only. The router's prefix affinity gets no
cache events from a V4 prefill (`prefix_cache_enabled` false in its health): it routes V4 by load.
A request whose deadline (kv_timeout) passes before its transfer starts is dropped and the decode told
(KV_FAILED); a failed transfer reports ok=False with the error and the backend's quarantine. Imports torch,
dsakv.{engine, model} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import torch

from dsakv.config import PrefillConfig, split_layers
from dsakv.disagg.prefill.v4_jobs import V4Job, V4Link, V4PrefillStats, V4PrefillViews, V4Sender
from dsakv.disagg.prefill.v4_stages import V4StageChild, stage_forward, start_stages
from dsakv.disagg.protocol import grants
from dsakv.disagg.protocol.errors import Unavailable
from dsakv.disagg.protocol.messages import (
    ABORT,
    CACHE_EVENTS,
    CONNECT,
    HANDSHAKE,
    KV_FAILED,
    PREFILL_LEADER_SERVICE,
    RELEASED,
    REVOKE,
    SUBMIT,
    Abort,
    CacheEvents,
    CacheEventsQuery,
    Connect,
    Connected,
    Hello,
    KvFailed,
    LinkSummary,
    Released,
    Revoke,
    Revoked,
    Submit,
    Submitted,
)
from dsakv.disagg.protocol.rpc import PeerUnavailable, RpcClient, RpcError
from dsakv.disagg.protocol.worker_service import PeerClients, WorkerService, connect_at_startup
from dsakv.disagg.transfer.backends import make_backend
from dsakv.disagg.transfer.v4 import V4Manifest, check_v4_pair, connect_v4
from dsakv.engine.v4_serve import check_v4_params
from dsakv.errors import ConfigError
from dsakv.model.deepseek_v4 import V4Row
from dsakv.util import ceil_div

log = logging.getLogger(__name__)

DEFAULT_V4_PREFILL_RUNNING = 8


class V4PrefillWorker(V4Sender, V4PrefillViews):
    """RPCs, the step loop and the sender of a DeepSeek-V4 prefill (see the module docstring)."""

    def __init__(self, cfg: PrefillConfig) -> None:
        from dsakv.engine.v4_engine import V4Engine
        from dsakv.engine.v4_serve import v4_storage_config
        from dsakv.model.deepseek_v4 import load_v4

        self.cfg = cfg
        self.t = cfg.timeouts
        ecfg = cfg.engine
        self.model = model = load_v4(cfg.model)
        pipe = cfg.pipeline
        self.ranges = split_layers(model.spec.num_layers, pipe.pp_size, pipe.partition)
        page = ecfg.layout.page_size
        layout = model.stage_layout(*self.ranges[0], page)
        pool = ecfg.pool
        self.num_pages = pool.num_pages or pool.pages_for_tokens(pool.max_tokens or 4096, layout.page)
        self.max_running = ecfg.scheduler.max_running_requests or DEFAULT_V4_PREFILL_RUNNING
        self.backend = make_backend(cfg.config.transfer.backend, **cfg.backend_options.kwargs())
        self.children: list[V4StageChild] = start_stages(
            cfg.model, self.ranges, self.num_pages, self.max_running, layout.page, cfg.config.transfer.backend,
            dict(cfg.backend_options.kwargs()), cfg.name or "v4-prefill", torch.get_num_threads(),
        )  # fmt: skip
        try:
            staged = pipe.pp_size > 1
            storage = v4_storage_config(ecfg)
            self.engine = V4Engine(
                model,
                num_pages=self.num_pages,
                max_running=self.max_running,
                page_size=page,
                chunk_size=ecfg.scheduler.max_batch_tokens,
                max_batch_tokens=ecfg.scheduler.max_batch_tokens,
                prefix_cache=ecfg.cache.enabled,
                host_pages=int(self.num_pages * (ecfg.cache.hicache_ratio or 0.0)),
                storage=storage,
                model_hash=self._model_hash() if storage is not None else None,
                layers=self.ranges[0] if staged else None,
                forward=self._pipeline_forward if staged else None,
            )
        except Exception:
            self._close_children()
            raise
        self.backend.register(self.engine.pool.regions())
        self.service = WorkerService(
            PREFILL_LEADER_SERVICE,
            {
                CONNECT: self.connect,
                SUBMIT: self.submit,
                ABORT: self.abort,
                RELEASED: self._released,
                CACHE_EVENTS: self._cache_events,
                REVOKE: self.revoke,
            },
            cfg.host,
            cfg.port,
            "prefill",
            health=self.health,
            integrity=self.integrity,
        )
        self.boot = self.service.boot
        self.name = cfg.name or f"prefill@{self.address}"
        self.manifest = V4Manifest.from_pool(self.engine.pool, self.backend.meta(), f"{self.name}-pp0")
        self.manifests = [self.manifest.to_bytes()] + [c.manifest_bytes for c in self.children]
        self.links: dict[str, V4Link] = {}
        self._peers = PeerClients(self.t.rpc, self.t.connect)  # STAGE_DONE / KV_FAILED: a kept connection per decode
        self.jobs: dict[str, V4Job] = {}
        self.stats = V4PrefillStats()
        self.spent = grants.SpentGrants()
        self.lock = threading.RLock()
        self._link_lock = threading.Lock()
        self._wake = threading.Event()
        self._sendq: queue.Queue[V4Job | None] = queue.Queue()
        log.info(
            "prefill %s (DeepSeek-V4): %d stage(s) %s, %d pages x %d tokens, %d request slots, backend %s, rpc %s",
            self.name, len(self.ranges), [f"{a}-{b - 1}" for a, b in self.ranges], self.num_pages, layout.page,
            self.max_running, cfg.config.transfer.backend, self.address,
        )  # fmt: skip

    def _model_hash(self) -> str:
        from dsakv.cache.fingerprint import weights_fingerprint

        return weights_fingerprint(self.model, self.cfg.model)

    @property
    def address(self) -> str:
        return self.service.address

    @property
    def page_size(self) -> int:
        return int(self.engine.layout.page)

    # ---- the pipeline's forward (stage 0's engine calls it with a step's rows) ------------------------------

    def _pipeline_forward(self, rows: list[V4Row]) -> torch.Tensor:
        return stage_forward(self.model, self.ranges, self.children, self.engine.pool, rows)

    # ---- RPC -------------------------------------------------------------------------------------------------

    def _link(self, addr: str, boot: str | None = None, timeout: float | None = None) -> V4Link:
        """The handshaken link to decode `addr` (handshaking every stage again if it is new or restarted)."""
        with self._link_lock:
            link = self.links.get(addr)
            if link is not None and (boot is None or boot == link.boot):
                return link
            timeout = self.t.rpc if timeout is None else timeout
            client = RpcClient(addr, timeout=timeout, connect_timeout=self.t.connect_for(timeout))
            try:
                replies = [
                    client.request(
                        HANDSHAKE,
                        Hello(self.name, k, len(self.ranges), self.address, m, self.boot),
                    )
                    for k, m in enumerate(self.manifests)
                ]
            finally:
                client.close()
            first = replies[0]
            if any(r.boot != first.boot for r in replies):
                raise PeerUnavailable(f"decode {addr} restarted during the handshake: try again")
            theirs = V4Manifest.from_bytes(first.manifest)
            layouts = [self.engine.layout] + [
                V4Manifest.from_bytes(m).layout(self.model.spec) for m in self.manifests[1:]
            ]
            pairs = [check_v4_pair(lay, theirs) for lay in layouts]  # this side's check too
            link = V4Link(
                addr, first.boot, theirs, first.manifest, first.grant_key, pairs, connect_v4(self.backend, theirs)
            )
            self.links[addr] = link
            log.info(
                "prefill %s: paired with decode %s (%s, boot %s): %s keys per stage", self.name, addr, first.name,
                first.boot, [len(p) for p in pairs],
            )  # fmt: skip
            return link

    def connect(self, p: Connect) -> Connected:
        link = self._link(p.decode, p.boot, p.timeout)
        return Connected(decode=p.decode, boot=link.boot, epoch=None, stages=self._summaries(link))

    def _summaries(self, link: V4Link) -> list[LinkSummary]:
        return [
            LinkSummary(link.addr, link.boot, len(pairs), [], sum(q.nbytes for q in pairs if q.paged))
            for pairs in link.pairs
        ]

    def down_reason(self) -> str | None:
        """Why this prefill cannot serve (a stage process exited: its layers are gone until a restart), or None."""
        for c in self.children:
            if not c.proc.is_alive():
                return f"stage {c.spec.index} (pid {c.pid}) exited with code {c.proc.exitcode}: restart this prefill"
        return None

    def submit(self, p: Submit) -> Submitted:
        rid, prompt = p.rid, list(p.prompt_ids)
        down = self.down_reason()
        if down is not None:
            raise Unavailable(f"prefill {self.name} is unavailable: {down}")
        check_v4_params(p.params)
        link = self._link(p.decode, p.decode_boot)
        n = ceil_div(len(prompt), self.page_size)
        g = grants.verify(
            link.grant_key, p.grant, rid=rid, boot=p.decode_boot, pages=p.dst_pages[:n], prefill=self.name
        )
        if g.slot < 0:
            raise ConfigError(f"request {rid}: the decode's grant names no state slot (not a DeepSeek-V4 decode?)")
        with self.lock:
            if self.service.stopping.is_set():
                raise Unavailable(f"prefill {self.name} is stopping")
            if rid in self.jobs:
                raise ConfigError(f"request id {rid!r} is already in use on prefill {self.name}")
            self.spent.spend(g)
            # its first token, drawn as the decode draws the rest (the router's seed); ConfigError / CapacityError:
            # nothing kept
            eid = self.engine.add_request(prompt, 1, park=True, sampling=p.params, seed=p.seed)
            self.jobs[rid] = V4Job(
                rid, eid, len(prompt), link, list(p.dst_pages[:n]), g.slot, p.grant, time.monotonic() + p.kv_timeout
            )
            self.stats.submitted += 1
        self._wake.set()
        return Submitted(accepted=True, epoch=None)

    def abort(self, p: Abort) -> bool:
        with self.lock:
            job = self.jobs.get(p.rid)
            if job is None:
                return False
            if job.sending:
                return True  # its transfer runs; the decode drops what lands
            self._drop(job, p.why or "aborted", tell=False)
            return True

    def _released(self, p: Released) -> bool:
        return False  # stages k > 0 are this process's children: nobody releases over RPC

    def _cache_events(self, q: CacheEventsQuery) -> CacheEvents:
        return CacheEvents(self.boot, None, self.page_size, 0, True, b"", b"", 0, self.num_pages)

    def revoke(self, p: Revoke) -> Revoked:
        with self.lock:
            job = self.jobs.get(p.rid)
            if job is None or job.grant != p.grant:
                return Revoked(in_flight=False, boot=self.boot)
            if not job.sending:
                self._drop(job, "revoked by the decode", tell=False)
                return Revoked(in_flight=False, boot=self.boot)
            return Revoked(in_flight=True, boot=self.boot)

    # ---- jobs (under the lock) ----------------------------------------------------------------------------

    def _drop(self, job: V4Job, why: str, tell: bool) -> None:
        """Forget a job not sending: its engine request (queued, computing or parked) and its pages go."""
        self.jobs.pop(job.rid, None)
        job.aborted = why
        if job.eid in self.engine.parked:
            self.engine.abort_parked(job.eid)
        else:
            self.engine.abort(job.eid)
        self.stats.dropped += 1
        if tell:
            self._post(job.link, KV_FAILED, KvFailed(job.rid, why, self.name, self.boot, 0, job.grant))

    def _post(self, link: V4Link, rpc: Any, msg: Any) -> None:
        """One control message to decode `link` on its kept connection (one per decode process, not per message)."""
        try:
            self._peers.client(link.addr, link.boot).request(rpc, msg)
        except RpcError as e:
            log.warning("prefill %s: %s of %s to %s failed: %s", self.name, rpc.name, msg.rid, link.addr, e)

    # ---- loops ------------------------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self.service.stopping.is_set():
            expired: list[V4Job] = []
            with self.lock:
                now = time.monotonic()
                for job in [j for j in self.jobs.values() if not j.queued and now >= j.deadline]:
                    expired.append(job)
                    self._drop(job, f"prefill {self.name}: request {job.rid} missed its KV deadline", tell=False)
                busy = self.engine.has_unfinished()
                if busy:
                    try:
                        self.engine.step()
                    except Exception as e:
                        log.exception("prefill %s: step failed", self.name)
                        for job in [j for j in self.jobs.values() if not j.queued]:
                            expired.append(job)
                            self._drop(job, f"prefill {self.name}: its step failed ({type(e).__name__}: {e})", False)
                for job in self.jobs.values():
                    if not job.queued and job.eid in self.engine.parked:
                        req = self.engine.parked[job.eid]
                        job.queued = True
                        job.first_token, job.cached_tokens = int(req.output[0]), int(req.cached_tokens)
                        self._sendq.put(job)
            for job in expired:
                msg = KvFailed(job.rid, job.aborted or "dropped", self.name, self.boot, 0, job.grant)
                self._post(job.link, KV_FAILED, msg)
            if not busy:
                self._wake.wait(0.01)
                self._wake.clear()

    # ---- lifetime --------------------------------------------------------------------------------------------

    def start(self, startup_wait: float | None = None) -> V4PrefillWorker:
        self.service.start([(self._loop, "v4-prefill-loop"), (self._send_loop, "v4-prefill-send")])
        wait = self.t.startup_wait if startup_wait is None else startup_wait
        connect_at_startup(self.cfg.decode, self._link, wait)  # an incompatible decode fails startup loudly
        return self

    def request_stop(self) -> None:
        self.service.request_stop()

    def _close_children(self) -> None:
        for c in self.children:
            c.stop()

    def stop(self) -> None:
        self.service.request_stop()
        self._wake.set()
        self._sendq.put(None)
        self.service.stop(join_timeout=5)
        self._peers.close()
        self._close_children()
        self.backend.close()
        self.engine.close()

    def serve_forever(self) -> None:
        self.service.serve_forever()
