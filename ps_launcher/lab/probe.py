"""Tiny TCP measurement tools to run inside lab hosts (tests, ``benchmarks/bench_lab.py``).

Why our own: no iperf here, and we want exactly what the parameter server meets, plain TCP
between namespaces. ``serve`` answers three requests on one port:

- ``E``: echo 32-byte messages (round-trip time; TCP_NODELAY on both ends),
- ``U`` + 8-byte n: receive n bytes, then answer one byte (upload throughput),
- ``D`` + 8-byte n: send n bytes (download throughput).

``python probe.py serve --port P`` prints ``listening`` once bound; the client commands print
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import struct
import sys
import threading
import time

MSG = 32
CHUNK = 256 * 1024


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed")
        buf += chunk
    return bytes(buf)


def _handle(conn: socket.socket) -> None:
    with conn:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        kind = _recv_exact(conn, 1)
        if kind == b"E":
            while True:
                try:
                    msg = _recv_exact(conn, MSG)
                except ConnectionError:
                    return
                conn.sendall(msg)
        n = struct.unpack("!Q", _recv_exact(conn, 8))[0]
        if kind == b"U":
            left = n
            while left > 0:
                chunk = conn.recv(min(CHUNK, left))
                if not chunk:
                    return
                left -= len(chunk)
            conn.sendall(b"k")
        elif kind == b"D":
            block = b"\0" * CHUNK
            left = n
            while left > 0:
                k = min(CHUNK, left)
                conn.sendall(block[:k])
                left -= k


def serve(host: str, port: int) -> None:
    srv = socket.socket()
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((host, port))
    srv.listen(16)
    print("listening", flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_handle, args=(conn,), daemon=True).start()


def _connect(host: str, port: int, timeout: float) -> socket.socket:
    deadline = time.monotonic() + timeout
    while True:
        try:
            s = socket.create_connection((host, port), timeout=timeout)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return s
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def rtt(host: str, port: int, count: int = 20, timeout: float = 10.0) -> dict:
    """Median and spread of ``count`` 32-byte request/reply round trips, in ms (after a warm-up
    exchange, so ARP and the handshake are not counted)."""
    with _connect(host, port, timeout) as s:
        s.sendall(b"E")
        msg = b"x" * MSG
        s.sendall(msg)
        _recv_exact(s, MSG)
        samples = []
        for _ in range(count):
            t0 = time.perf_counter()
            s.sendall(msg)
            _recv_exact(s, MSG)
            samples.append((time.perf_counter() - t0) * 1000.0)
    return {
        "rtt_ms_median": statistics.median(samples),
        "rtt_ms_min": min(samples),
        "rtt_ms_max": max(samples),
        "count": count,
    }


def bulk(host: str, port: int, direction: str, nbytes: int, timeout: float = 30.0) -> dict:
    """Throughput of one TCP transfer of ``nbytes``: ``up`` (client sends) or ``down``."""
    with _connect(host, port, timeout) as s:
        s.settimeout(timeout)
        if direction == "up":
            block = b"\0" * CHUNK
            t0 = time.perf_counter()
            s.sendall(b"U" + struct.pack("!Q", nbytes))
            left = nbytes
            while left > 0:
                k = min(CHUNK, left)
                s.sendall(block[:k])
                left -= k
            _recv_exact(s, 1)
        elif direction == "down":
            t0 = time.perf_counter()
            s.sendall(b"D" + struct.pack("!Q", nbytes))
            left = nbytes
            while left > 0:
                chunk = s.recv(min(CHUNK, left))
                if not chunk:
                    raise ConnectionError("server closed early")
                left -= len(chunk)
        else:
            raise ValueError(direction)
        dt = time.perf_counter() - t0
    return {"direction": direction, "bytes": nbytes, "seconds": dt, "mbit_s": nbytes * 8 / dt / 1e6}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="TCP probes for the heterogeneity lab")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, required=True)
    p = sub.add_parser("rtt")
    p.add_argument("host")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--count", type=int, default=20)
    p = sub.add_parser("bulk")
    p.add_argument("host")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--direction", choices=["up", "down"], required=True)
    p.add_argument("--bytes", type=int, default=4 << 20)
    a = ap.parse_args(argv)
    if a.cmd == "serve":
        serve(a.host, a.port)
        return 0
    if a.cmd == "rtt":
        out = rtt(a.host, a.port, a.count)
    else:
        out = bulk(a.host, a.port, a.direction, a.bytes)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
