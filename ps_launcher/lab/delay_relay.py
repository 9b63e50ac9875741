"""A userspace delay stage for one lab link, because this kernel has no ``netem``.

Why a relay of frames and not a TCP proxy: clients dial the servers' own addresses, so latency
has to be added under IP. The relay runs inside the lab's bridge namespace and splices itself into
one host's link: the bridge-side veth end is taken off the bridge and read with an ``AF_PACKET``
socket, and a TAP device takes its place as the bridge port. Every Ethernet frame, in either
direction, is held for ``delay`` and then forwarded, in order (a FIFO per direction; a lowered
delay never lets a frame overtake an earlier one). ``tc`` qdiscs on the veth still apply, so rate
limits and delay compose.

Both ends speak virtio-net headers (``PACKET_VNET_HDR``, ``IFF_VNET_HDR``): TSO/GSO super-frames
of up to 64 KiB pass through whole, with their checksum offload state, so one read moves up to
64 KiB and a Python loop keeps up with hundreds of Mbit/s.

Stdlib only; :mod:`ps_launcher.lab.netns` runs it by path with ``ip netns exec``. Control on
stdin, one command a line, each answered on stdout: ``delay <ms>`` (answer ``ok <ms>``),
``stats`` (``stats up=<n> down=<n> dropped=<n> queued=<n>``), ``quit``. On end of stdin (the
owner died) it exits, and its TAP device vanishes with it.
"""

from __future__ import annotations

import argparse
import collections
import errno
import fcntl
import os
import select
import signal
import socket
import struct
import sys
import time

TUNSETIFF = 0x400454CA
TUNSETOFFLOAD = 0x400454D0
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
IFF_VNET_HDR = 0x4000
TUN_F_CSUM, TUN_F_TSO4, TUN_F_TSO6, TUN_F_TSO_ECN = 0x01, 0x02, 0x04, 0x08
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
ETH_P_ALL = 0x0003
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
BUF = 65536 + 64
BATCH = 64


def open_tap(name: str) -> int:
    """Create TAP device ``name`` (with virtio-net headers and TSO offload) in this namespace."""
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    ifr = struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI | IFF_VNET_HDR)
    fcntl.ioctl(fd, TUNSETIFF, ifr)
    fcntl.ioctl(fd, TUNSETOFFLOAD, TUN_F_CSUM | TUN_F_TSO4 | TUN_F_TSO6 | TUN_F_TSO_ECN)
    return fd


def open_packet(ifname: str) -> socket.socket:
    """A raw socket on ``ifname`` that sees frames arriving there, with virtio-net headers."""
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    try:
        s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)
    except OSError:  # kernels before 4.20: filtered by pkttype below
        pass
    for opt in (SO_RCVBUFFORCE, SO_SNDBUFFORCE):
        try:
            s.setsockopt(socket.SOL_SOCKET, opt, 8 << 20)
        except OSError:
            pass
    s.bind((ifname, ETH_P_ALL))
    s.setblocking(False)
    return s


class Relay:
    """Two FIFOs of (due time, frame); ``up`` is host -> bridge, ``down`` is bridge -> host."""

    def __init__(self, tap: int, sock: socket.socket, delay_s: float) -> None:
        self.tap, self.sock, self.delay_s = tap, sock, delay_s
        self.up: collections.deque[tuple[float, bytes]] = collections.deque()
        self.down: collections.deque[tuple[float, bytes]] = collections.deque()
        self.last_up = self.last_down = 0.0
        self.n_up = self.n_down = self.dropped = 0

    def pull(self, now: float) -> None:
        """Read what is waiting on both ends (bounded batches, so neither side starves)."""
        due = now + self.delay_s
        for _ in range(BATCH):
            try:
                data, addr = self.sock.recvfrom(BUF)
            except BlockingIOError:
                break
            if addr[2] == socket.PACKET_OUTGOING:
                continue
            self.last_up = max(due, self.last_up)
            self.up.append((self.last_up, data))
        for _ in range(BATCH):
            try:
                data = os.read(self.tap, BUF)
            except BlockingIOError:
                break
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EIO):
                    break
                raise
            self.last_down = max(due, self.last_down)
            self.down.append((self.last_down, data))

    def push(self, now: float) -> None:
        """Forward every frame whose time has come; a full queue downstream drops it (as a
        router would)."""
        while self.up and self.up[0][0] <= now:
            _, data = self.up.popleft()
            try:
                os.write(self.tap, data)
                self.n_up += 1
            except OSError:
                self.dropped += 1
        while self.down and self.down[0][0] <= now:
            _, data = self.down.popleft()
            try:
                self.sock.send(data)
                self.n_down += 1
            except OSError:
                self.dropped += 1

    def next_due(self) -> float | None:
        heads = [q[0][0] for q in (self.up, self.down) if q]
        return min(heads) if heads else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--veth", required=True, help="bridge-side veth end of the host's link")
    ap.add_argument("--tap", required=True, help="name of the TAP device to create")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="one-way delay, each direction")
    args = ap.parse_args(argv)

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, lambda *_: sys.exit(0))
    tap = open_tap(args.tap)
    sock = open_packet(args.veth)
    relay = Relay(tap, sock, max(0.0, args.delay_ms) / 1000.0)
    ctl = sys.stdin.fileno()
    os.set_blocking(ctl, False)
    out = sys.stdout
    out.write("ready\n")
    out.flush()
    pending = b""
    while True:
        now = time.monotonic()
        relay.push(now)
        nd = relay.next_due()
        timeout = None if nd is None else max(0.0, nd - time.monotonic())
        r, _, _ = select.select([sock, tap, ctl], [], [], timeout)
        if ctl in r:
            chunk = os.read(ctl, 4096)
            if not chunk:
                return 0
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                cmd = line.decode(errors="replace").split()
                if not cmd:
                    continue
                if cmd[0] == "delay" and len(cmd) == 2:
                    try:
                        relay.delay_s = max(0.0, float(cmd[1])) / 1000.0
                        out.write(f"ok {relay.delay_s * 1000.0:g}\n")
                    except ValueError:
                        out.write(f"error bad delay {cmd[1]!r}\n")
                elif cmd[0] == "stats":
                    queued = len(relay.up) + len(relay.down)
                    out.write(
                        f"stats up={relay.n_up} down={relay.n_down} "
                        f"dropped={relay.dropped} queued={queued}\n"
                    )
                elif cmd[0] == "quit":
                    out.write("bye\n")
                    out.flush()
                    return 0
                else:
                    out.write(f"error unknown command {line!r}\n")
                out.flush()
        if sock in r or tap in r:
            relay.pull(time.monotonic())


if __name__ == "__main__":
    sys.exit(main())
