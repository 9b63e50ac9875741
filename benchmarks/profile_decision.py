"""Where a decision's time goes inside a running process, from a py-spy sampling profile.

Why: a decision paced like a real run costs several times what it costs in a tight loop
(``bench_decision_cold.py``), and a profile of the tight loop shows the wrong costs. Sampling
the real shard 0 of ``bench_fleet.py`` with py-spy (a sampling profiler, not a dependency of the
project: ``pip install py-spy``) catches the decision where it runs. This reads py-spy's raw
output (``--format raw``: one line per distinct stack, then its sample count) and prints, for
the samples inside ``BatchSizeManager.assign``, each function's inclusive share.

    python benchmarks/bench_fleet.py --workers 4 --policies ema --iterations 700 &
    py-spy record -r 2000 --format raw --nonblocking -d 20 -p SHARD0_PID -o prof.txt
    python benchmarks/profile_decision.py prof.txt [--top 40] [--root BatchSizeManager.assign]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path


def shares(lines: list[str], root: str) -> tuple[int, int, list[tuple[str, int]]]:
    """(all samples, samples under ``root``, [(function, inclusive samples)] most first)."""
    total = inside = 0
    incl: collections.Counter[str] = collections.Counter()
    for line in lines:
        if not line.strip():
            continue
        stack, count_s = line.rsplit(" ", 1)
        count = int(count_s)
        total += count
        frames = stack.split(";")
        at = next((i for i, f in enumerate(frames) if f.startswith(root + " ")), None)
        if at is None:
            continue
        inside += count
        for fn in {re.sub(r":\d+\)$", ")", f) for f in frames[at:]}:   # once per stack
            incl[fn] += count
    return total, inside, incl.most_common()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("raw", type=Path, help="py-spy record --format raw output")
    ap.add_argument("--root", default="BatchSizeManager.assign", help="the function whose time is split")
    ap.add_argument("--top", type=int, default=40)
    args = ap.parse_args(argv)
    total, inside, rows = shares(args.raw.read_text().splitlines(), args.root)
    if not inside:
        print(f"no samples inside {args.root} (of {total})", file=sys.stderr)
        return 1
    print(f"{inside} of {total} samples inside {args.root} ({100 * inside / total:.1f}%); "
          "inclusive share of those, by function:\n")
    print("| share | function (file) |\n|---|---|")
    for fn, count in rows[: args.top]:
        print(f"| {100 * count / inside:.1f}% | {fn} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
