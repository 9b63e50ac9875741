"""Data-plane throughput: push + pull of a 10M-float32 model through the parameter server,
against raw pyzmq zero-copy round trips of the same bytes on the same connections, side by side
in one run.

Every configuration runs real processes over loopback TCP: ps-server shards (1 or 2) and
1 or 2 client processes that each do BSP iterations of "push the whole gradient, get the whole
model back" (one Push with pull per shard) with no compute in between. The raw baseline has as
many ROUTER echo processes as there are shards; each client sends every echo its slice of the
same 40 MB and receives as much back (copy=False on both sides), so PS and raw use the same
number of connections. Throughput counts the bytes each client moves up and down.

The shard and client processes keep their freed heap, as ps-server and ps-worker do
(``ps_common.heap``: glibc otherwise maps every frame over 32 MB afresh and faults its pages in
on each receive). The raw baseline runs twice per repeat, with glibc's default heap and with
the heap kept the same way, so that the ratio against the latter compares the same allocator.

``--compute-ms T``: every client first computes for T ms of CPU (a busy loop, as a worker's
forward and backward) before each exchange, and only the exchange is timed: work a shard can do
before the gradients arrive (the momentum's decay) then overlaps the workers' compute, as in
training, instead of the next push as in the default back-to-back exchanges.

``--shard-threads N [N ...]``: the PS rows once per thread count of each shard's update
(``cluster.shard_threads``), against the same raw runs of each repeat; default 1, as ps-server.
More threads pay only where every shard has cores of its own. The shards' threads sleep between
updates, as ps-server's do (``OMP_WAIT_POLICY=PASSIVE``, ``ps_server/threads.py``), unless the
environment sets a policy or ``--spinning-threads`` leaves libgomp's default (spin after each step).

``--params-part-bytes B [B ...]``: the PS rows once per size of the parts each shard sends a
new version's slice in, each part as soon as the update has computed it
(``transport.params_part_bytes``; 0: the whole slice once the update is done, as before they
were streamed), against the same raw runs.

``--phases``: after the table, each shard's wall time per phase per iteration (its own record,
``ps_server.timings``: decoding, handling the push, the commit's update, answering, sending) and
its CPU, so the gap to raw can be placed.

    python benchmarks/bench_dataplane.py [--iters 15] [--warmup 3] [--repeats 3] [--no-update]
        [--compute-ms 0] [--shard-threads 1] [--spinning-threads] [--workers 1 2] [--shards 1 2]
        [--phases]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import zmq  # noqa: E402

from ps_common.config import TransportConfig, validate  # noqa: E402
from ps_ml.models import build_model, count_parameters  # noqa: E402

MODEL = "mlp10m"


def job(num_shards: int, num_workers: int, iterations: int, secret_dir: Path, shard_threads: int = 1,
        part_bytes: int | None = None):
    from ps_common.security.credentials import generate_master

    secret = secret_dir / "job.secret"
    generate_master(secret)
    return validate({
        "security": {"secret_file": str(secret)},
        "model": {"name": MODEL}, "data": {"dataset": "synthetic", "synthetic_train": 256},
        "training": {"global_batch": 64, "max_iterations": iterations},
        "optimizer": {"lr": 0.01, "momentum": 0.9},
        "cluster": {"num_shards": num_shards, "num_workers": num_workers, "shard_threads": shard_threads},
        "evaluator": {"enabled": False},
        **({} if part_bytes is None else {"transport": {"params_part_bytes": part_bytes}}),
    })


def _heap(kept: bool) -> None:
    """Keep this process's freed heap (ps_common.heap) when ``kept``."""
    if kept:
        from ps_common.heap import keep_freed_memory

        keep_freed_memory()


# ----- parameter server ------------------------------------------------------------------------
def _serve(cfg, shard: int, coordinator: str | None, q, no_update: bool = False, phases_q=None) -> None:
    from ps_server.server import ShardServer  # which keeps its heap (ps_common.heap)

    srv = ShardServer(cfg, shard, port=0, coordinator=coordinator)
    if no_update:  # diagnostic (--no-update): what the protocol and the barrier cost alone
        import ps_server.shard

        ps_server.shard.all_finite = lambda a: True  # type: ignore[assignment]

        def skip_update(params, grads, lr_scale=1.0, out=None, done=None, block=None):
            if out is not None:  # the new version's buffer: the parameters, unchanged
                np.copyto(out, params)
            if done is not None:
                done(params.size)  # every part may go: nothing is computed
            return params

        srv.state.optimizer.step_weighted = skip_update  # type: ignore[method-assign]
    q.put(srv.endpoint)
    cpu0 = time.process_time()
    srv.run()
    if phases_q is not None:  # --phases: the loop's own record (ps_server.timings) and every thread's CPU
        timings = srv.router.timings.as_dict()
        timings["process_cpu"] = {"s": time.process_time() - cpu0, "n": 1}
        phases_q.put((shard, timings))


