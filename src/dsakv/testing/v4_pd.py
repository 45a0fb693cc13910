"""DeepSeek-V4 PD over the real transfer engines: pipelined prefill stages here, a decode V4Engine in a child.

    this process (prefill, PP n)                     child process (decode), multiprocessing "spawn"
    ────────────────────────────                     ───────────────────────────────────────────────
    V4PrefillStages(model, [(0, k), (k, L)])         load_v4(ckpt); V4Engine; backend.register(pool.regions())
      stage i: V4Pool of layers [a, b) (each kind      ◄── pipe ── V4Manifest bytes (every paged kind and state
      only where read), its own backend engine                    key as a keyed region)
    hello: stage manifests ──────────────────────► check_v4_pair(decode layout, stage i) for each i; every
                                                    decode key covered by some stage, else refused
    check_v4_pair(stage i, decode manifest)          (either side refuses another page size / format naming
    prefill(prompt): every chunk runs stage 0's       the kind)
      layers, hands the hidden streams to stage 1, ...
    accept(prompt, first token) ─────────────────► V4Engine.accept_request: pages + slot ◄── ids
    stage i: v4_blocks(pairs_i, ...) over its backend ══ pages of its paired kinds + its state slot ══►
    start(rid) ──────────────────────────────────► decode to the end ◄── tokens

V4PrefillStages passes the hidden streams between the stages in this process (the KV of each stage travels over
its own transfer engine connection, as a stage process's would); V4PrefillProcesses runs every stage as the serve
role's stage child (disagg/prefill/v4_stages.V4StageChild: its pool, its engine, compute and transfer pipes).
Imports torch, numpy, engine, model and disagg; for tests and benchmarks.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from dsakv.cache.allocator import PageAllocator
from dsakv.cache.v4_pool import SlotAllocator, V4Pool
from dsakv.disagg.prefill.v4_stages import V4StageChild, V4StageSpec
from dsakv.disagg.protocol.errors import IncompatiblePeer
from dsakv.disagg.transfer.backends.base import TransferBackend, deadline_in
from dsakv.disagg.transfer.backends.registry import make_backend
from dsakv.disagg.transfer.v4 import V4Manifest, check_v4_pair, connect_v4, pair_figure, v4_blocks
from dsakv.model.deepseek_v4 import DeepseekV4, V4Row
from dsakv.spec.layout import BufferKey
from dsakv.spec.v4_layout import V4Layout, V4Pair
from dsakv.util import ceil_div
from dsakv.util.child import ChildProcess, answer
from dsakv.util.procs import arm_parent_death

# ---- decode: a V4Engine in a child process ---------------------------------------------------------------


@dataclass(frozen=True)
class V4DecodeSpec:
    checkpoint: str
    num_pages: int
    max_running: int
    page_size: int | None
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    worker: str = "v4-decode"


def _decode_main(conn: Connection, spec: V4DecodeSpec, parent: int) -> None:
    arm_parent_death(parent, signal.SIGKILL)
    for k, v in spec.env.items():
        os.environ[k] = v
    from dsakv.engine.v4_engine import V4Engine
    from dsakv.model.deepseek_v4 import load_v4

    torch.set_num_threads(1)
    try:
        eng = V4Engine(load_v4(spec.checkpoint), spec.num_pages, spec.max_running, spec.page_size)
        backend = make_backend(spec.backend, **spec.backend_options)
        backend.register(eng.pool.regions())
        manifest = V4Manifest.from_pool(eng.pool, backend.meta(), spec.worker)
        conn.send(("ok", manifest.to_bytes()))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return

    def hello(manifests: list[bytes]) -> int:  # the decode's side: every key it holds comes from some stage
        covered: set[BufferKey] = set()
        for data in manifests:
            covered |= {p.key for p in check_v4_pair(eng.layout, V4Manifest.from_bytes(data))}
        missing = sorted(set(eng.layout.keys) - covered)
        if missing:
            raise IncompatiblePeer(
                f"no prefill stage holds {missing[0]} ({len(missing)} decode keys uncovered): the stages "
                "must cover every layer the decode holds"
            )
        return len(covered)

    def accept(args: tuple[Any, ...]) -> tuple[int, list[int], int]:
        req = eng.accept_request(*args)
        return req.rid, req.page_ids.tolist(), req.slot

    def digests(args: tuple[int, int]) -> dict[str, str]:
        rid, n_pages = args
        req = eng.parked[rid]
        return eng.pool.digests(req.page_ids[:n_pages], req.slot)

    def start(rid: int) -> list[int]:
        eng.start_request(rid)
        while rid not in eng.finished:
            eng.step()
        return list(eng.finished.pop(rid).output)

    def pages_free(_: None) -> tuple[int, int]:
        return eng.pages.num_free, eng.slots.num_free

    handlers: dict[str, Callable[[Any], Any]] = {
        "hello": hello,
        "accept": accept,
        "digests": digests,
        "start": start,
        "pages_free": pages_free,
    }
    answer(conn, handlers, backend.close)


class V4DecodePeer(ChildProcess):
    """A decode V4Engine in a spawned child, registered with a real transfer backend."""

    label = "V4 decode"
    call_timeout = 300.0

    def __init__(self, spec: V4DecodeSpec, start_timeout: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_decode_main, args=(child, spec, os.getpid()), name="dsakv-v4-decode", daemon=True
        )
        self.proc.start()
        child.close()
        self.manifest_bytes: bytes = self._reply(start_timeout, "start")
        self.manifest = V4Manifest.from_bytes(self.manifest_bytes)


# ---- prefill: pipeline stages in this process, one pool and one transfer engine each ------------------------


@dataclass
class _Stage:
    start: int
    end: int
    pool: V4Pool
    pages: PageAllocator
    slots: SlotAllocator
    backend: TransferBackend
    manifest: V4Manifest

    @property
    def layout(self) -> V4Layout:
        return self.pool.layout


@dataclass
class PrefilledV4:
    """A prefilled request: its first token and, per stage, its pages and slot."""

    prompt: list[int]
    first_token: int
    page_ids: list[np.ndarray]
    slots: list[int]

    @property
    def num_pages(self) -> int:
        return int(self.page_ids[0].size)


class V4PrefillStages:
    """Prefill of a V4 model split into layer ranges (PP), each stage on its own V4Pool and backend engine."""

    def __init__(
        self,
        model: DeepseekV4,
        splits: Sequence[tuple[int, int]],
        num_pages: int,
        max_running: int,
        backend: str,
        backend_options: dict[str, Any] | None = None,
        page_size: int | None = None,
        chunk_size: int = 16,
    ) -> None:
        self.model = model
        self.chunk_size = chunk_size
        ends = [s for s, _ in splits[1:]] + [model.spec.num_layers]
        if not splits or splits[0][0] != 0 or any(e != ne for (_, e), ne in zip(splits, ends, strict=True)):
            raise ValueError(f"PP splits {list(splits)} must cover layers 0..{model.spec.num_layers - 1} in order")
        self.stages: list[_Stage] = []
        for i, (a, b) in enumerate(splits):
            pool = V4Pool(model.stage_layout(a, b, page_size), num_pages, max_running, model.device)
            be = make_backend(backend, **(backend_options or {}))
            be.register(pool.regions())
            m = V4Manifest.from_pool(pool, be.meta(), f"v4-prefill-pp{i}")
            self.stages.append(
                _Stage(a, b, pool, PageAllocator(num_pages, f"V4 stage {i}"), SlotAllocator(max_running), be, m)
            )

    @property
    def page_size(self) -> int:
        return self.stages[0].layout.page

    def manifests(self) -> list[bytes]:
        return [s.manifest.to_bytes() for s in self.stages]

    def handshake(self, decode: V4Manifest) -> list[tuple[V4Pair, ...]]:
        """This side's check of the decode's manifest: the pairs of each stage (IncompatiblePeer if refused)."""
        return [check_v4_pair(s.layout, decode) for s in self.stages]

    def prefill(self, prompt: list[int], owner: int) -> PrefilledV4:
        n = ceil_div(len(prompt), self.page_size)
        ids = [s.pages.alloc(n, owner=owner) for s in self.stages]
        slots = [s.slots.alloc() for s in self.stages]
        logits = None
        for start in range(0, len(prompt), self.chunk_size):
            chunk = prompt[start : start + self.chunk_size]
            h = self.model.embed([V4Row(slots[0], ids[0], start, chunk)])
            for st, pid, slot in zip(self.stages, ids, slots, strict=True):
                rows = [V4Row(slot, pid, start, chunk)]
                h = self.model.forward_layers(rows, st.pool, h, st.start, st.end)
            logits = self.model.head([V4Row(slots[-1], ids[-1], start, chunk)], h)
        assert logits is not None
        return PrefilledV4(list(prompt), int(logits[0].argmax()), ids, slots)

    def send(
        self, req: PrefilledV4, decode: V4Manifest, dst_pages: Sequence[int], dst_slot: int, timeout_s: float = 120.0
    ) -> list[dict[str, Any]]:
        """Each stage ships its paired keys of `req` to the decode's pages and slot over its own engine; per stage:
        bytes moved, blocks, the layout figure of the pair and the bytes per kind."""
        out = []
        dst = np.asarray(dst_pages, dtype=np.int64)[: req.num_pages]
        for st, pid, slot in zip(self.stages, req.page_ids, req.slots, strict=True):
            pairs = check_v4_pair(st.layout, decode)
            peer = connect_v4(st.backend, decode)
            plan = v4_blocks(pairs, st.manifest, decode, pid, dst, slot, dst_slot)
            metrics = st.backend.transfer(peer, plan.blocks, deadline_in(timeout_s))
            out.append(
                {
                    "stage": f"{st.start}-{st.end - 1}",
                    "bytes": int(metrics.nbytes),
                    "blocks": len(plan.blocks),
                    "figure": pair_figure(pairs, req.num_pages),
                    "by_kind": {k.value: v for k, v in plan.by_kind.items()},
                }
            )
        return out

    def digests(self, req: PrefilledV4) -> dict[str, str]:
        out: dict[str, str] = {}
        for st, pid, slot in zip(self.stages, req.page_ids, req.slots, strict=True):
            out.update(st.pool.digests(pid, slot))
        return out

    def release(self, req: PrefilledV4, owner: int) -> None:
        for st, slot in zip(self.stages, req.slots, strict=True):
            st.pages.release(owner)
            st.slots.free(slot)

    def close(self) -> None:
        for st in self.stages:
            st.backend.close()


# ---- prefill stages as processes: each stage a spawned child with its pool and engine -------------------------


class V4PrefillProcesses:
    """A PP prefill whose every stage is its own process (disagg/prefill/v4_stages.V4StageChild, as the serve
    role's stages 1..); this process embeds, hands the hidden streams from stage to stage over the compute pipes,
    samples the first token and allocates the pages and slot every stage uses (the leader)."""

    def __init__(
        self,
        model: DeepseekV4,
        checkpoint: str,
        splits: Sequence[tuple[int, int]],
        num_pages: int,
        max_running: int,
        backend: str,
        backend_options: dict[str, Any] | None = None,
        chunk_size: int = 16,
    ) -> None:
        self.model = model
        self.chunk_size = chunk_size
        self.page_size = model.stage_layout(*splits[0]).page
        self.layouts = [model.stage_layout(a, b, self.page_size) for a, b in splits]
        self.pages, self.slots = PageAllocator(num_pages, "V4 prefill stages"), SlotAllocator(max_running)
        self.stages: list[V4StageChild] = []
        try:
            for i, (a, b) in enumerate(splits):
                spec = V4StageSpec(
                    checkpoint, i, a, b, num_pages, max_running, self.page_size, backend, dict(backend_options or {}),
                    f"v4-prefill-pp{i}",
                )  # fmt: skip
                self.stages.append(V4StageChild(spec))
        except Exception:
            self.close()
            raise

    def manifests(self) -> list[bytes]:
        return [s.manifest_bytes for s in self.stages]

    def handshake(self, decode: V4DecodePeer) -> list[tuple[V4Pair, ...]]:
        return [check_v4_pair(lay, decode.manifest) for lay in self.layouts]

    def prefill(self, prompt: list[int], owner: int) -> PrefilledV4:
        ids = self.pages.alloc(ceil_div(len(prompt), self.page_size), owner=owner)
        slot = self.slots.alloc()
        logits = None
        for start in range(0, len(prompt), self.chunk_size):
            rows = [V4Row(slot, ids, start, prompt[start : start + self.chunk_size])]
            h = self.model.embed(rows)
            for st in self.stages:
                h = st.call("forward", (rows, h))
            logits = self.model.head(rows, h)
        assert logits is not None
        return PrefilledV4(list(prompt), int(logits[0].argmax()), [ids] * len(self.stages), [slot] * len(self.stages))

    def send(
        self, req: PrefilledV4, decode: V4DecodePeer, dst_pages: Sequence[int], dst_slot: int, timeout_s: float = 120.0
    ) -> list[dict[str, Any]]:
        dst = np.asarray(dst_pages, dtype=np.int64)[: req.num_pages]
        out = []
        for st, pid, slot in zip(self.stages, req.page_ids, req.slots, strict=True):
            nbytes, blocks, figure = st.send((decode.manifest_bytes, pid, dst, slot, dst_slot, timeout_s), timeout_s)
            out.append(
                {"stage": f"{st.spec.start}-{st.spec.end - 1}", "bytes": nbytes, "blocks": blocks, "figure": figure}
            )
        return out

    def digests(self, req: PrefilledV4) -> dict[str, str]:
        out: dict[str, str] = {}
        for st, pid, slot in zip(self.stages, req.page_ids, req.slots, strict=True):
            out.update(st.call("digests", (pid.tolist(), slot)))
        return out

    def release(self, req: PrefilledV4, owner: int) -> None:
        self.pages.release(owner)
        self.slots.free(req.slots[0])

    def free(self) -> tuple[int, int]:
        return self.pages.num_free, self.slots.num_free

    def close(self) -> None:
        for st in self.stages:
            st.stop()
