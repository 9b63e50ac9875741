"""Measure what the heterogeneity lab really delivers; prints markdown tables for docs/lab.md.

    sudo .venv/bin/python benchmarks/bench_lab.py [--quick]

- tbf rate limits: TCP throughput upload and download through a shaped host (plus unshaped);
- relay delays: median TCP RTT of 32-byte request/replies, and bulk throughput through the relay;
- CPU quotas: the CPU fraction a busy process gets at each quota.
"""

from __future__ import annotations

import argparse
import json
import select
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import psutil  # noqa: E402

from ps_launcher.lab import probe  # noqa: E402
from ps_launcher.lab.cgroups import CpuQuotaGroup, cpu_quota_available  # noqa: E402
from ps_launcher.lab.netns import Host, NetLab, delay_available, netns_available  # noqa: E402

PROBE = probe.__file__
PORT = 5801


def _client(h: Host, *args: str) -> dict:
    cp = h.run([sys.executable, PROBE, *args], capture_output=True, text=True, timeout=120)
    if cp.returncode:
        raise RuntimeError(cp.stderr)
    return json.loads(cp.stdout)


def _bulk(h: Host, srv: Host, direction: str, nbytes: int) -> float:
    return _client(h, "bulk", srv.ip, "--port", str(PORT), "--direction", direction,
                   "--bytes", str(nbytes))["mbit_s"]  # fmt: skip


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def bench_net(quick: bool) -> None:
    why = netns_available()
    if why:
        print(f"network lab unavailable: {why}\n")
        return
    reps = 1 if quick else 3
    with NetLab() as lab:
        srv = lab.add_host("server")
        p = srv.popen([sys.executable, PROBE, "serve", "--port", str(PORT)],
                      stdout=subprocess.PIPE, text=True)  # fmt: skip
        select.select([p.stdout], [], [], 10)
        assert p.stdout.readline().strip() == "listening"
        h = lab.add_host("client")

        print("### tbf rate limit: TCP throughput (Mbit/s, median of %d transfers)\n" % reps)
        print("| configured | upload | download | transfer size |")
        print("|---:|---:|---:|---:|")
        for rate in (10, 20, 50, 100, 500, None):
            h.set_rate(rate)
            nbytes = 200 << 20 if rate is None else max(2 << 20, int(rate * 1e6 / 8 * 2.0))
            up = _median([_bulk(h, srv, "up", nbytes) for _ in range(reps)])
            down = _median([_bulk(h, srv, "down", nbytes) for _ in range(reps)])
            label = "unshaped" if rate is None else f"{rate} Mbit/s"
            print(f"| {label} | {up:.1f} | {down:.1f} | {nbytes / 2**20:.1f} MiB |")
        print()

        why = delay_available()
        if why:
            print(f"delay relay unavailable: {why}\n")
            return
        print("### relay delay: TCP round trip of 32-byte request/reply (ms, 30 exchanges)\n")
        print("| one-way delay set | expected RTT | median RTT | min | max |")
        print("|---:|---:|---:|---:|---:|")
        for d in (0, 0.001, 10, 20, 50):
            h.set_delay(d)
            r = _client(h, "rtt", srv.ip, "--port", str(PORT), "--count", "30")
            label = "none (no relay)" if d == 0 else ("relay, 0" if d < 1 else f"{d} ms")
            print(f"| {label} | {2 * d:g} | {r['rtt_ms_median']:.2f} | {r['rtt_ms_min']:.2f} "
                  f"| {r['rtt_ms_max']:.2f} |")  # fmt: skip
        print()
        print("### throughput through the relay (Mbit/s, unshaped unless stated)\n")
        print("| relay delay | rate limit | upload | download |")
        print("|---:|---:|---:|---:|")
        for d, rate in ((0.001, None), (10, None), (20, None), (20, 20), (20, 100)):
            h.set_delay(d)
            h.set_rate(rate)
            nbytes = 100 << 20 if rate is None else max(4 << 20, int(rate * 1e6 / 8 * 2.0))
            up = _median([_bulk(h, srv, "up", nbytes) for _ in range(reps)])
            down = _median([_bulk(h, srv, "down", nbytes) for _ in range(reps)])
            print(f"| {d:g} ms | {rate or 'none'} | {up:.1f} | {down:.1f} |")
        print()


def bench_cpu(quick: bool) -> None:
    why = cpu_quota_available()
    if why:
        print(f"CPU quotas unavailable: {why}\n")
        return
    wall = 1.5 if quick else 3.0
    print(f"### CPU quota: fraction of a core a busy loop gets (over {wall:g} s)\n")
    print("| quota | psutil CPU time / wall | cgroup usage / wall | throttled periods |")
    print("|---:|---:|---:|---:|")
    burner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with CpuQuotaGroup("bench") as g:
            g.add(burner.pid)
            for f in (0.1, 0.25, 0.5, 0.75, 1.0, None):
                g.set_fraction(f)
                time.sleep(0.3)
                proc = psutil.Process(burner.pid)
                c0, u0, th0 = sum(proc.cpu_times()[:2]), g.usage_s(), g.throttled()
                t0 = time.monotonic()
                time.sleep(wall)
                c1, u1, th1 = sum(proc.cpu_times()[:2]), g.usage_s(), g.throttled()
                t1 = time.monotonic()
                dt = t1 - t0
                usage = "n/a" if u0 is None or u1 is None else f"{(u1 - u0) / dt:.3f}"
                n = th1.nr_periods - th0.nr_periods
                thr = th1.nr_throttled - th0.nr_throttled
                print(f"| {f if f is not None else 'unlimited'} | {(c1 - c0) / dt:.3f} | {usage} "
                      f"| {thr}/{n} |")  # fmt: skip
    finally:
        burner.kill()
        burner.wait()
    print()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repeat, shorter windows")
    a = ap.parse_args()
    print(f"machine: {psutil.cpu_count()} cores, kernel {subprocess.getoutput('uname -r')}\n")
    bench_cpu(a.quick)
    bench_net(a.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main())
