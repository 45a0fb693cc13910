"""Make a transfer engine that binds every interface listen on --host only (a preloaded bind() shim, bind_shim.c).

Mooncake Transfer Engine (0.3.x, and upstream as of 2026) binds its P2P handshake listener to INADDR_ANY and its
TCP data listener to in6addr_any (dual stack) whatever hostname `initialize()` is given; MC_TCP_BIND_ADDRESS only
changes the address it advertises. So a Mooncake client anywhere on the network could read or write registered
KV memory. dsakv therefore starts decode / prefill stage processes with a 40-line C shim in LD_PRELOAD that
rewrites a wildcard bind() to the deployment's host:

    bind(fd, 0.0.0.0:P)  -> bind(fd, HOST:P)                  AF_INET
    bind(fd, [::]:P)     -> bind(fd, [::ffff:HOST]:P)         AF_INET6 (dual stack), HOST an IPv4 address
                         -> bind(fd, [HOST]:P)                AF_INET6, HOST an IPv6 address
    any other bind       -> unchanged

    ensure_bound_to_host("127.0.0.1")   # in the worker, before the engine loads: re-exec under the shim once

The shim is compiled with the system C compiler on first use into ~/.cache/dsakv (atomic rename, keyed by its
source hash). Without a compiler, or with a wildcard --host, nothing changes and the startup log says that the
engine listens on every interface. The re-exec also sets MC_TCP_BIND_ADDRESS (unless set) to the host: with a
metadata server (the Mooncake Store) that is the address Mooncake advertises for its data listener. Standard
library only.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from dsakv.util.cbuild import CSource, cache_roots, compile_into, compiler

log = logging.getLogger(__name__)

ENV_HOST = "DSAKV_BIND_HOST"
ENV_DONE = "DSAKV_BIND_REEXEC"
WILDCARD_HOSTS = ("", "0.0.0.0", "::", "[::]", "*")

SHIM_SOURCE = CSource(Path(__file__).with_name("bind_shim.c"), flags=("-O2",), libs=("-ldl",))  # built from disk


def shim_path() -> Path | None:
    """The compiled shim (built now if needed), or None when no C compiler is available or the build fails."""
    tag = SHIM_SOURCE.tag()
    for root in cache_roots():
        out = root / f"bind_shim-{tag}.so"
        if out.is_file():
            return out
        cc = compiler()
        if cc is None:
            return None
        try:
            err = compile_into(SHIM_SOURCE, out, cc)
            if err is not None:
                log.warning("bind shim: %s", err)
                return None
            return out
        except (OSError, subprocess.SubprocessError) as e:
            log.debug("bind shim: cannot build in %s: %s", root, e)
            continue
    return None


def _literal(host: str) -> str | None:
    """host as an IP literal (a name resolved, IPv4 first), None if it does not resolve."""
    h = host.strip("[]")
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in h else socket.AF_INET, h)
        return h
    except OSError:
        pass
    try:
        infos = socket.getaddrinfo(h, None, type=socket.SOCK_STREAM)
    except OSError:
        return None
    infos.sort(key=lambda i: i[0] != socket.AF_INET)
    return str(infos[0][4][0]) if infos else None


def shim_active(host: str) -> bool:
    lit = _literal(host)
    pre = os.environ.get("LD_PRELOAD", "")
    return lit is not None and os.environ.get(ENV_HOST) == lit and "bind_shim-" in pre


def ensure_bound_to_host(host: str, what: str = "the transfer engine") -> bool:
    """Re-execute this process (same pid, same argv) under the bind shim so that wildcard listeners bind `host`;
    returns True when they will (the shim is active), False (after a warning) when they cannot."""
    if host in WILDCARD_HOSTS:
        return False
    if shim_active(host):
        return True
    lit = _literal(host)
    path = shim_path() if lit is not None else None
    # started as `dsakv serve ...` / `dsakv store-master ...` (so argv can be replayed)
    reexec_ok = sys.argv[1:2] in (["serve"], ["store-master"]) and not os.environ.get(ENV_DONE)
    if path is None or not reexec_ok:
        log.warning(
            "%s listens on every interface, not only --host %s: %s (install gcc, or firewall its ports); see "
            "README 'Trust model'",
            what,
            host,
            "no C compiler to build dsakv's bind shim"
            if path is None
            else "not started as `dsakv serve` or `dsakv store-master`",
        )
        return False
    env = dict(os.environ)
    env[ENV_HOST] = lit or host
    env[ENV_DONE] = "1"
    # what Mooncake advertises with a metadata server (the store); else its first LAN address, now unbound
    env.setdefault("MC_TCP_BIND_ADDRESS", lit or host)
    env["LD_PRELOAD"] = " ".join(x for x in (str(path), env.get("LD_PRELOAD", "")) if x)
    argv = [sys.executable, "-m", "dsakv", *sys.argv[1:]]
    log.info("re-executing under the bind shim so %s listens on %s only", what, lit)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, argv, env)
    return True  # pragma: no cover - execve does not return


__all__ = ["SHIM_SOURCE", "ensure_bound_to_host", "shim_active", "shim_path"]
