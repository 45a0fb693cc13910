"""Control-plane RPC under a flood of idle connections (issue 26, finding 5): one authenticated RpcServer (echo),
callers making fresh-connection calls (as liveness pings and handshakes do) while a flooder keeps opening rounds of
--idle connections that never authenticate, against the same calls with no flood, in the same run.

Prints calls, failures, call latency p50/p99 per arm and the ratio flood / quiet, the connections the server
closed at their authentication deadline or evicted, and the load average.

    python bench/rpc_flood.py [--calls 300] [--idle 300]
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import statistics
import threading
import time

from dsakv.disagg.protocol.auth import ClusterAuth, Keyring, new_secret
from dsakv.disagg.protocol.rpc import RpcClient, RpcError, RpcServer

KEYS = Keyring(new_secret().encode())


def _calls(addr: str, n: int) -> tuple[list[float], int]:
    lat, failed = [], 0
    for i in range(n):
        c = RpcClient(addr, timeout=5, auth=ClusterAuth(KEYS, "router"))
        t0 = time.perf_counter()
        try:
            assert c.call("echo", i) == i
            lat.append(time.perf_counter() - t0)
        except RpcError:
            failed += 1
        finally:
            c.close()
    return lat, failed


def _flood(host: str, port: int, idle: int, stop: threading.Event, opened: list[int]) -> None:
    while not stop.is_set():
        socks = [socket.create_connection((host, port), timeout=10) for _ in range(idle)]
        opened[0] += idle
        for s in socks:
            s.settimeout(30)
            try:
                while s.recv(4096):
                    pass
            except OSError:
                pass
            s.close()


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--idle", type=int, default=300)
    a = ap.parse_args()
    logging.getLogger("dsakv.disagg.protocol.rpc").setLevel(logging.ERROR)  # one warning per closed idle connection
    srv = RpcServer({"echo": lambda p: p}, auth=ClusterAuth(KEYS, "decode")).start()
    try:
        _calls(srv.address, 50)  # warm-up
        quiet, quiet_failed = _calls(srv.address, a.calls)
        stop, opened = threading.Event(), [0]
        t = threading.Thread(target=_flood, args=(srv.host, srv.port, a.idle, stop, opened), daemon=True)
        t.start()
        while not opened[0]:
            time.sleep(0.01)
        flood, flood_failed = [], 0
        while len(flood) + flood_failed < a.calls or opened[0] < 3 * a.idle:  # at least 3 rounds of the flood
            lat, failed = _calls(srv.address, 10)
            flood, flood_failed = flood + lat, flood_failed + failed
        stop.set()
        t.join(60)
        print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f}")
        for name, lat, failed in (("quiet", quiet, quiet_failed), (f"flood {a.idle} idle", flood, flood_failed)):
            print(
                f"{name:>16}: {len(lat) + failed} calls, {failed} failed, p50 {_pct(lat, 0.5):.2f} ms, "
                f"p99 {_pct(lat, 0.99):.2f} ms, mean {statistics.fmean(lat) * 1e3:.2f} ms"
            )
        print(
            f"ratio flood / quiet: p50 x{_pct(flood, 0.5) / _pct(quiet, 0.5):.2f}, "
            f"p99 x{_pct(flood, 0.99) / _pct(quiet, 0.99):.2f}"
        )
        r = srv.refused
        print(
            f"idle connections opened {opened[0]}: closed at the auth deadline {r['auth_timeout']}, evicted "
            f"{r['evicted']}, refused at the cap {r['connections']}"
        )
    finally:
        srv.stop()


if __name__ == "__main__":
    main()
