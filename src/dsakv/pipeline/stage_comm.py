"""StageGroup: the stages of a pipeline (prefill, decode, colocated) as a gloo group, every send and receive bounded.

Stage k sends stage k+1 one message per step (torch.distributed point-to-point, gloo on CPU):

    header  int64[6]   MAGIC | step | meta bytes | tokens T | hidden bytes per token | top-k width K
    meta    uint8      msgpack: pipeline.step.PipeStep (ForwardBatch fields, page holds, drops, the role payload)
    hidden  uint8      [T, hidden bytes per token]  the residual stream, raw bytes of the model dtype
    topk    int64      [T, K]                       the last producer's top-k (-1 padded), if any

A gloo send completes only once the receiver has posted the matching receive, so a
stage never runs more than one step ahead of the next (backpressure for free).
Every wait has a bound (`timeout_s`): a timed-out or failed send/receive closes the
pair for good in gloo, so the group is then *broken* and must be re-formed as a new
*epoch*: stage 0 hosts a TCPStore and publishes the epoch name; every stage (a
restarted one included) joins the newest epoch it has not joined yet. Stage 0 sends
ticks while idle so an idle stage's receive never times out.

Imports torch.distributed, msgpack and dsakv.disagg.protocol.errors only.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from dsakv.errors import DsakvError

log = logging.getLogger(__name__)

MAGIC = 0x44534B56  # "DSKV"
CLOSED = "-"  # the epoch key while stage 0 has no group
_HDR = 6


class StageLinkError(DsakvError):
    """A pipeline stage did not answer in time or went away: the group is broken and re-forms."""


@dataclass
class StageMessage:
    """What travels from one stage to the next for one step (hidden/topk None on a tick)."""

    step: int
    meta: dict[str, Any]
    hidden: torch.Tensor | None = None  # [T, H], any dtype (sent as raw bytes)
    topk: torch.Tensor | None = None  # int64 [T, K]


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=max(0.01, seconds))


WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")


def _listen_socket(host: str, port: int) -> socket.socket | None:
    """A listening socket on host:port for the TCPStore server (torch binds every interface otherwise); None
    for a wildcard host."""
    if host in WILDCARD_HOSTS:
        return None
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    deadline = time.monotonic() + 5.0  # a previous stage 0 on this port may still be going away
    while True:
        s = socket.socket(info[0], socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(info[4])
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE or time.monotonic() > deadline:
                raise OSError(
                    e.errno,
                    f"stage 0: the rendezvous port {host}:{port} is in use ({e.strerror}): "
                    "free it or pick another --dist-port / --port",
                ) from None
            time.sleep(0.1)
            continue
        s.listen(512)
        return s


def _server_store(host: str, port: int, size: int, timeout_s: float) -> dist.TCPStore:
    """Stage 0's rendezvous TCPStore server, listening on `host` only (a wildcard host: every interface).

    The server takes ownership of the listening fd it is given and closes it when it goes, so it is handed a
    duplicate and our socket object is closed here: passing `sock.fileno()` and keeping `sock` closed the same fd
    number twice (the store, then the socket's finaliser), and the second close hit whatever fd had reused the
    number by then (another test's HTTP socket in the same process: EBADF; an epoll fd: libuv abort())."""
    listen = _listen_socket(host, port)
    fd = None if listen is None else os.dup(listen.fileno())
    try:
        return dist.TCPStore(
            host, port, size, True, timeout=_td(timeout_s), wait_for_workers=False, master_listen_fd=fd
        )
    finally:  # on a failure the dup may or may not have been taken: it is left alone (never closed twice)
        if listen is not None:
            listen.close()


def _gloo_options(host: str, timeout_s: float) -> Any:
    """Gloo options whose device listens on `host` (by default gloo binds whatever the machine's hostname
    resolves to)."""
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._timeout = _td(timeout_s)
    dev = (
        dist.ProcessGroupGloo.create_default_device()
        if host in WILDCARD_HOSTS
        else dist.ProcessGroupGloo.create_device(hostname=host)
    )
    opts._devices = [dev]
    return opts


class StageGroup:
    """One stage's membership in the PP group. Not thread-safe: one thread (the stage loop) uses it."""

    def __init__(
        self,
        rank: int,
        size: int,
        store_host: str,
        store_port: int,
        timeout_s: float = 10.0,
        hidden_dtype: torch.dtype = torch.float32,
        hidden_size: int = 0,
        bind_host: str | None = None,
    ) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"stage rank {rank} is outside 0..{size - 1}")
        self.rank = rank
        self.size = size
        self.store_host = store_host
        self.store_port = store_port
        self.timeout_s = float(timeout_s)
        self.hidden_dtype = hidden_dtype
        self.hidden_size = hidden_size
        self.boot = uuid.uuid4().hex[:8]
        self._epochs = 0
        self._store: dist.TCPStore | None = None
        self._pg: Any = None
        self.epoch: str | None = None  # the epoch name of the current group (None: not formed)
        self._last_joined: str | None = None
        self.peer_info: dict[int, dict[str, Any]] = {}  # rank -> what it published at formation
        # the rendezvous and the gloo pairs listen on this stage's host only (a wildcard host: all interfaces)
        self.bind_host = bind_host or store_host
        if size > 1 and rank == 0:
            self._store = _server_store(store_host, store_port, size, self.timeout_s)

    # ---- formation -----------------------------------------------------------------------------

    @property
    def formed(self) -> bool:
        return self.size == 1 or self._pg is not None

    def _client_store(self) -> dist.TCPStore:
        if self._store is None:
            self._store = dist.TCPStore(
                self.store_host, self.store_port, self.size, False, timeout=_td(min(2.0, self.timeout_s))
            )
        return self._store

    def form(self, info: dict[str, Any]) -> bool:
        """Try to form (rank 0) or join (rank k) the next epoch, publishing `info` (e.g. this stage's RPC
        address). Blocks at most about `timeout_s`; True when the group is formed."""
        if self.size == 1:
            self.peer_info = {0: info}
            self.epoch = "single"
            return True
        self.close()
        try:
            if self.rank == 0:
                store = self._store
                assert store is not None
                self._epochs += 1
                name = f"{self.boot}-{self._epochs}"
                store.set("epoch", name)
            else:
                store = self._client_store()
                if not store.check(["epoch"]):  # stage 0 is up but has not formed yet (still loading): poll on the
                    time.sleep(0.1)  # same client, not a new client per blocking get that times out
                    return False
                name = store.get("epoch").decode()
                if name in (CLOSED, self._last_joined):
                    time.sleep(0.05)
                    return False
            self._last_joined = name
            prefix = dist.PrefixStore(f"pp/{name}", store)
            prefix.set(f"info/{self.rank}", msgpack.packb(info, use_bin_type=True))
            pg = dist.ProcessGroupGloo(prefix, self.rank, self.size, _gloo_options(self.bind_host, self.timeout_s))
            self.peer_info = {
                r: msgpack.unpackb(prefix.get(f"info/{r}"), raw=False, strict_map_key=False) for r in range(self.size)
            }
        except Exception as e:  # store unreachable, a stage missing within the timeout, ...
            log.info("stage %d: pipeline not formed yet (%s)", self.rank, str(e).splitlines()[0][:200])
            if self.rank != 0:
                self._drop_store()
            return False
        self._pg = pg
        self.epoch = name
        log.info("stage %d/%d: pipeline formed (epoch %s)", self.rank, self.size, name)
        return True

    def _drop_store(self) -> None:
        self._store = None

    def close(self) -> None:
        """Leave the current epoch (peers see their pair closed)."""
        pg, self._pg = self._pg, None
        self.epoch = None if self.size > 1 else self.epoch
        if pg is not None:
            try:
                pg.abort()
            except Exception:  # older torch: dropping the last reference closes the pairs
                pass
            del pg

    def break_(self, why: str) -> None:
        if self._pg is not None:
            log.warning("stage %d: pipeline broken: %s", self.rank, why)
        self.close()
        if self.rank == 0 and self._store is not None:
            try:  # a stage (re)starting now must wait for the next epoch, not join the broken one
                self._store.set("epoch", CLOSED)
            except Exception as e:  # the store is this process's own server: only a shutdown gets here
                log.debug("stage 0: could not close the epoch: %s", e)
        if self.rank != 0:
            self._drop_store()

    # ---- a stage that cannot rejoin (a TP rank of it died) tells stage 0 why, through the rendezvous store ----

    def note_down(self, why: str) -> None:
        """Stage k: leave `why` in stage 0's store (best effort: stage 0 names it while the pipeline cannot form)."""
        try:
            (self._store or self._client_store()).set(f"down/{self.rank}", why)
        except Exception as e:  # noqa: BLE001 (stage 0 gone: nobody to tell)
            log.debug("stage %d: could not note why it is down: %s", self.rank, e)

    def noted_down(self) -> str | None:
        """Stage 0: 'stage k: why' for the first later stage that noted it is down, else None."""
        if self._store is None or self.rank != 0:
            return None
        for k in range(1, self.size):
            try:
                if self._store.check([f"down/{k}"]):
                    return f"stage {k}: {self._store.get(f'down/{k}').decode()}"
            except Exception:  # noqa: BLE001 (a store that cannot answer: nothing noted)
                return None
        return None

    def clear_down(self) -> None:
        """Stage 0, once every stage joined: no stage is down any more."""
        if self.rank != 0:
            return
        for k in range(1, self.size):
            try:
                if self._store is not None:
                    self._store.delete_key(f"down/{k}")
            except Exception:  # noqa: BLE001
                pass

    # ---- point to point --------------------------------------------------------------------------

    def _wait(self, work: Any, timeout: float, what: str) -> None:
        try:
            work.wait(_td(timeout))
        except Exception as e:
            msg = f"stage {self.rank}: {what} failed: {str(e).splitlines()[0][:300]}"
            self.break_(msg)
            raise StageLinkError(msg) from None

    def _send(self, t: torch.Tensor, dst: int, timeout: float, what: str) -> None:
        self._p2p("send", t.contiguous(), dst, timeout, what)

    def _recv(self, t: torch.Tensor, src: int, timeout: float, what: str) -> None:
        self._p2p("recv", t, src, timeout, what)

    def _p2p(self, op: str, t: torch.Tensor, peer: int, timeout: float, what: str) -> None:
        """One gloo send/recv of `t` with stage `peer`, bounded by `timeout`; a failure breaks the pipeline."""
        if self._pg is None:
            raise StageLinkError(f"stage {self.rank}: no pipeline group (not formed) for {what}")
        try:
            work = getattr(self._pg, op)([t], peer, 0)
        except Exception as e:
            msg = f"stage {self.rank}: {what} failed: {str(e).splitlines()[0][:300]}"
            self.break_(msg)
            raise StageLinkError(msg) from None
        self._wait(work, timeout, what)

    def send_next(self, msg: StageMessage) -> None:
        """Send one step to stage rank+1 (each piece bounded by timeout_s)."""
        self.send_to(self.rank + 1, msg)

    def send_to(self, dst: int, msg: StageMessage) -> None:
        """Send one step to stage `dst` (a decode pipeline's last stage returns the logits to stage 0)."""
        meta = msgpack.packb(msg.meta, use_bin_type=True)
        t = 0 if msg.hidden is None else int(msg.hidden.shape[0])
        hidden_bytes = b"" if msg.hidden is None else msg.hidden.contiguous().view(torch.uint8).reshape(t, -1)
        row = 0 if msg.hidden is None else int(hidden_bytes.shape[1])  # type: ignore[union-attr]
        k = 0 if msg.topk is None else int(msg.topk.shape[1])
        hdr = torch.tensor([MAGIC, msg.step, len(meta), t, row, k], dtype=torch.int64)
        what = f"sending step {msg.step} to stage {dst}"
        self._send(hdr, dst, self.timeout_s, what)
        self._send(torch.frombuffer(bytearray(meta), dtype=torch.uint8), dst, self.timeout_s, what)
        if t and row:
            assert isinstance(hidden_bytes, torch.Tensor)
            self._send(hidden_bytes, dst, self.timeout_s, what)
        if t and k:
            assert msg.topk is not None
            self._send(msg.topk.to(torch.int64).cpu(), dst, self.timeout_s, what)

    def recv_prev(self, timeout: float | None = None) -> StageMessage:
        """Receive one step from stage rank-1, waiting at most `timeout` (default timeout_s) for it to start."""
        return self.recv_from(self.rank - 1, timeout)

    def recv_from(self, src: int, timeout: float | None = None, dtype: torch.dtype | None = None) -> StageMessage:
        """Receive one step from stage `src`; its hidden bytes are read as `dtype` (default the hidden dtype)."""
        what = f"receiving from stage {src}"
        hdr = torch.zeros(_HDR, dtype=torch.int64)
        self._recv(hdr, src, self.timeout_s if timeout is None else timeout, what)
        magic, step, nmeta, t, row, k = (int(v) for v in hdr.tolist())
        if magic != MAGIC:
            msg = f"stage {self.rank}: bad message header from stage {src} (magic {magic:#x})"
            self.break_(msg)
            raise StageLinkError(msg)
        meta_t = torch.zeros(nmeta, dtype=torch.uint8)
        self._recv(meta_t, src, self.timeout_s, what)
        meta = msgpack.unpackb(meta_t.numpy().tobytes(), raw=False, strict_map_key=False)
        hidden = topk = None
        if t and row:
            raw = torch.zeros((t, row), dtype=torch.uint8)
            self._recv(raw, src, self.timeout_s, what)
            hidden = raw.view(dtype or self.hidden_dtype)
        if t and k:
            topk = torch.zeros((t, k), dtype=torch.int64)
            self._recv(topk, src, self.timeout_s, what)
        return StageMessage(step, meta, hidden, topk)


def stage_ports(base_port: int, size: int) -> list[int]:
    """RPC port of each stage: base, base + 1, ..."""
    return [base_port + k for k in range(size)]


def default_dist_port(base_port: int, size: int) -> int:
    return base_port + size


def stage_group(
    rank: int,
    size: int,
    *,
    host: str,
    port: int,
    stage0_host: str | None,
    dist_port: int | None,
    timeout_s: float,
    hidden_dtype: torch.dtype,
    hidden_size: int,
    cls: type[StageGroup] = StageGroup,
) -> StageGroup:
    """The StageGroup of stage `rank` of a worker at `host`:`port` (stage k on port + k): the rendezvous on
    stage 0's host (default: this host) at dist_port (default port + size); this stage's gloo pairs on `host`
    (`cls`: a TP prefill stage's relaying group, disagg/prefill/grid.py)."""
    return cls(
        rank,
        size,
        stage0_host or host,
        dist_port or default_dist_port(port, size),
        timeout_s,
        hidden_dtype=hidden_dtype,
        hidden_size=hidden_size,
        bind_host=host,
    )


def pid() -> int:
    return os.getpid()
