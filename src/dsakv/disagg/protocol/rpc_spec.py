"""Typed RPCs of the control plane (dsakv.disagg.protocol.rpc): `Rpc` (name, request and reply types, caller roles),
`Service` (the RPCs one role serves), `bind` (handlers that decode requests and encode replies), the ACL table."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from dsakv.disagg.protocol.codec import from_wire, to_wire
from dsakv.disagg.protocol.rpc_frames import Handler

log = logging.getLogger(__name__)

Q = TypeVar("Q")
R = TypeVar("R")


@dataclass(frozen=True)
class Rpc(Generic[Q, R]):
    """One RPC: its method name, request and reply types, and who calls it (the documented RPC graph).
    `roles`: the caller roles an authenticating server accepts (dsakv.disagg.protocol.auth.ROLES; None: any role holding
    the secret). `retry`: a one-shot call whose cached connection turns out dead (the peer restarted) is sent
    once more on a fresh connection within its deadline (for idempotent calls only)."""

    name: str
    request: type[Q]
    reply: type[R]
    caller: str
    doc: str
    roles: tuple[str, ...] | None = None
    retry: bool = False


@dataclass(frozen=True)
class Service:
    """The RPCs one role serves."""

    name: str
    rpcs: tuple[Rpc[Any, Any], ...]

    def names(self) -> list[str]:
        return [r.name for r in self.rpcs]


def bind(service: Service, impl: Mapping[Rpc[Any, Any], Callable[[Any], Any]]) -> dict[str, Handler]:
    """Raw handlers for RpcServer: each decodes its request, calls impl[rpc] and encodes the reply. Every RPC
    of `service` needs an implementation, and nothing else may be given (the spec is the list)."""
    missing = [r.name for r in service.rpcs if r not in impl]
    extra = [r.name for r in impl if r not in service.rpcs]
    if missing or extra:
        raise ValueError(f"{service.name}: handlers missing for {missing}, not in the service spec: {extra}")

    def wrap(rpc: Rpc[Any, Any], fn: Callable[[Any], Any]) -> Handler:
        def handler(params: Any) -> Any:
            return to_wire(fn(from_wire(rpc.request, {} if params is None else params, f"{rpc.name} request")))

        return handler

    return {r.name: wrap(r, impl[r]) for r in service.rpcs}


def acl_of(service: Service) -> dict[str, tuple[str, ...] | None]:
    """method -> the roles allowed to call it (for RpcServer)."""
    return {r.name: r.roles for r in service.rpcs}


def services_table(services: Sequence[Service]) -> str:
    """Text table of every RPC: service, method, request -> reply, caller (for docs and --help)."""
    rows = []
    for s in services:
        for r in s.rpcs:
            rows.append(
                f"{s.name:<16} {r.name:<16} {r.request.__name__} -> {getattr(r.reply, '__name__', r.reply)}"
                f"   (from {r.caller}; roles {'/'.join(r.roles) if r.roles else 'any'})"
            )
    return "\n".join(rows)
