"""``ps-predict record``: a trace recorded under real CPU burners, which are all gone afterwards.
(The predictors themselves and ``ps-predict eval`` are in tests/unit/test_predictors.py.)"""

from __future__ import annotations

import numpy as np
import psutil

from predictors.cli import main
from predictors.traces import load_trace


def living_children() -> set[int]:
    return {c.pid for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE}


def test_cli_record_terminates_burners(tmp_path, capsys):
    before = living_children()        # the session's fork server, for one, is not the recorder's
    out = tmp_path / "rec.csv"
    rc = main(["record", str(out), "--iterations", "6", "--steps", "1", "--batch-size", "16",
               "--burn-schedule", "0:1,3:2"])
    assert rc == 0
    tr = load_trace(out)
    assert len(tr) == 6 and np.all(tr.speed > 0)
    assert np.all((tr.exog >= 0) & (tr.exog <= 100))
    assert not living_children() - before
    assert "wrote" in capsys.readouterr().out
