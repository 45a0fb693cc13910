"""Liveness of the prefill stages a decode worker waits for: which stage each request still waits on, and one
ping's verdict on a stage (None: it answers; 'dead': nothing listens; 'not answering': it does not reply).

    waits = stage_waits(inbound.values())     {stage rpc address: [(request, stage), ...]} of every missing report
    verdict = ping_stage(addr, timeout)       the decode fails the requests waiting on a stage that is not None

Imports dsakv.disagg.{lifecycle, messages, rpc}; no torch.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from dsakv.disagg.lifecycle import InboundKv
from dsakv.disagg.messages import PING, Ping
from dsakv.disagg.rpc import PeerUnavailable, RpcClient, RpcError, split_addr


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


def ping_stage(addr: str, timeout: float) -> str | None:
    """None if the stage answers a PING within `timeout`; 'dead' if nothing listens; 'not answering' if it does
    not reply."""
    if refused(addr, timeout / 2):
        return "dead"
    c = RpcClient(addr, timeout=timeout, connect_timeout=timeout / 2)
    try:
        c.request(PING, Ping(), timeout=timeout)
        return None
    except PeerUnavailable:
        return "dead" if refused(addr, timeout / 2) else "not answering"
    except RpcError:
        return None
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