def _compute(seconds: float) -> None:
    """Keep this process's CPU busy for ``seconds`` (a worker's forward and backward)."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _ps_client(cfg, endpoint: str, iters: int, warmup: int, q, compute_s: float = 0.0,
               index: int = 0) -> None:
    from ps_common.report import Telemetry
    from ps_worker.client import ShardClients

    _heap(kept=True)  # as a worker without a memory limit does

    c = ShardClients(zmq.Context.instance(), endpoint, timeout_s=120, connect_timeout_s=60,
                     security=cfg.security, role="worker")
    w = c.join(f"bench-{index}", cfg.job_digest(), "cpu")  # one name per live worker
    params = np.empty(w.num_params, dtype=np.float32)
    grads = np.random.default_rng(0).normal(scale=1e-3, size=w.num_params).astype(np.float32)
    res = c.pull(params, worker_id=w.worker_id, min_version=0)
    times = []
    while not res.stop:
        _compute(compute_s)
        t0 = time.perf_counter()
        res = c.push_pull(grads, params, worker_id=w.worker_id, assignment=res.assignment, loss=0.0,
                          telemetry=Telemetry())
        times.append(time.perf_counter() - t0)
    c.close()
    q.put(times[warmup:iters + warmup])


def run_ps(num_shards: int, num_workers: int, iters: int, warmup: int, no_update: bool = False,
           compute_s: float = 0.0, phases: list[dict] | None = None, shard_threads: int = 1,
           part_bytes: int | None = None) -> list[float]:
    """``phases``: gets each shard's per-phase record (:class:`ps_server.timings.Timings`), by shard."""
    with tempfile.TemporaryDirectory(prefix="lbps-bench-") as secret_dir:  # the job's secret, removed after
        cfg = job(num_shards, num_workers, iters + warmup, Path(secret_dir), shard_threads, part_bytes)
        return _run_ps(cfg, num_shards, num_workers, iters, warmup, no_update, compute_s, phases)


def _run_ps(cfg, num_shards: int, num_workers: int, iters: int, warmup: int, no_update: bool,
            compute_s: float, phases: list[dict] | None) -> list[float]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    pq = ctx.Queue() if phases is not None else None
    servers = [ctx.Process(target=_serve, args=(cfg, 0, None, q, no_update, pq))]
    servers[0].start()
    ep0 = q.get(timeout=120)
    for k in range(1, num_shards):
        p = ctx.Process(target=_serve, args=(cfg, k, ep0, q, no_update, pq))
        p.start()
        q.get(timeout=120)
        servers.append(p)
    rq = ctx.Queue()
    clients = [ctx.Process(target=_ps_client, args=(cfg, ep0, iters, warmup, rq, compute_s, i))
               for i in range(num_workers)]
    for p in clients:
        p.start()
    per_client = [rq.get(timeout=600) for _ in clients]
    if pq is not None and phases is not None:
        phases[:] = [t for _, t in sorted(pq.get(timeout=60) for _ in servers)]
    for p in clients + servers:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    # An iteration ends when the slowest client has its parameters back.
    return [max(ts) for ts in zip(*per_client)]


