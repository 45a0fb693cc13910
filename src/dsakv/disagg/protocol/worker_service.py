"""What every disaggregated worker process is around its role: an RPC service, liveness, health, integrity,
threads and their lifetime; and the fire-and-forget notices it sends other workers.

    service = WorkerService(DECODE_SERVICE, {PREALLOC: ..., ...}, host, port, "decode",
                            health=worker.health, integrity=worker.integrity)
    service.start([(loop, "decode-step"), ...]); service.serve_forever(); service.stop(join_timeout)

PING, HEALTH and CHECK_INTEGRITY are served here for every role (ping never takes a role's lock, so a
worker busy in a long step still answers liveness); the role gives the rest of its service spec. The server
authenticates every call with this process's credentials (dsakv.disagg.protocol.auth.use, set by `dsakv serve` from
--cluster-secret-file; none in in-process tests) and allows each RPC only to the roles its spec names; calls it
refused are counted in Health.counters as rpc_refused_<why> (unauthenticated, forbidden, too_large, auth_timeout,
evicted, ...), with rpc_connections_open / rpc_connections_pending (not authenticated yet) beside them. Used by
the decode worker and by every prefill stage. Imports dsakv.disagg.{rpc, messages, wire}; never torch.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from dsakv.disagg.protocol.messages import CHECK_INTEGRITY, HEALTH, PING, Health, PingReply
from dsakv.disagg.protocol.rpc import PeerUnavailable, Rpc, RpcClient, RpcError, RpcServer, Service, acl_of, bind
from dsakv.disagg.protocol.wire import new_boot_id

log = logging.getLogger(__name__)


class WorkerService:
    """One worker's RPC server (its role's service spec) and loop threads; `stopping` ends them."""

    def __init__(
        self,
        service: Service,
        handlers: Mapping[Rpc[Any, Any], Callable[[Any], Any]],
        host: str,
        port: int,
        name: str,
        *,
        health: Callable[[], Health],
        integrity: Callable[[], str],
        ping: Callable[[], PingReply] | None = None,
        stopping: threading.Event | None = None,
    ) -> None:
        self.boot = new_boot_id()
        self.stopping = stopping if stopping is not None else threading.Event()
        common: dict[Rpc[Any, Any], Callable[[Any], Any]] = {
            PING: lambda _: ping() if ping is not None else PingReply(pid=os.getpid(), boot=self.boot),
            HEALTH: lambda _: self._health(health),
            CHECK_INTEGRITY: lambda _: integrity(),
        }
        self.rpc = RpcServer(bind(service, {**common, **handlers}), host, port, name=name, acl=acl_of(service))
        self._threads: list[threading.Thread] = []

    @property
    def address(self) -> str:
        return self.rpc.address

    def _health(self, health: Callable[[], Health]) -> Health:
        h = health()
        refused = {f"rpc_refused_{k}": v for k, v in self.rpc.refused.as_dict().items()}
        conns = {
            "rpc_connections_open": self.rpc.open_connections,
            "rpc_connections_pending": self.rpc.pending_connections,
        }
        return dataclasses.replace(h, counters={**h.counters, **refused, **conns})

    def start(self, loops: Sequence[tuple[Callable[[], None], str]]) -> None:
        self.rpc.start()
        for target, name in loops:
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)

    def request_stop(self) -> None:
        self.stopping.set()

    def stop(self, join_timeout: float) -> None:
        self.stopping.set()
        for t in self._threads:
            t.join(timeout=join_timeout)
        self.rpc.stop()

    def serve_forever(self) -> None:
        while not self.stopping.is_set():
            self.stopping.wait(1.0)


class PeerClients:
    """One kept RpcClient per peer address (each call bounded; RpcClient is thread-safe and reconnects after a
    failure), so control messages to a peer do not open a connection each."""

    def __init__(self, timeout: float, connect_timeout: float) -> None:
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._clients: dict[str, RpcClient] = {}
        self._boots: dict[str, str] = {}  # addr -> the peer boot its client last served
        self._lock = threading.Lock()

    def client(self, addr: str, boot: str | None = None) -> RpcClient:
        """The client for `addr`; a new connection when `boot` (the peer process the caller means) differs from
        the one the last caller named: a kept connection to a restarted peer would fail its first call."""
        with self._lock:
            c = self._clients.get(addr)
            if c is not None and boot is not None and self._boots.get(addr, boot) != boot:
                c.close()
                c = None
            if c is None:
                c = self._clients[addr] = RpcClient(addr, timeout=self.timeout, connect_timeout=self.connect_timeout)
            if boot is not None:
                self._boots[addr] = boot
            return c

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


class Notifier(PeerClients):
    """Fire-and-forget control RPCs (bounded each) on one background thread, in order; a client per peer."""

    def __init__(self, timeout: float, connect_timeout: float) -> None:
        super().__init__(timeout, connect_timeout)
        self._q: queue.Queue[tuple[str, Rpc[Any, Any], Any] | None] = queue.Queue()
        self._t = threading.Thread(target=self._loop, name="notifier", daemon=True)
        self._t.start()

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

    def drain(self, timeout: float) -> None:
        """Stop after every call posted so far was made (bounded by `timeout`)."""
        self.stop()
        self._t.join(timeout)


def connect_at_startup(addrs: Sequence[str], connect: Callable[[str], object], wait: float) -> None:
    """A prefill's --decode peers at startup: `connect(addr)` each, retrying while it is unreachable (not up yet)
    for up to `wait` seconds; anything else it raises (IncompatiblePeer: the pair is refused) propagates."""
    for addr in addrs:
        end = time.monotonic() + wait
        while True:
            try:
                connect(addr)
                break
            except PeerUnavailable:
                if time.monotonic() >= end:
                    raise
                time.sleep(0.5)
