"""A short real ``ps-compare`` run produces the table, the CSV and the PNG plots."""

from __future__ import annotations

import csv
import subprocess
import sys

import pytest
import yaml

pytestmark = pytest.mark.system


def test_ps_compare_writes_report(tmp_path):
    cfg = {
        "run": {"name": "cmp-test", "seed": 4},
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "synthetic_train": 1024, "synthetic_test": 256},
        "training": {"global_batch": 48, "max_iterations": 40, "target_accuracy": 0.5},
        "cluster": {"num_shards": 1, "num_workers": 2},
        "evaluator": {"every_iterations": 10},
        "scenario": {"name": "static-1-3", "slowdowns": [1, 3]},
        "compare": {"repeats": 2, "modes": [
            {"name": "BSP", "set": {"mode.sync": "bsp"}},
            {"name": "backup b=1", "set": {"mode.sync": "backup", "mode.backup_workers": 1}},
        ]},
    }
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "report"
    res = subprocess.run([sys.executable, "-m", "ps_launcher.compare_cli", str(path), "--out", str(out),
                          "--no-progress"], capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "| BSP |" in res.stdout and "| backup b=1 |" in res.stdout
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert [(r["mode"], r["repeat"], r["seed"]) for r in rows] == [
        ("BSP", "0", "4"), ("backup b=1", "0", "4"), ("BSP", "1", "5"), ("backup b=1", "1", "5")]
    assert all(float(r["final_accuracy"]) > 0.5 for r in rows)
    assert all(0 < float(r["decision_cpu_ms"]) < 1000 and 0 < float(r["decision_cpu_share"]) < 1 for r in rows)
    report = (out / "report.md").read_text()
    assert "EMULATED" in report and "static-1-3" in report
    assert "batch-size decision: CPU ms (% of an iteration)" in report
    for png in ("accuracy_vs_time.png", "iteration_time.png", "batch_size.png"):
        data = (out / png).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, png


def test_ps_compare_rejects_bad_mode_before_running(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({
        "training": {"max_iterations": 5},
        "compare": {"modes": [{"name": "x", "set": {"mode.sync": "nope"}}]}}))
    res = subprocess.run([sys.executable, "-m", "ps_launcher.compare_cli", str(path)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "mode.sync" in res.stderr and "'x'" in res.stderr


@pytest.mark.timeout(300)
def test_sigterm_stops_ps_compare_with_the_completed_runs_reported(tmp_path):
    """SIGTERM (what Slurm, Kubernetes and systemd send) in the middle of the second run: that
    run is stopped and gathered, no further run starts, the report holds the first, and no
    process of the comparison is left."""
    import os
    import signal
    import time

    import psutil

    cfg = {
        "run": {"name": "cmp-term", "seed": 4},
        "model": {"name": "mlp"},
        "data": {"dataset": "synthetic", "synthetic_train": 1024, "synthetic_test": 256},
        "training": {"global_batch": 48, "max_iterations": 20},
        "cluster": {"num_shards": 1, "num_workers": 2},
        "evaluator": {"every_iterations": 10},
        "compare": {"repeats": 2, "modes": [
            {"name": "short", "set": {"mode.sync": "bsp"}},
            {"name": "long", "set": {"mode.sync": "bsp", "training.max_iterations": 10**6,
                                     "training.max_seconds": 240}},
        ]},
    }
    path = tmp_path / "cmp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = tmp_path / "report"
    proc = subprocess.Popen([sys.executable, "-m", "ps_launcher.compare_cli", str(path), "--out", str(out),
                             "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        records = out / "runs" / "long-r0" / "metrics" / "coordinator.jsonl"
        deadline = time.monotonic() + 180
        while not (records.exists() and records.stat().st_size > 0):
            assert proc.poll() is None and time.monotonic() < deadline, "the long run never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, err
    assert "interrupted after 1 of 4 runs" in err
    rows = list(csv.DictReader(open(out / "runs.csv")))
    assert [r["mode"] for r in rows] == ["short"]
    assert "| short |" in (out / "report.md").read_text()
    assert not (out / "runs" / "short-r1").exists(), "a run started after the SIGTERM"
    left = [p.pid for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not left, f"processes of the comparison still running: {left}"