# ----- raw pyzmq baseline ------------------------------------------------------------------------
def _echo(nbytes: int, clients: int, rounds: int, q, kept: bool = False) -> None:
    _heap(kept)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    q.put(f"tcp://127.0.0.1:{port}")
    reply = np.ones(nbytes // 4, dtype=np.float32)
    for _ in range(rounds * clients):
        ident, frame = sock.recv_multipart(copy=False)
        np.frombuffer(frame.buffer, dtype=np.float32)  # a view, as the shard makes
        sock.send_multipart([ident, reply], copy=False)
    sock.close(linger=10_000)  # let the last 40 MB reply leave before the socket goes
    ctx.term()


def _raw_client(endpoints: list[str], nbytes: int, iters: int, warmup: int, q, compute_s: float = 0.0,
                kept: bool = False) -> None:
    _heap(kept)
    ctx = zmq.Context()
    socks = []
    for ep in endpoints:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(ep)
        socks.append(sock)
    payload = np.zeros(nbytes // 4, dtype=np.float32)
    out = np.empty_like(payload)
    bounds = np.linspace(0, payload.size, len(socks) + 1).astype(int)
    times = []
    for _ in range(iters + warmup):
        _compute(compute_s)
        t0 = time.perf_counter()
        for sock, a, b in zip(socks, bounds, bounds[1:]):
            sock.send(payload[a:b], copy=False)
        for sock, a, b in zip(socks, bounds, bounds[1:]):
            frame = sock.recv(copy=False)
            out[a:b] = np.frombuffer(frame.buffer, dtype=np.float32)  # the worker copies into its model
        times.append(time.perf_counter() - t0)
    for sock in socks:
        sock.close()
    ctx.term()
    q.put(times[warmup:])


def run_raw(nbytes: int, num_clients: int, num_servers: int, iters: int, warmup: int,
            compute_s: float = 0.0, kept: bool = False) -> list[float]:
    """``kept``: every raw process keeps its freed heap, as the PS processes do (ps_common.heap)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    per_server = nbytes // num_servers // 4 * 4
    servers = [ctx.Process(target=_echo, args=(per_server, num_clients, iters + warmup, q, kept))
               for _ in range(num_servers)]
    for srv in servers:
        srv.start()
    eps = [q.get(timeout=60) for _ in servers]
    rq = ctx.Queue()
    cl = [ctx.Process(target=_raw_client, args=(eps, per_server * num_servers, iters, warmup, rq, compute_s, kept))
          for _ in range(num_clients)]
    for p in cl:
        p.start()
    per = [rq.get(timeout=600) for _ in cl]
    for p in cl + servers:
        p.join(timeout=5)
        if p.is_alive():
            p.terminate()
    return [max(ts) for ts in zip(*per)]


def _range(xs: list[float], fmt: str) -> str:
    """median (min-max), or the value alone for one repeat."""
    med = statistics.median(xs)
    return fmt.format(med) if len(xs) == 1 else f"{fmt.format(med)} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3,
                    help="raw and PS runs per row, alternating (raw, PS, raw, PS, ...), so that the "
                         "machine's drift hits both alike; the table shows median (min-max)")
    ap.add_argument("--no-update", action="store_true",
                    help="diagnostic: shards skip the finiteness check and the update's arithmetic (the "
                         "parameters are copied unchanged into the new version's buffer), so the PS time "
                         "is the protocol's and the barrier's, and one copy")
    ap.add_argument("--compute-ms", type=float, default=0.0,
                    help="CPU-busy milliseconds each client spends before every exchange (not timed)")
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                    help="rows with these numbers of client processes")
    ap.add_argument("--shards", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                    help="rows with these numbers of shards (and raw echo processes)")
    ap.add_argument("--shard-threads", type=int, nargs="+", default=[1], metavar="N",
                    help="PS rows once per thread count of each shard's update (cluster.shard_threads)")
    ap.add_argument("--params-part-bytes", type=int, nargs="+", default=[None], metavar="B",
                    help="PS rows once per size of the parts a shard streams each new slice in "
                         "(transport.params_part_bytes; 0: whole, after the update); default: the config's")
    ap.add_argument("--spinning-threads", action="store_true",
                    help="leave libgomp's default wait policy to the shards, whose update threads then spin "
                         "after each step (ps-server sets OMP_WAIT_POLICY=PASSIVE: ps_server/threads.py)")
    ap.add_argument("--phases", action="store_true",
                    help="also print each shard's wall time per phase and its CPU, per iteration (the last "
                         "repeat of every row, warm-up included)")
    args = ap.parse_args(argv)
    if not args.spinning_threads:
        from ps_server.threads import sleep_between_updates

        sleep_between_updates()   # as ps-server does; the spawned processes inherit it
    compute_s = args.compute_ms / 1e3
    n = count_parameters(build_model(MODEL, seed=0))
    nbytes = n * 4
    print(f"model {MODEL}: {n:,} float32 parameters = {nbytes / 1e6:.1f} MB; "
          f"{args.iters} timed iterations after {args.warmup} warm-up, median per run; "
          f"{args.repeats} alternating repeats; loopback TCP"
          + ("; DIAGNOSTIC --no-update: shards skip the finiteness check and the update" if args.no_update else "")
          + (f"; each client computes {args.compute_ms:g} ms before every exchange (not timed)"
             if compute_s else "")
          + "\n")
    # Each row is printed once its repeats are done (a run cut short by a time limit keeps them).
    print("| workers | shards = raw connections | shard threads | answers in parts of | PS push+pull (ms) | "
          "raw pyzmq round trip (ms) | raw, heap kept (ms) | PS GB/s | raw, heap kept GB/s | PS / raw, heap kept "
          "| PS / raw |")
    print("|---|---|---|---|---|---|---|---|---|---|---|", flush=True)
    profiles: list[tuple[int, int, tuple[int, int | None], list[dict]]] = []
    for workers in args.workers:
        for shards in args.shards:
            raw, kept = [], []
            variants = [(t, b) for t in args.shard_threads for b in args.params_part_bytes]
            ps: dict[tuple[int, int | None], list[float]] = {v: [] for v in variants}
            shard_phases: dict[tuple[int, int | None], list[dict]] = {v: [] for v in variants}
            for _ in range(args.repeats):
                raw.append(statistics.median(run_raw(nbytes, workers, shards, args.iters, args.warmup, compute_s)))
                kept.append(statistics.median(run_raw(nbytes, workers, shards, args.iters, args.warmup, compute_s,
                                                      kept=True)))
                for v in variants:
                    ps[v].append(statistics.median(run_ps(shards, workers, args.iters, args.warmup, args.no_update,
                                                          compute_s, shard_phases[v] if args.phases else None, *v)))
            moved = 2 * nbytes * workers  # push + pull, per client
            for v in variants:
                ratios = [r / p for r, p in zip(raw, ps[v])]        # each repeat's runs, back to back
                kept_ratios = [r / p for r, p in zip(kept, ps[v])]
                print(f"| {workers} | {shards} | {v[0]} | {_parts(v[1])} | "
                      f"{_range([p * 1e3 for p in ps[v]], '{:.1f}')} | "
                      f"{_range([r * 1e3 for r in raw], '{:.1f}')} | {_range([r * 1e3 for r in kept], '{:.1f}')} | "
                      f"{moved / statistics.median(ps[v]) / 1e9:.2f} | {moved / statistics.median(kept) / 1e9:.2f} | "
                      f"{_range(kept_ratios, '{:.2f}')} | {_range(ratios, '{:.2f}')} |", flush=True)
                if args.phases:
                    profiles.append((workers, shards, v, shard_phases[v]))
    work = ("the shards skipped the finiteness check and the update (--no-update)" if args.no_update else
            "PS time includes the shard's finiteness check, weighted aggregation and SGD-with-momentum "
            "update of 10M parameters per iteration")
    print(f"\n{work}; raw is the same bytes echoed with no work, with glibc's default heap and with the "
          "heap kept as the PS processes keep it (ps_common.heap: frames over 32 MB are otherwise a fresh "
          "mmap each time). Each ratio is a repeat's raw / PS, run back to back, median (min-max).")
    for workers, shards, (threads, part_bytes), per_shard in profiles:
        print(phase_table(workers, shards, threads, per_shard, _parts(part_bytes)))
    return 0


def _parts(part_bytes: int | None) -> str:
    """The parts column: the streamed answers' part size, or whole answers."""
    size = TransportConfig().params_part_bytes if part_bytes is None else part_bytes
    return f"{size / 2**20:g} MiB" if size else "whole, after the update"


def phase_table(workers: int, shards: int, threads: int, per_shard: list[dict], parts: str = "") -> str:
    """Each shard's wall ms per phase and iteration (its commits), and its CPU: the loop's thread
    (``cpu_total``) and the whole process, ZeroMQ's I/O threads included (``process_cpu``)."""
    iterations = [max(1, t.get("commit", {}).get("n", 1)) for t in per_shard]
    names = sorted({k for t in per_shard for k in t}, key=lambda k: -max(t.get(k, {}).get("s", 0.0)
                                                                            for t in per_shard))
    lines = [f"\nshards' phases, {workers} worker(s), {shards} shard(s), {threads} thread(s) each, answers in "
             f"parts of {parts}: ms per iteration "
             f"({', '.join(f'shard {k}: {n} commits' for k, n in enumerate(iterations))})",
             "| phase | " + " | ".join(f"shard {k}" for k in range(len(per_shard))) + " |",
             "|---|" + "---|" * len(per_shard)]
    for name in names:
        cells = [f"{t[name]['s'] * 1e3 / n:.2f}" if name in t else "" for t, n in zip(per_shard, iterations)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
