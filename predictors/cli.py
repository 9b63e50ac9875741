"""``ps-predict``: evaluate predictors on speed traces, and record real traces.

    ps-predict eval TRACE... [--predictors last,ema,arima,narx] [--warmup 10] [--param narx.hidden=20]
    ps-predict record OUT.csv [--iterations 300] [--seed 0] [--burn-schedule random|0:0,50:2,...]

``eval`` accepts trace CSVs and worker metrics files (``*.jsonl``, converted on the fly) and prints a
Markdown table (one row per predictor and trace, plus a pooled "all traces" row per predictor).
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import sys
from pathlib import Path
from typing import Any

from predictors.base import predictor_names
from ps_common.errors import PsError

log = logging.getLogger(__name__)


def _parse_params(items: list[str]) -> dict[str, dict[str, Any]]:
    """``["narx.hidden=20", "arima.order=(1,1,1)"]`` -> ``{"narx": {"hidden": 20}, ...}``."""
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        name, dot, hp = key.partition(".")
        if not sep or not dot or not name or not hp:
            raise ValueError(f"bad --param {item!r}; expected PREDICTOR.KEY=VALUE")
        try:
            value: Any = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw  # a bare word such as target=level
        out.setdefault(name, {})[hp] = value
    return out


def _load(path: str) -> Any:
    from predictors.traces import load_trace, trace_from_worker_metrics

    return trace_from_worker_metrics(path) if path.endswith(".jsonl") else load_trace(path)


def _cmd_eval(args: argparse.Namespace) -> int:
    from predictors.evaluate import evaluate_many, format_table

    names = [n.strip() for n in args.predictors.split(",") if n.strip()]
    unknown = [n for n in names if n not in predictor_names()]
    if unknown:
        print(f"unknown predictor(s) {unknown}; known: {', '.join(predictor_names())}", file=sys.stderr)
        return 2
    params = _parse_params(args.param)
    traces = [_load(p) for p in args.traces]
    if args.torch_threads > 0:
        import torch

        torch.set_num_threads(args.torch_threads)  # this CLI owns its process
    results = evaluate_many(names, traces, warmup=args.warmup, params=params)
    print(format_table(results))
    return 0


def _cmd_record(args: argparse.Namespace) -> int:
    from predictors.record import parse_schedule, random_schedule, record_trace, schedule_to_text
    from predictors.traces import save_trace

    if args.burn_schedule == "random":
        schedule = random_schedule(args.iterations, args.seed, args.max_burners, args.switch_min,
                                   args.switch_max)
    else:
        schedule = parse_schedule(args.burn_schedule)
    print(f"schedule (iteration:burners): {schedule_to_text(schedule)}", flush=True)

    def progress(it: int, speed: float, burners: int) -> None:
        if (it + 1) % 50 == 0:
            print(f"  iteration {it + 1}/{args.iterations}: {speed:.0f} samples/s, {burners} burners",
                  flush=True)

    out = Path(args.out)
    trace = record_trace(args.iterations, schedule, seed=args.seed, batch_size=args.batch_size,
                         steps_per_iteration=args.steps, pin=not args.no_pin, name=out.stem,
                         progress=progress)
    save_trace(trace, out)
    s = trace.speed
    print(f"wrote {out} ({len(trace)} iterations, {out.stat().st_size} bytes): speed min "
          f"{s.min():.0f}, median {float(sorted(s)[len(s) // 2]):.0f}, max {s.max():.0f} samples/s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ps-predict", description=__doc__.split("\n")[0])
    ap.add_argument("--log-level", default=os.environ.get("LBBSP_LOG_LEVEL", "WARNING"))
    sub = ap.add_subparsers(dest="cmd", required=True)

    ev = sub.add_parser("eval", help="one-step RMSE/MAPE of predictors on traces")
    ev.add_argument("traces", nargs="+", help="trace CSVs or worker metrics .jsonl files")
    ev.add_argument("--predictors", default="last,ema,arima,narx",
                    help=f"comma-separated; known: {', '.join(predictor_names())}")
    ev.add_argument("--warmup", type=int, default=10, help="unscored first points per trace")
    ev.add_argument("--param", action="append", default=[], metavar="PREDICTOR.KEY=VALUE",
                    help="hyper-parameter, e.g. narx.hidden=20 or arima.order=(1,1,1)")
    ev.add_argument("--torch-threads", type=int, default=1,
                    help="torch threads for this process (0: leave torch's default)")
    ev.set_defaults(func=_cmd_eval)

    rec = sub.add_parser("record", help="record a real trace under CPU burners")
    rec.add_argument("out", help="output CSV")
    rec.add_argument("--iterations", type=int, default=300)
    rec.add_argument("--seed", type=int, default=0)
    rec.add_argument("--burn-schedule", default="random",
                     help="'random' (seeded) or ITERATION:BURNERS,... e.g. 0:0,50:2,120:1")
    rec.add_argument("--max-burners", type=int, default=2)
    rec.add_argument("--switch-min", type=int, default=20, help="shortest random segment")
    rec.add_argument("--switch-max", type=int, default=60, help="longest random segment")
    rec.add_argument("--batch-size", type=int, default=64)
    rec.add_argument("--steps", type=int, default=3, help="SGD steps per recorded iteration")
    rec.add_argument("--no-pin", action="store_true",
                     help="do not pin the trainer and burners to one core")
    rec.set_defaults(func=_cmd_record)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        return int(args.func(args))
    except (PsError, ValueError, OSError) as e:
        print(f"ps-predict: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
