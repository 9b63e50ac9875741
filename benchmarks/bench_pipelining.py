"""What a 40 MB exchange costs here, by how it is framed, and whether pipelining a shard's
update with the upload would pay. A probe for decisions about the data plane, not the product.

The data plane's gap to raw pyzmq (``bench_dataplane.py``) is partly the update a shard applies
between the last gradient's arrival and its answer. One way to hide it: the worker sends its
gradient in K chunk messages, and the shard checks each chunk and computes that chunk's new
momentum and parameters into shadow buffers while the next chunk is still arriving; once every
chunk is in (and all are finite) it swaps the buffers in and answers. That changes the protocol
(chunked pushes, speculative updates that a missing chunk must undo), so this measures the most
it could give first, with the shard's SGD-with-momentum arithmetic, one client and one server
process over loopback TCP and no protocol:

- raw: the server echoes the 40 MB frame it received (bench_dataplane's raw baseline);
- whole: the server receives the gradient in one frame, checks it (one torch sum), updates
  (momentum decay and add, new parameters into a reused buffer) and sends the parameters back;
- raw K / multipart K: the same bytes as K messages, or as one message of K frames, echoed;
- chunked K: K messages, each checked and its slice of momentum and parameters computed into
  shadow buffers on arrival; after the last, swap and answer in one message of K frames.

What it showed (2 cores; ``docs/results/ddp_vs_ps/dataplane_2026-11-27/pipelining.txt``): with
glibc's default heap one 40 MB frame took 39-67 ms and the same bytes in 2 to 32 frames or
messages 20-32 ms, because glibc maps every block over 32 MB afresh and each receive faults its
pages in; with the heap kept (``--keep-heap``, as ``ps_common.heap`` now keeps it in the PS
processes) one frame took 25 ms, about as long as several. The chunked update took 0.8x the
time of the whole one (30.8 against 38.3 ms with the heap kept), but 1.45x that of raw in as
many messages (21.3 ms): on two cores the arithmetic does not hide behind the transfer.
Rounds alternate between the modes; median, mean and p95 per mode.

    python benchmarks/bench_pipelining.py [--floats 10000000] [--rounds 30] [--chunks 4 8 16]
        [--keep-heap]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

MOMENTUM, LR = 0.9, 0.01


def _keep_heap(keep: bool) -> None:
    if keep:
        from ps_common.heap import keep_freed_memory

        keep_freed_memory()


def _server(endpoint_q: Any, n: int, keep_heap: bool) -> None:
    import torch
    import zmq

    _keep_heap(keep_heap)

    torch.set_num_threads(1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    endpoint_q.put(f"tcp://127.0.0.1:{port}")
    p = torch.zeros(n)
    v = torch.zeros(n)
    p_sh, v_sh = torch.empty(n), torch.empty(n)
    while True:
        head = sock.recv()
        if head == b"stop":
            break
        mode, k = head.split(b" ")
        chunks = int(k)
        if mode == b"multipart":
            sock.send_multipart(sock.recv_multipart(copy=False), copy=False)
            continue
        if mode == b"raw":
            frames = [sock.recv(copy=False) for _ in range(chunks)]
            sock.send_multipart(frames, copy=False)
            continue
        if mode == b"whole":
            g = torch.frombuffer(sock.recv(copy=False).buffer, dtype=torch.float32)
            if not torch.isfinite(g.sum()):
                raise RuntimeError("non-finite gradient")
            v.mul_(MOMENTUM).add_(g)
            torch.add(p, v, alpha=-LR, out=p_sh)
            p, p_sh = p_sh, p
            sock.send(p.numpy(), copy=False)
            continue
        bounds = np.linspace(0, n, chunks + 1).astype(int)
        finite = True
        for i in range(chunks):
            lo, hi = int(bounds[i]), int(bounds[i + 1])
            g = torch.frombuffer(sock.recv(copy=False).buffer, dtype=torch.float32)
            finite = finite and bool(torch.isfinite(g.sum()))
            torch.add(g, v[lo:hi], alpha=MOMENTUM, out=v_sh[lo:hi])      # momentum * v + g
            torch.add(p[lo:hi], v_sh[lo:hi], alpha=-LR, out=p_sh[lo:hi])
        if not finite:
            raise RuntimeError("non-finite gradient")
        p, p_sh, v, v_sh = p_sh, p, v_sh, v                               # the commit
        for i in range(chunks):
            sock.send(p[int(bounds[i]):int(bounds[i + 1])].numpy(), copy=False,
                      flags=zmq.SNDMORE if i < chunks - 1 else 0)
    sock.close(0)
    ctx.term()


def _round(sock: Any, mode: str, chunks: int, grad: np.ndarray) -> float:
    t0 = time.perf_counter()
    sock.send(f"{mode} {chunks}".encode())
    if chunks == 1:
        sock.send(grad, copy=False)
        sock.recv(copy=False)
    elif mode == "multipart":
        sock.send_multipart(np.array_split(grad, chunks), copy=False)
        sock.recv_multipart(copy=False)
    else:
        for part in np.array_split(grad, chunks):
            sock.send(part, copy=False)
        sock.recv_multipart(copy=False)
    return time.perf_counter() - t0


def run(n: int, rounds: int, chunk_counts: list[int], warmup: int = 3,
        keep_heap: bool = False) -> dict[str, list[float]]:
    import zmq

    _keep_heap(keep_heap)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    server = ctx.Process(target=_server, args=(q, n, keep_heap), daemon=True)
    server.start()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PAIR)
    sock.connect(q.get(timeout=60))
    grad = np.random.default_rng(0).standard_normal(n).astype(np.float32) * 1e-3
    modes = [("raw", 1), ("whole", 1)] + [(m, k) for k in chunk_counts for m in ("raw", "multipart", "chunked")]
    times: dict[str, list[float]] = {_label(m, k): [] for m, k in modes}
    try:
        for r in range(warmup + rounds):
            for m, k in (modes if r % 2 == 0 else modes[::-1]):
                dt = _round(sock, m, k, grad)
                if r >= warmup:
                    times[_label(m, k)].append(dt)
        sock.send(b"stop")
    finally:
        server.join(30)
        if server.is_alive():
            server.kill()
        sock.close(0)
        zctx.term()
    return times


def _label(mode: str, chunks: int) -> str:
    return mode if chunks == 1 else f"{mode} {chunks}"



def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floats", type=int, default=10_000_000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--keep-heap", action="store_true",
                    help="both processes keep their freed heap, as the PS processes do (ps_common.heap)")
    args = ap.parse_args(argv)
    times = run(args.floats, args.rounds, args.chunks, keep_heap=args.keep_heap)
    raw = statistics.median(times["raw"])
    print(f"## One worker, one server, {args.floats * 4 / 1e6:.0f} MB up and down, loopback TCP, "
          f"{args.rounds} alternating rounds, "
          f"{'heap kept (ps_common.heap)' if args.keep_heap else 'glibc default heap'}\n")
    print("| mode | median ms | mean ms | p95 ms | throughput / raw (medians) |")
    print("|---|---|---|---|---|")
    for label, ts in times.items():
        ms = sorted(t * 1e3 for t in ts)
        p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
        print(f"| {label} | {statistics.median(ms):.1f} | {statistics.fmean(ms):.1f} | {p95:.1f} | "
              f"{raw / statistics.median(ts):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
