"""Pipeline stages k >= 1 of a DeepSeek-V4 prefill worker: each a spawned child process with the pool of its
layers (each kind only where read) and its own transfer engine.

    leader (stage 0: V4Engine over layers [0, e0), the control plane)
      compute pipe:  ("forward", (rows, streams)) ─► stage k: its layers on its pool ─► streams    (in step order)
      transfer pipe: ("send", (decode manifest, pages, dst pages, slot, dst slot, seconds)) ─► stage k: v4_blocks
                     of its paired keys over its own engine into the decode ─► bytes, blocks, the pair's figure
      compute pipe:  ("digests", (pages, slot)) ─► blake2b of each of its keys' bytes (what a receiver compares)

A stage uses the page and slot ids stage 0's engine chose (every stage pool has the same page and slot count), so
it keeps no allocator. The two pipes are served by two threads of the child: a transfer (parked pages) never
waits behind a step's compute (running pages), nor the other way round. A child dies with its leader
(arm_parent_death); the leader's `close` stops each. Imports torch, dsakv.model, dsakv.cache and
dsakv.disagg.transfer; never serve or cli.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import torch

from dsakv.cache.v4_pool import V4Pool
from dsakv.disagg.transfer.backends.base import Peer, deadline_in
from dsakv.disagg.transfer.backends.registry import make_backend
from dsakv.disagg.transfer.v4 import V4Manifest, check_v4_pair, connect_v4, pair_figure, v4_blocks
from dsakv.model.deepseek_v4 import DeepseekV4, V4Row
from dsakv.util.child import ChildProcess, answer
from dsakv.util.procs import arm_parent_death


@dataclass(frozen=True)
class V4StageSpec:
    checkpoint: str
    index: int
    start: int
    end: int
    num_pages: int
    max_running: int
    page_size: int
    backend: str
    backend_options: dict[str, Any] = field(default_factory=dict)
    worker: str = ""
    threads: int = 1


def _transfer_loop(conn: Connection, backend: Any, manifest: V4Manifest, layout: Any) -> None:
    peers: dict[bytes, tuple[Peer, Any]] = {}

    def send(args: tuple[Any, ...]) -> tuple[int, int, int]:
        data, src, dst, slot, dst_slot, seconds = args
        if data not in peers:
            theirs = V4Manifest.from_bytes(data)
            peers[data] = (connect_v4(backend, theirs), (theirs, check_v4_pair(layout, theirs)))
        peer, (theirs, pairs) = peers[data]
        plan = v4_blocks(pairs, manifest, theirs, np.asarray(src), np.asarray(dst), slot, dst_slot)
        metrics = backend.transfer(peer, plan.blocks, deadline_in(seconds))
        return int(metrics.nbytes), len(plan.blocks), pair_figure(pairs, int(len(src)))

    answer(conn, {"send": send})


def _stage_main(conn: Connection, xconn: Connection, spec: V4StageSpec, parent: int) -> None:
    arm_parent_death(parent, signal.SIGKILL)
    from dsakv.model.deepseek_v4 import load_v4

    torch.set_num_threads(spec.threads)
    try:
        model = load_v4(spec.checkpoint)
        pool = V4Pool(model.stage_layout(spec.start, spec.end, spec.page_size), spec.num_pages, spec.max_running)
        backend = make_backend(spec.backend, **spec.backend_options) if spec.backend else None
        if backend is not None:  # a PD prefill's stage; a colocated pipeline's (generate) sends nothing
            backend.register(pool.regions())
            manifest = V4Manifest.from_pool(pool, backend.meta(), spec.worker)
        conn.send(("ok", (manifest.to_bytes(), backend.quarantine_s) if backend is not None else (b"", 0.0)))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    if backend is not None:
        threading.Thread(
            target=_transfer_loop, args=(xconn, backend, manifest, pool.layout), name="v4-stage-xfer", daemon=True
        ).start()

    def forward(args: tuple[list[V4Row], torch.Tensor]) -> torch.Tensor:
        rows, h = args
        return model.forward_layers(rows, pool, h, spec.start, spec.end)

    def digests(args: tuple[Sequence[int], int]) -> dict[str, str]:  # what a transfer's receiver compares
        return pool.digests(*args)

    answer(conn, {"forward": forward, "digests": digests}, backend.close if backend is not None else None)
    os._exit(0)  # the transfer engine's threads must not outlive the stage, nor its teardown abort it


class V4StageChild(ChildProcess):
    """Stage `spec.index` (layers [start, end)) in a spawned child; `xfer` is its transfer pipe."""

    call_timeout = 300.0

    def __init__(self, spec: V4StageSpec, start_timeout: float = 180.0) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.xconn, xchild = ctx.Pipe()
        self.spec = spec
        self.label = f"V4 prefill stage {spec.index}"
        self.proc = ctx.Process(
            target=_stage_main, args=(child, xchild, spec, os.getpid()), name=f"dsakv-v4-pp{spec.index}", daemon=True
        )
        self.proc.start()
        child.close()
        xchild.close()
        self._xlock = threading.Lock()
        data, self.quarantine_s = self._reply(start_timeout, "start")
        self.manifest_bytes: bytes = data  # b"": no transfer backend (a colocated pipeline)
        self.manifest = V4Manifest.from_bytes(data) if data else None

    def send(self, args: tuple[Any, ...], timeout: float) -> tuple[int, int, int]:
        """("send", args) on the transfer pipe: (bytes moved, blocks, the pair's layout figure)."""
        with self._xlock:
            self.xconn.send(("send", args))
            if not self.xconn.poll(timeout):
                raise TimeoutError(f"{self.label}: its transfer did not answer within {timeout:g}s")
            status, value = self.xconn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.label}: {value}")
        return tuple(value)  # type: ignore[return-value]


def start_stages(
    checkpoint: str,
    ranges: Sequence[tuple[int, int]],
    num_pages: int,
    max_running: int,
    page_size: int,
    backend: str = "",
    backend_options: dict[str, Any] | None = None,
    worker: str = "v4",
    threads: int = 1,
) -> list[V4StageChild]:
    """Stages 1.. of `ranges` as children (stage 0 is the caller's); each one's pool of its layers, and with
    `backend` its own transfer engine. A failed start stops the ones started."""
    out: list[V4StageChild] = []
    try:
        for k, (a, b) in enumerate(ranges[1:], start=1):
            spec = V4StageSpec(
                checkpoint, k, a, b, num_pages, max_running, page_size, backend, dict(backend_options or {}),
                f"{worker}-pp{k}", threads,
            )  # fmt: skip
            out.append(V4StageChild(spec))
    except Exception:
        for c in out:
            c.stop()
        raise
    return out


def stage_forward(
    model: DeepseekV4, ranges: Sequence[tuple[int, int]], children: Sequence[V4StageChild], pool: V4Pool,
    rows: list[V4Row],
) -> torch.Tensor:  # fmt: skip
    """A step's rows through every stage: embed and stage 0's layers on `pool` here, each child's layers there
    (the hidden streams over its compute pipe, in order), the head here: the logits of each row's last token."""
    a, b = ranges[0]
    h = model.forward_layers(rows, pool, model.embed(rows), a, b)
    for child in children:
        h = child.call("forward", (rows, h))
    return model.head(rows, h)
