"""PrefillStage: one pipeline-parallel stage of a prefill worker (one process per stage).

    router ──rpc submit(rid, prompt, decode addr, decode pages, deadline)──► stage 0
    stage 0: Scheduler (chunked prefill, keep_pages) ─ step ─► stage 1 ─► ... ─► stage N-1 (norm + lm_head:
             first token)            hidden [T, H] + top-k [T, K] + step metadata over gloo (stage_comm)
    every stage, when a request's last prompt chunk ran: TransferPlan(its own layers' paired keys,
             its pages -> the decode's pages) on its TransferBackend, bounded by the request's deadline,
             then rpc decode.stage_done(rid, stage, ok, error, first token (last stage)).
    every stage k > 0 then tells stage 0 `released(rid)`; stage 0 frees the request's pages once all N
             stages released them, so a page is never reused while a stage still reads it.

Stage 0's PageAllocator decides page ids for every stage (all stage pools have the same page count);
later stages mirror the books (PageMirror). Prefix cache (cfg.prefix_cache, device only): stage 0's
Scheduler runs a HiCache over its pool; a hit reuses page ids that every stage wrote in an earlier step
(steps reach every stage in order, and a cached page is never reallocated while cached), so each stage
computes only the rest and still transfers every prompt page. Stage 0 sends the cache's page set with
the step/tick metadata whenever it changes (later stages' mirrors book it); a broken pipeline clears the
cache (a restarted stage lost its KV). Host tier (cfg.hicache_ratio / hicache_size): every stage has a
HostPool of stage 0's page count; stage 0 records each offload/load its HiCache performs (host_replay)
and sends them with the next step/tick; later stages replay them on their own pools before computing.
Failure handling:
- a send/receive between stages that fails or times out (stage_timeout) breaks the pipeline: every
  stage fails the requests it has not finished computing (decode is told `kv_failed`), lets running
  transfers finish (bounded by their deadlines), and the stages re-form a new epoch; a restarted stage
  joins it. While broken, stage 0 refuses submissions (the router routes elsewhere).
  Stage 0 frees every page at once: nothing is scheduled before the group re-forms, and a stage joins
  a new epoch only after its own transfers drained.
- a request whose deadline passes while queued or computing is dropped and decode told.
- transfers fail at the deadline (TransferTimeout); decode is told with the backend's quarantine.
Every stage process loads the whole checkpoint and runs only its layers (fine for the tiny model; a
large model would load only its layer range).

Imports torch, dsakv.{spec,cache,model,engine} and dsakv.disagg; never serve or cli.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.device_pool import DevicePool
from dsakv.cache.hicache import HiCache, HiCacheConfig
from dsakv.cache.host_pool import HostPool, host_pages_for, make_host_pool
from dsakv.disagg.backends import make_backend
from dsakv.disagg.backends.base import TransferHandle
from dsakv.disagg.bootstrap import DecodeLinks
from dsakv.disagg.codec import from_wire, to_wire
from dsakv.disagg.errors import TransferTimeout, Unavailable
from dsakv.disagg.host_replay import HostCopyLog, replay
from dsakv.disagg.manifest import Manifest
from dsakv.disagg.messages import (
    ABORT,
    CHECK_INTEGRITY,
    CONNECT,
    HEALTH,
    KV_FAILED,
    PING,
    PREFILL_FOLLOWER_SERVICE,
    PREFILL_LEADER_SERVICE,
    RELEASED,
    STAGE_DONE,
    STEP,
    SUBMIT,
    TICK,
    Abort,
    Connect,
    Connected,
    Health,
    Hello,
    JobSpec,
    KvFailed,
    Ping,
    PingReply,
    Released,
    StageDone,
    StageInfo,
    StepMsg,
    StepRow,
    Submit,
    Submitted,
    TransferHealth,
)
from dsakv.disagg.page_mirror import PageMirror
from dsakv.disagg.rpc import PeerUnavailable, Rpc, RpcClient, RpcError, RpcServer, bind
from dsakv.disagg.stage_comm import StageGroup, StageLinkError, StageMessage, default_dist_port
from dsakv.disagg.transfer_plan import TransferPlan
from dsakv.disagg.wire import new_boot_id, page_list, pages_for
from dsakv.engine.model_runner import build_batch
from dsakv.engine.request import Request, SamplingParams
from dsakv.engine.sampling import sample
from dsakv.engine.scheduler import Scheduler, SchedulerOutput
from dsakv.errors import CapacityError, ConfigError, DsakvError
from dsakv.model.batch import ForwardBatch
from dsakv.model.dsa_model import DSAModel, StageCarry
from dsakv.plan.capacity import even_partition
from dsakv.spec.layout import DEFAULT_PAGE_SIZE
from dsakv.spec.model import ModelSpec

log = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 16384


def split_layers(num_layers: int, pp_size: int, partition: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """[start, end) of each stage: `partition` (layers per stage) or an even split, earlier stages larger."""
    if pp_size < 1:
        raise ConfigError(f"--pp-size {pp_size} must be >= 1")
    if partition is None:
        partition = even_partition(num_layers, pp_size)
    if len(partition) != pp_size:
        raise ConfigError(f"--pp-partition {list(partition)} has {len(partition)} stages but --pp-size is {pp_size}")
    if any(n < 1 for n in partition) or sum(partition) != num_layers:
        raise ConfigError(
            f"--pp-partition {','.join(map(str, partition))} must give every stage >= 1 layer and sum to the "
            f"model's {num_layers} layers (sums to {sum(partition)})"
        )
    out, start = [], 0
    for n in partition:
        out.append((start, start + n))
        start += n
    return out


@dataclass(frozen=True)
class PrefillConfig:
    """One stage of a prefill worker. Stage k listens for control RPC on port + k."""

    model: str
    pp_size: int = 1
    pp_rank: int = 0
    partition: tuple[int, ...] | None = None
    host: str = "127.0.0.1"
    port: int = 0  # base port (stage k: port + k); 0 = any free port (pp_size 1 only)
    stage0_host: str | None = None  # where stage 0 runs (the gloo rendezvous); default host
    dist_port: int | None = None  # gloo rendezvous (TCPStore) on stage 0; default port + pp_size
    name: str | None = None  # worker name; default prefill@<stage0 host>:<port>
    elide: bool = True
    kv_format: str = "fp32"
    index_format: str = "fp32"
    page_size: int = DEFAULT_PAGE_SIZE
    num_pages: int | None = None
    max_batch_tokens: int = 512
    max_running_requests: int | None = None
    dtype: str = "float32"
    backend: str = "mooncake"
    backend_options: dict[str, Any] = field(default_factory=dict, hash=False)
    stage_timeout: float = 10.0
    rpc_timeout: float = 5.0
    decode: tuple[str, ...] = ()  # decode workers to handshake with at startup (fail loudly if refused)
    debug_transfer_delay: float = 0.0  # testing: hold each transfer this long before submitting it
    prefix_cache: bool = False  # device-only prefix cache on stage 0's books (every stage keeps the pages)
    hicache_ratio: float | None = None  # host tier (turns the prefix cache on): ratio x stage 0's pool bytes
    hicache_size: int | None = None  # or stage 0's host tier bytes (every stage gets the same page count)
    hicache_layout: str = "layer_first"
    hicache_write_policy: str = "write_through"
    hicache_selective_threshold: int = 2

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise ConfigError(f"--pp-rank {self.pp_rank} must be in 0..{self.pp_size - 1} (--pp-size {self.pp_size})")
        if self.port == 0 and self.pp_size > 1:
            raise ConfigError("a pipeline of more than one stage needs an explicit --port (stage k uses port + k)")
        if self.stage_timeout <= 0 or self.rpc_timeout <= 0:
            raise ConfigError(
                f"--stage-timeout {self.stage_timeout} and --rpc-timeout {self.rpc_timeout} must be > 0 seconds"
            )
        if self.num_pages is not None and self.num_pages < 1:
            raise ConfigError(f"--num-pages {self.num_pages} must be >= 1")

    @property
    def cache_enabled(self) -> bool:
        return self.prefix_cache or self.host_tier

    @property
    def host_tier(self) -> bool:
        return self.hicache_ratio is not None or self.hicache_size is not None

    def hicache_config(self) -> HiCacheConfig:
        return HiCacheConfig(
            hicache_ratio=self.hicache_ratio,
            hicache_size=self.hicache_size,
            layout=self.hicache_layout,
            write_policy=self.hicache_write_policy,
            selective_threshold=self.hicache_selective_threshold,
        )

    @property
    def worker_name(self) -> str:
        return self.name or f"prefill@{self.stage0_host or self.host}:{self.port}"


@dataclass
class Job:
    """A request at one stage: where its KV goes and when it must have arrived."""

    rid: str
    prompt_len: int
    decode: str
    decode_boot: str
    dst_pages: list[int]
    deadline: float  # this process's time.monotonic()
    params: SamplingParams
    seed: int
    prompt_ids: list[int] | None = None  # stage 0 only
    transferring: bool = False

    def spec(self) -> JobSpec:
        return JobSpec(
            rid=self.rid,
            prompt_len=self.prompt_len,
            decode=self.decode,
            decode_boot=self.decode_boot,
            dst_pages=self.dst_pages,
            left=max(0.0, self.deadline - time.monotonic()),
            params=self.params,
            seed=self.seed,
        )

    @classmethod
    def of(cls, d: JobSpec) -> Job:
        return cls(
            rid=d.rid,
            prompt_len=d.prompt_len,
            decode=d.decode,
            decode_boot=d.decode_boot,
            dst_pages=list(d.dst_pages),
            deadline=time.monotonic() + d.left,
            params=d.params,
            seed=d.seed,
        )


@dataclass
class _Xfer:
    job: Job
    src_pages: list[int]
    first_token: int | None


def encode_batch(b: ForwardBatch) -> dict[str, Any]:
    def arr(t: torch.Tensor) -> list[Any]:
        a = t.to(torch.int64).contiguous().numpy()
        return [list(a.shape), a.tobytes()]

    return {
        k: arr(getattr(b, k))
        for k in ("input_ids", "positions", "prefix_lens", "extend_lens", "slot_table", "out_slots")
    }


def decode_batch(d: dict[str, Any]) -> ForwardBatch:
    def t(v: list[Any]) -> torch.Tensor:
        shape, raw = v
        return torch.from_numpy(np.frombuffer(raw, dtype=np.int64).reshape(shape).copy())

    return ForwardBatch(**{k: t(v) for k, v in d.items()})


class _Notifier:
    """Fire-and-forget control RPCs (bounded each) on one background thread, in order."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._q: queue.Queue[tuple[str, Rpc[Any, Any], Any] | None] = queue.Queue()
        self._clients: dict[str, RpcClient] = {}
        self._t = threading.Thread(target=self._loop, name="notifier", daemon=True)
        self._t.start()

    def client(self, addr: str) -> RpcClient:
        c = self._clients.get(addr)
        if c is None:
            c = self._clients[addr] = RpcClient(addr, timeout=self.timeout, connect_timeout=min(2.0, self.timeout))
        return c

    def post(self, addr: str, rpc: Rpc[Any, Any], msg: Any) -> None:
        self._q.put((addr, rpc, msg))

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            addr, rpc, msg = item
            try:
                self.client(addr).request(rpc, msg)
            except RpcError as e:
                log.info("notify %s %s(%s) failed: %s", addr, rpc.name, getattr(msg, "rid", ""), e)

    def stop(self) -> None:
        self._q.put(None)


