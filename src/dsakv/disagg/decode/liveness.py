"""Liveness of the prefill stages a decode worker waits for: which stage each request still waits on, and one
ping's verdict on a stage (None: it answers; 'dead': nothing listens; 'not answering': it does not reply).

    waits = stage_waits(inbound.values())     {stage rpc address: [(request, stage), ...]} of every missing report
    verdict, boot = ping_stage(addr, timeout) the decode fails the requests waiting on a stage whose verdict is not
                                              None, or that answers with another boot id (it restarted)
    revoke_stage(addr, rid, grant, timeout)   a failed request: the stage never writes its pages (Revoked.in_flight:
                                              a write is running, or may still land)

Imports dsakv.disagg.{lifecycle, messages, rpc}; no torch.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable

from dsakv.disagg.protocol.lifecycle import InboundKv
from dsakv.disagg.protocol.messages import PING, REVOKE, Ping, Revoke, Revoked
from dsakv.disagg.protocol.rpc import PeerUnavailable, RpcClient, RpcError, split_addr


def refused(addr: str, timeout: float = 0.5) -> bool:
    """True if nothing listens at addr (the process is gone); False if it accepts or does not answer."""
    host, port = split_addr(addr)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def ping_stage(addr: str, timeout: float) -> tuple[str | None, str | None]:
    """(None, its boot id) if the stage answers a PING within `timeout`; ('dead', None) if nothing listens;
    ('not answering', None) if it does not reply; (None, None) if it answers with an error (it is alive). A
    connection the stage closes at once (e.g. to admit a newer one under a flood of idle connections) is tried
    again within the same `timeout`: only silence for the whole of it, or a refused connect, is a verdict."""
    end = time.monotonic() + timeout
    if refused(addr, timeout / 2):
        return "dead", None
    while True:
        left = end - time.monotonic()
        c = RpcClient(addr, timeout=max(0.05, left), connect_timeout=max(0.05, left / 2))
        try:
            return None, c.request(PING, Ping(), timeout=max(0.05, left)).boot
        except PeerUnavailable:
            if refused(addr, max(0.05, min(timeout / 2, end - time.monotonic()))):
                return "dead", None
            if end - time.monotonic() > 0.1:
                continue
            return "not answering", None
        except RpcError:
            return None, None
        finally:
            c.close()


def revoke_stage(addr: str, rid: str, grant: bytes, timeout: float) -> Revoked:
    """Ask the stage at `addr` never to write the pages of `grant` (request `rid`); RpcError if it cannot say."""
    c = RpcClient(addr, timeout=timeout, connect_timeout=timeout / 2)
    try:
        return c.request(REVOKE, Revoke(rid, grant), timeout=timeout)
    finally:
        c.close()


def stage_waits(inbound: Iterable[InboundKv]) -> dict[str, list[tuple[InboundKv, int]]]:
    """The stages (by RPC address) that requests still wait for, each with its (request, stage) pairs; a stage
    already known dead is not asked again."""
    waits: dict[str, list[tuple[InboundKv, int]]] = {}
    for inb in inbound:
        for k in inb.missing():
            if k not in inb.dead:
                waits.setdefault(inb.stage_rpc[k], []).append((inb, k))
    return waits
