"""A PD deployment started on 127.0.0.1 (decode + PP=2 prefill over Mooncake + the HTTP router, real processes)
listens on 127.0.0.1 only: every LISTEN socket of every process (its RPC, the gloo rendezvous and pairs, and
Mooncake's handshake and data listeners, which bind all interfaces unless dsakv's bind shim rewrites them) is on
loopback, after a request went through, and the data-plane ports refuse a connection on this machine's other
address. The shim itself is checked on a plain wildcard bind, and `dsakv store-master` likewise."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import httpx
import pytest

from dsakv.disagg.transfer.backends.bind_shim import ENV_HOST, shim_path
from dsakv.testing.cluster import Cluster, Proc, assert_clean, free_ports, wait_for
from dsakv.testing.engines import tiny_path
from dsakv.testing.listen import is_loopback, listening_sockets

pytestmark = pytest.mark.skipif(shim_path() is None, reason="no C compiler for the bind shim")


def _other_address() -> str | None:
    """A non-loopback IPv4 address of this machine (the one a default route would use), if any."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))  # no packet is sent
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_bind_shim_rewrites_wildcard_binds(tmp_path):
    code = textwrap.dedent(
        """
        import socket
        a = socket.socket(); a.bind(("0.0.0.0", 0)); print(a.getsockname()[0])
        b = socket.socket(socket.AF_INET6); b.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        b.bind(("::", 0)); print(b.getsockname()[0])
        c = socket.socket(); c.bind(("127.0.0.1", 0)); print(c.getsockname()[0])
        """
    )
    env = {**os.environ, "LD_PRELOAD": str(shim_path()), ENV_HOST: "127.0.0.1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["127.0.0.1", "::ffff:127.0.0.1", "127.0.0.1"]


def test_pd_deployment_listens_on_loopback_only(tmp_path):
    c = Cluster(tiny_path("glm_moe_dsa"), tmp_path)
    try:
        d = c.decode("dec", "mooncake", True)
        stages = c.prefill("pre", "mooncake", True, [7, 5], extra=["--decode", d.addr])
        port = free_ports(1)
        router = c._serve(
            "router",
            f"127.0.0.1:{port}",
            ["--role", "router", "--port", str(port), "--prefill", stages[0].addr] + ["--decode", d.addr],
        )
        procs = [d, *stages, router]
        c.wait_healthy([d, *stages])
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 200, 120, "router healthy", procs)
        body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4, r.text
        assert_clean([d.addr, stages[0].addr, stages[1].addr], procs=procs)

        by_proc = {p.name: listening_sockets(p.pid) for p in procs}
        assert all(by_proc.values()), by_proc
        bad = {n: [s for s in socks if not is_loopback(s[1])] for n, socks in by_proc.items()}
        assert not any(bad.values()), f"listening beyond 127.0.0.1: {bad}"
        # each decode / prefill stage holds its RPC port, mooncake's two listeners and gloo's (stage 0: rendezvous)
        for p in (d, *stages):
            ports = {s[2] for s in by_proc[p.name]}
            assert int(p.addr.rsplit(":", 1)[1]) in ports and len(ports) >= 3, (p.name, by_proc[p.name])
        other = _other_address()
        if other is not None:
            for socks in by_proc.values():
                for _pid, _addr, prt in socks:
                    with pytest.raises(OSError):
                        socket.create_connection((other, prt), timeout=2).close()
    finally:
        c.close()


def test_store_master_listens_on_loopback_only(tmp_path):
    """`dsakv store-master` (the L3 tier's Mooncake master + store memory) binds 127.0.0.1 only, its
    mooncake_master child included."""
    c = Cluster(tiny_path("glm_moe_dsa"), tmp_path)
    port = free_ports(3)
    cmd = [sys.executable, "-m", "dsakv", "store-master", "--port", str(port), "--size", "16MiB"]
    p = Proc("store-master", cmd, tmp_path / "store-master.log", f"127.0.0.1:{port}").start()
    c.procs.append(p)
    try:
        wait_for(lambda: "store master ready" in p.log.read_text(errors="replace"), 60, "store master", [p])
        socks = listening_sockets(p.pid)
        ports = {s[2] for s in socks}
        assert {port, port + 1, port + 2} <= ports and len(ports) >= 5, socks  # + mooncake's two listeners
        assert all(is_loopback(s[1]) for s in socks), socks
    finally:
        c.close()