class PrefillStage:
    """One stage process. start() serves RPC and runs the stage loop; stop() ends both."""

    def __init__(self, cfg: PrefillConfig, model: tuple[Any, Any] | None = None) -> None:
        self.cfg = cfg
        self.rank = cfg.pp_rank
        self.size = cfg.pp_size
        if model is None:
            from dsakv.model.loader import load_model

            model = load_model(Path(cfg.model), dtype=getattr(torch, cfg.dtype))
        spec, mdl = model
        self.spec: ModelSpec = spec
        self.model: DSAModel = mdl
        self.model.eval()
        self.ranges = split_layers(self.spec.num_layers, cfg.pp_size, cfg.partition)
        self.layer_start, self.layer_end = self.ranges[self.rank]
        self.last = self.rank == self.size - 1
        self.layout = self.model.layout_for(
            elide=cfg.elide,
            kv_format=cfg.kv_format,
            index_format=cfg.index_format,
            page_size=cfg.page_size,
            layer_start=self.layer_start,
            layer_end=self.layer_end,
        )
        self.page_size = cfg.page_size
        self.num_pages = cfg.num_pages or pages_for(DEFAULT_MAX_TOKENS, cfg.page_size)
        self.pool = DevicePool(self.layout, self.num_pages, device=self.model.device)
        self.name = cfg.worker_name
        self.boot = new_boot_id()
        self.backend = make_backend(cfg.backend, **cfg.backend_options)
        self.backend.register(self.pool.regions())
        self.manifest = Manifest.from_pool(self.pool, self.backend.meta(), worker=f"{self.name}/stage{self.rank}")
        handlers: dict[Rpc[Any, Any], Callable[[Any], Any]] = {
            PING: self._rpc_ping,
            HEALTH: lambda _: self.health(),
            CONNECT: self._rpc_connect,
            CHECK_INTEGRITY: lambda _: self.integrity(),
        }
        if self.rank == 0:
            handlers |= {SUBMIT: self._rpc_submit, ABORT: self._rpc_abort, RELEASED: self._rpc_released}
        service = PREFILL_LEADER_SERVICE if self.rank == 0 else PREFILL_FOLLOWER_SERVICE
        self.rpc = RpcServer(
            bind(service, handlers), cfg.host, cfg.port + self.rank if cfg.port else 0, name=f"prefill{self.rank}"
        )
        self.links = DecodeLinks(
            self.backend,
            self.manifest,
            Hello(self.name, self.rank, self.size, self.rpc.address, self.manifest.to_bytes()),
            rpc_timeout=cfg.rpc_timeout,
        )
        stage0_host = cfg.stage0_host or cfg.host
        self.group = StageGroup(
            self.rank,
            self.size,
            stage0_host,
            cfg.dist_port or default_dist_port(cfg.port, self.size),
            cfg.stage_timeout,
            hidden_dtype=self.model.dtype,
            hidden_size=self.spec.hidden_size,
        )
        self.tick_s = min(1.0, cfg.stage_timeout / 4)
        self._lock = threading.RLock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.jobs: dict[str, Job] = {}
        self.notifier = _Notifier(cfg.rpc_timeout)
        self._xfers: queue.Queue[_Xfer] = queue.Queue()
        self._xfer_busy = 0
        self._xfer_lock = threading.Lock()
        self.down_reason: str | None = "pipeline not formed yet" if self.size > 1 else None
        self.counters = {"submitted": 0, "transferred": 0, "transfer_failed": 0, "dropped": 0, "steps": 0}
        if self.rank == 0:
            self.allocator = PageAllocator(self.num_pages, name=f"{self.name} stage 0 pool")
            self.cache = HiCache(self.pool, self.allocator, cfg.hicache_config()) if cfg.cache_enabled else None
            self._recorder: HostCopyLog | None = None
            if self.cache is not None and self.cache.host is not None and self.size > 1:
                self._recorder = HostCopyLog()
                self.cache.add_observer(self._recorder)
            self._cache_sent: tuple[int, ...] | None = None  # the cache page set later stages last got
            max_pos = self.spec.raw.get("max_position_embeddings")
            self.scheduler = Scheduler(
                self.allocator,
                cfg.page_size,
                max_batch_tokens=cfg.max_batch_tokens,
                max_running_requests=cfg.max_running_requests,
                max_seq_len=int(max_pos) if isinstance(max_pos, int) and max_pos > 1 else None,
                prefix_cache=self.cache,
            )
            self._control: deque[tuple[str, str, str]] = deque()  # (op, rid, why): abort / released
            self._pending_release: dict[str, set[int]] = {}
            self._drops: list[str] = []
        else:
            self.mirror = PageMirror(self.num_pages, name=f"{self.name} stage {self.rank} pool")
            self.host_pool: HostPool | None = None
            if cfg.host_tier:
                cfg.hicache_config()  # validates
                a, b = self.ranges[0]
                stage0 = self.model.layout_for(
                    elide=cfg.elide,
                    kv_format=cfg.kv_format,
                    index_format=cfg.index_format,
                    page_size=cfg.page_size,
                    layer_start=a,
                    layer_end=b,
                )
                _, host_pages = host_pages_for(stage0, self.num_pages, cfg.hicache_ratio, cfg.hicache_size)
                self.host_pool = make_host_pool(cfg.hicache_layout, self.layout, host_pages)
                self.host_pool.check_compatible(self.pool)
            self.replayed = {"offload_pages": 0, "load_pages": 0}
        self._threads: list[threading.Thread] = []
        self._step = 0
        self._last_send = 0.0
        log.info(
            "prefill %s stage %d/%d: layers %d-%d, %d pages x %d tokens, %d B/token, elide=%s, backend %s, rpc %s",
            self.name,
            self.rank,
            self.size,
            self.layer_start,
            self.layer_end - 1,
            self.num_pages,
            cfg.page_size,
            self.layout.bytes_per_token,
            cfg.elide,
            cfg.backend,
            self.rpc.address,
        )

    # ---- lifetime --------------------------------------------------------------------------------

    @property
    def address(self) -> str:
        return self.rpc.address

    def start(self, startup_wait: float = 60.0) -> PrefillStage:
        """Serve; then handshake with cfg.decode (waiting up to startup_wait for each to come up). An
        incompatible decode raises IncompatiblePeer naming layer, kind and sizes: startup fails loudly."""
        self.rpc.start()
        for target, name in ((self._loop, "stage-loop"), (self._xfer_loop, "stage-xfer")):
            t = threading.Thread(target=target, name=f"{name}{self.rank}", daemon=True)
            t.start()
            self._threads.append(t)
        for addr in self.cfg.decode:
            end = time.monotonic() + startup_wait
            while True:
                try:
                    self.links.get(addr)
                    break
                except PeerUnavailable:
                    if time.monotonic() >= end:
                        raise
                    time.sleep(0.5)
        return self

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=self.cfg.stage_timeout + 2)
        self.group.close()
        self.rpc.stop()
        self.notifier.stop()
        self.backend.close()

    def serve_forever(self) -> None:
        while not self._stop.is_set():
            self._stop.wait(1.0)

    # ---- RPC --------------------------------------------------------------------------------------

    def _rpc_ping(self, _: Ping) -> PingReply:
        return PingReply(pid=os.getpid(), boot=self.boot, stage=self.rank, epoch=self.group.epoch)

    def integrity(self) -> str:
        try:
            with self._lock:
                if self.rank == 0:
                    self.scheduler.check_integrity()
                    missing = [r for r in self._pending_release if not self.allocator.held_by(r).size]
                    if missing:
                        return f"requests {missing[:4]} await releases but hold no pages"
                else:
                    self.mirror.check_integrity()
        except AssertionError as e:
            return str(e)
        return "ok"

    def pages_used(self) -> int:
        """Pages held by requests or by the prefix cache (stage 0's books, or this stage's mirror of them)."""
        with self._lock:
            return self.allocator.num_used if self.rank == 0 else self.mirror.num_used

    def cached_pages(self) -> list[int]:
        """Sorted page ids the prefix cache holds (stage 0: its radix tree; later stages: the mirrored set)."""
        with self._lock:
            if self.rank > 0:
                return self.mirror.cached
            if self.cache is None:
                return []
            ids = [n.device for n in self.cache.radix.nodes() if n.device is not None]
            return sorted(int(p) for p in np.concatenate(ids)) if ids else []

    def prefix_cache_stats(self) -> dict[str, Any] | None:
        """Stage 0's prefix-cache counters (HiCacheStats.to_dict()); None when the cache is off or on stage k."""
        with self._lock:
            cache = self.cache if self.rank == 0 else None
            return cache.stats.to_dict() if cache is not None else None

    def health(self) -> Health:
        with self._lock:
            used = self.pages_used()
            t = self.backend.stats.totals()
            lead = self.rank == 0
            return Health(
                ok=self.group.formed and self.down_reason is None and not self._stop.is_set(),
                role="prefill",
                name=self.name,
                stage=self.rank,
                num_stages=self.size,
                pid=os.getpid(),
                boot=self.boot,
                epoch=self.group.epoch,
                down=self.down_reason,
                layers=[self.layer_start, self.layer_end - 1],
                elide=self.cfg.elide,
                backend=self.cfg.backend,
                page_size=self.page_size,
                pages_total=self.num_pages,
                pages_used=used,
                pages_free=self.num_pages - used,
                capacity_tokens=self.num_pages * self.page_size,
                jobs=len(self.jobs),
                transfers_in_flight=self._xfer_busy + self._xfers.qsize(),
                links=[link.summary() for link in self.links.links()],
                counters=dict(self.counters),
                integrity=self.integrity(),
                prefix_cache_enabled=self.cfg.cache_enabled,
                host_tier=self.cfg.host_tier,
                cache_pages=len(self.cached_pages()),
                stages=[
                    StageInfo(stage=r, rpc=str(info["rpc"]), pid=info.get("pid"), boot=info.get("boot"))
                    for r, info in sorted(self.group.peer_info.items())
                ]
                if lead and self.group.formed
                else [],
                waiting=self.scheduler.num_waiting if lead else None,
                running=self.scheduler.num_running if lead else None,
                awaiting_release=len(self._pending_release) if lead else None,
                prefix_cache=self.prefix_cache_stats() if lead else None,
                host_replayed=None if lead else dict(self.replayed),
                transfer=TransferHealth(count=t.transfers, failures=t.failures, bytes=t.bytes, seconds=t.seconds),
            )

    def _rpc_connect(self, p: Connect) -> Connected:
        """Handshake with decode p.decode (stage 0: on every stage). Raises if refused or unreachable."""
        addr = p.decode
        timeout = self.cfg.rpc_timeout if p.timeout is None else p.timeout
        link = self.links.get(addr, p.boot, timeout=timeout)
        stages = [link.summary()]
        if self.rank == 0 and self.size > 1:
            if not self.group.formed:
                raise Unavailable(f"prefill {self.name}: pipeline not formed ({self.down_reason})")
            for r in range(1, self.size):
                info = self.group.peer_info.get(r)
                if info is None:
                    raise Unavailable(f"prefill {self.name}: stage {r} is not in the pipeline")
                c = RpcClient(str(info["rpc"]), timeout=timeout)
                try:
                    stages += c.request(CONNECT, Connect(decode=addr, boot=link.boot, timeout=timeout)).stages
                finally:
                    c.close()
        return Connected(decode=addr, boot=link.boot, epoch=self.group.epoch, stages=stages)

    def _rpc_submit(self, p: Submit) -> Submitted:
        rid = p.rid
        prompt = p.prompt_ids
        with self._lock:
            if self._stop.is_set() or not self.group.formed or self.down_reason is not None:
                raise Unavailable(f"prefill {self.name} is unavailable: {self.down_reason or 'stopping'}")
            if rid in self.jobs:
                raise ConfigError(f"request id {rid!r} is already in use on prefill {self.name}")
            vocab = self.spec.vocab_size
            bad = [t for t in prompt if not 0 <= t < vocab]
            if bad:
                raise ConfigError(
                    f"request {rid}: prompt token id(s) {bad[:8]} are outside the vocabulary 0..{vocab - 1}"
                )
            dst = p.dst_pages
            if len(dst) < pages_for(len(prompt), self.page_size):
                raise CapacityError(
                    f"request {rid}: {len(dst)} decode pages for a {len(prompt)}-token prompt, need "
                    f"{pages_for(len(prompt), self.page_size)} of {self.page_size} tokens"
                )
            req = Request(
                request_id=rid,
                prompt_ids=tuple(prompt),
                params=SamplingParams(max_new_tokens=1, ignore_eos=True),
                keep_pages=True,
            )
            self.scheduler.add(req)  # CapacityError if it can never fit this pool
            self.jobs[rid] = Job(
                rid=rid,
                prompt_len=len(prompt),
                decode=p.decode,
                decode_boot=p.decode_boot,
                dst_pages=dst,
                deadline=time.monotonic() + p.kv_timeout,
                params=p.params,
                seed=p.seed,
                prompt_ids=prompt,
            )
            self.counters["submitted"] += 1
        self._wake.set()
        return Submitted(accepted=True, epoch=self.group.epoch)

    def _rpc_abort(self, p: Abort) -> bool:
        with self._lock:
            self._control.append(("abort", p.rid, p.why or "aborted by the router"))
        self._wake.set()
        return True

    def _rpc_released(self, p: Released) -> bool:
        with self._lock:
            self._control.append(("released", p.rid, str(p.stage)))
        self._wake.set()
        return True

    # ---- stage loop ----------------------------------------------------------------------------------

    def _loop(self) -> None:
        info = {"rpc": self.rpc.address, "pid": os.getpid(), "boot": self.boot}
        while not self._stop.is_set():
            try:
                if not self.group.formed:
                    self._wait_transfers_drained()
                    if self.group.form(info):
                        self._on_formed()
                    continue
                if self.rank == 0:
                    self._stage0_iteration()
                else:
                    self._stagek_iteration()
            except StageLinkError as e:
                self._on_break(str(e))
            except Exception as e:
                # stage 0 already failed the step's requests; a later stage's failed step leaves the stages
                # after it without that step, so the pipeline re-forms (its requests fail, nothing is kept)
                log.exception("prefill %s stage %d: step failed", self.name, self.rank)
                if self.rank > 0:
                    why = f"prefill stage {self.rank} step failed: {type(e).__name__}: {e}"
                    self.group.break_(why)
                    self._on_break(why)

    def _on_formed(self) -> None:
        with self._lock:
            self.down_reason = None
        log.info("prefill %s stage %d: serving (epoch %s)", self.name, self.rank, self.group.epoch)

    def _on_break(self, reason: str) -> None:
        why = f"prefill {self.name}: pipeline broke ({reason})"
        with self._lock:
            if self.size > 1:
                self.down_reason = reason
            if self.rank == 0:
                sch = self.scheduler
                for req in list(sch.running) + list(sch.waiting):
                    sch.abort(req.request_id)
                    self._fail_job(req.request_id, why)
                # computed requests: every stage that computed its part still transfers and reports it (a
                # stage that did not tells decode itself; a dead one is noticed by decode). Their pages are
                # free now: nothing is scheduled again before the pipeline re-forms, and every stage drains
                # its transfers before it joins a new epoch.
                for rid in list(self._pending_release):
                    self._free(rid)
                self._drops.clear()
                if self.cache is not None:  # a restarted stage lost its KV: no cached page is valid anywhere
                    self.cache.clear()
                self._cache_sent = None  # the next epoch starts with the full set
                if self._recorder is not None:
                    self._recorder.drain()  # copies of the old epoch: nothing cached survives it
            else:
                self.mirror.set_cached(())
                for rid, job in list(self.jobs.items()):
                    if not job.transferring:
                        self.mirror.release(rid)
                        self.jobs.pop(rid, None)
                        self.notifier.post(job.decode, KV_FAILED, KvFailed(rid, why, self.name))
        log.warning("%s", why)

    def _fail_job(self, rid: str, why: str) -> None:
        job = self.jobs.pop(rid, None)
        if job is not None:
            self.counters["dropped"] += 1
            self.notifier.post(job.decode, KV_FAILED, KvFailed(rid, why, self.name))

    def _free(self, rid: str) -> None:
        """Stage 0: every stage is done with rid's pages."""
        self._pending_release.pop(rid, None)
        self.jobs.pop(rid, None)
        self.scheduler.release(rid)

    def _apply_control(self) -> None:
        now = time.monotonic()
        with self._lock:
            while self._control:
                op, rid, arg = self._control.popleft()
                if op == "released":
                    left = self._pending_release.get(rid)
                    if left is not None:
                        left.discard(int(arg))
                        if not left:
                            self._free(rid)
                elif op == "abort" and rid not in self._pending_release and rid in self.scheduler.requests:
                    self.scheduler.abort(rid)
                    self._drops.append(rid)
                    self._fail_job(rid, f"prefill {self.name}: {arg}")
            for rid, job in list(self.jobs.items()):
                if job.deadline <= now and rid in self.scheduler.requests:
                    self.scheduler.abort(rid)
                    self._drops.append(rid)
                    self._fail_job(
                        rid,
                        f"prefill {self.name}: request {rid} was not prefilled before its KV deadline "
                        f"({job.prompt_len} prompt tokens; queue or pipeline too slow)",
                    )

    def _stage0_iteration(self) -> None:
        self._apply_control()
        with self._lock:
            sched = self.scheduler.schedule()
            drops, self._drops = self._drops, []
            drops += [r.request_id for r in sched.preempted]
        if sched.is_empty:
            if self.size > 1 and (drops or time.monotonic() - self._last_send >= self.tick_s):
                self._send(StageMessage(self._step, to_wire(self._cache_meta(StepMsg(TICK, drop=drops)))))
            self._wake.wait(self.tick_s / 4 if self.size > 1 else 0.05)
            self._wake.clear()
            return
        try:
            self._run_step0(sched, drops)
        except StageLinkError:
            with self._lock:
                self._fail_sched(sched, "the pipeline broke during its step")
            raise
        except Exception as e:
            with self._lock:
                self._fail_sched(sched, f"prefill step failed: {type(e).__name__}: {e}")
            raise

    def _fail_sched(self, sched: SchedulerOutput, why: str) -> None:
        for req in self.scheduler.fail(sched, why):
            self._fail_job(req.request_id, f"prefill {self.name}: {why}")

    def _run_step0(self, sched: SchedulerOutput, drops: list[str]) -> None:
        self._step += 1
        chunks = sched.chunks
        batch = build_batch(chunks, self.page_size)
        seqs, new_jobs = [], {}
        with self._lock:
            for c in chunks:
                rid = c.request.request_id
                seqs.append(
                    StepRow(rid, c.start, c.num_tokens, list(c.request.page_ids), c.end == c.request.num_prompt_tokens)
                )
                if c.start == c.request.num_cached_tokens:  # its first chunk since admission
                    new_jobs[rid] = self.jobs[rid].spec()
            meta = self._cache_meta(StepMsg(STEP, seqs=seqs, jobs=new_jobs, batch=encode_batch(batch), drop=drops))
        carry = self.model.stage_forward(batch, self.pool)
        if self.size > 1:
            self._send(StageMessage(self._step, to_wire(meta), carry.hidden, carry.topk))
        firsts = self._sample(carry, seqs) if self.last else {}
        with self._lock:
            self.scheduler.update(sched, [0 if c.samples else None for c in chunks])
            self.counters["steps"] += 1
            for c in chunks:
                rid = c.request.request_id
                if c.end == c.request.num_prompt_tokens:
                    job = self.jobs[rid]
                    job.transferring = True
                    self._pending_release[rid] = set(range(self.size))
                    src = page_list(self.scheduler.pages_of(rid))[: pages_for(job.prompt_len, self.page_size)]
                    self._queue_xfer(_Xfer(job, src, firsts.get(rid)))

    def _cache_meta(self, msg: StepMsg) -> StepMsg:
        """Stage 0: `msg` with the host-tier copies to replay and, when the prefix cache's page set changed
        since the last message (always in the first message of an epoch), the set (packed int32 page ids)."""
        if self.cache is None or self.size == 1:
            return msg
        host_ops = cache = None
        with self._lock:
            if self._recorder is not None:
                host_ops = self._recorder.drain() or None
            now = tuple(self.cached_pages())
            if now != self._cache_sent:
                self._cache_sent = now
                cache = np.asarray(now, dtype=np.int32).tobytes()
        return replace(msg, host_ops=host_ops, cache=cache)

    def _send(self, msg: StageMessage) -> None:
        self.group.send_next(msg)
        self._last_send = time.monotonic()

    def _stagek_iteration(self) -> None:
        msg = self.group.recv_prev(timeout=self.cfg.stage_timeout)
        meta = from_wire(StepMsg, msg.meta, f"step {msg.step} from stage {self.rank - 1}")
        with self._lock:
            for rid in meta.drop:
                job = self.jobs.get(rid)
                if job is not None and not job.transferring:
                    self.jobs.pop(rid, None)
                    self.mirror.release(rid)
            if meta.host_ops is not None:
                if self.host_pool is None:
                    raise StageLinkError(
                        f"stage {self.rank}: stage 0 sent host-tier copies but this stage has no host tier: start "
                        "every stage with the same --hicache-* options"
                    )
                off, loaded = replay(meta.host_ops, self.host_pool, self.pool)
                self.replayed["offload_pages"] += off
                self.replayed["load_pages"] += loaded
            if meta.cache is not None:
                self.mirror.set_cached(np.frombuffer(meta.cache, dtype=np.int32).tolist())
        if meta.kind == TICK:
            if not self.last:
                self.group.send_next(msg)
            return
        seqs = meta.seqs
        with self._lock:
            for rid, d in meta.jobs.items():
                self.jobs[rid] = Job.of(d)
            for row in seqs:
                self.mirror.hold(row.rid, row.pages)
        if meta.batch is None:
            raise StageLinkError(f"stage {self.rank}: step {msg.step} arrived without its batch")
        batch = decode_batch(meta.batch)
        if msg.hidden is None:
            raise StageLinkError(f"stage {self.rank}: step {msg.step} arrived without hidden states")
        carry = self.model.stage_forward(batch, self.pool, StageCarry(hidden=msg.hidden, topk=msg.topk))
        if not self.last:
            self.group.send_next(StageMessage(msg.step, msg.meta, carry.hidden, carry.topk))
        firsts = self._sample(carry, seqs) if self.last else {}
        with self._lock:
            self.counters["steps"] += 1
            for row in seqs:
                if row.last:
                    job = self.jobs[row.rid]
                    job.transferring = True
                    src = row.pages[: pages_for(job.prompt_len, self.page_size)]
                    self._queue_xfer(_Xfer(job, src, firsts.get(row.rid)))

    def _sample(self, carry: StageCarry, seqs: list[StepRow]) -> dict[str, int]:
        """Last stage: the first generated token of every sequence whose prompt completed this step (token 0 of
        the request's seeded stream: the decode worker draws tokens 1.. from the same seed)."""
        assert carry.logits is not None
        rows, reqs = [], []
        with self._lock:
            for i, row in enumerate(seqs):
                if row.last:
                    job = self.jobs[row.rid]
                    rows.append(i)
                    reqs.append(Request(request_id=row.rid, prompt_ids=(0,), params=job.params, sampling_seed=job.seed))
        if not rows:
            return {}
        toks = sample(carry.logits[rows], reqs)
        return {req.request_id: int(tok) for req, tok in zip(reqs, toks, strict=True)}

    # ---- transfers -----------------------------------------------------------------------------------

    def _queue_xfer(self, x: _Xfer) -> None:
        with self._xfer_lock:
            self._xfer_busy += 1
        self._xfers.put(x)

    def _wait_transfers_drained(self) -> None:
        while not self._stop.is_set():
            with self._xfer_lock:
                if self._xfer_busy == 0:
                    return
            time.sleep(0.01)

    def _xfer_loop(self) -> None:
        while not self._stop.is_set():
            try:
                first = self._xfers.get(timeout=0.2)
            except queue.Empty:
                continue
            batch = [first]
            while True:
                try:
                    batch.append(self._xfers.get_nowait())
                except queue.Empty:
                    break
            if self.cfg.debug_transfer_delay > 0:  # testing: a window in which the transfers are in flight
                left = max(x.job.deadline for x in batch) - time.monotonic()
                time.sleep(max(0.0, min(self.cfg.debug_transfer_delay, left)))
            started: list[tuple[_Xfer, TransferHandle | None, str | None]] = []
            for x in batch:
                started.append(self._submit_xfer(x))
            for x, h, err in started:
                quarantine = 0.0
                nbytes = 0
                if h is not None:
                    try:
                        m = self.backend.wait(h)
                        nbytes = m.nbytes
                    except DsakvError as e:
                        err = f"transfer of prefill stage {self.rank}'s layers failed: {e}"
                        if isinstance(e, TransferTimeout) and h.job is not None:  # the engine had it: it may
                            quarantine = self.backend.quarantine_s  # still write the decode's pages a while
                self._report(x, err, quarantine, nbytes)

    def _submit_xfer(self, x: _Xfer) -> tuple[_Xfer, TransferHandle | None, str | None]:
        job = x.job
        left = job.deadline - time.monotonic()
        if left <= 0:
            return x, None, f"prefill stage {self.rank}: the KV deadline passed before the transfer started"
        try:
            link = self.links.get(job.decode, job.decode_boot, timeout=min(self.cfg.rpc_timeout, left))
            if link.boot != job.decode_boot:
                raise DsakvError(
                    f"decode {job.decode} restarted (boot {link.boot}, request was for boot {job.decode_boot}): "
                    "its pages are gone"
                )
            plan = TransferPlan.build(
                link.table, np.asarray(x.src_pages), np.asarray(job.dst_pages[: len(x.src_pages)])
            )
            return x, self.backend.submit(link.peer, plan.blocks, job.deadline), None
        except (DsakvError, ValueError) as e:
            return x, None, f"prefill stage {self.rank} could not start the transfer: {e}"

    def _report(self, x: _Xfer, err: str | None, quarantine: float, nbytes: int) -> None:
        job = x.job
        done = StageDone(job.rid, self.name, self.rank, err is None, err, quarantine, nbytes, x.first_token)
        try:
            c = self.notifier.client(job.decode)
            c.request(
                STAGE_DONE, done, timeout=max(0.5, min(self.cfg.rpc_timeout, job.deadline - time.monotonic() + 1))
            )
        except RpcError as e:
            log.warning(
                "prefill %s stage %d: could not report %s to decode %s: %s",
                self.name,
                self.rank,
                job.rid,
                job.decode,
                e,
            )
        with self._lock:
            self.counters["transferred" if err is None else "transfer_failed"] += 1
            if self.rank == 0:
                self._control.append(("released", job.rid, "0"))
            else:
                self.jobs.pop(job.rid, None)
                self.mirror.release(job.rid)
                stage0 = self.group.peer_info.get(0, {}).get("rpc")
                if stage0:
                    self.notifier.post(str(stage0), RELEASED, Released(job.rid, self.rank))
        with self._xfer_lock:
            self._xfer_busy -= 1
        self._wake.set()
