"""The summary's "final version" line: what it claims for the shards whose files it has."""

from ps_launcher.summary import _final_line


def _final(hashes: list[str], num_shards: int | None) -> dict:
    shards = [{"shard": k, "version": 7, "log_hash": h} for k, h in enumerate(hashes)]
    agree = len(set(hashes)) == 1
    return {"shards": shards, "agree": agree, "version": 7 if agree else None, "num_shards": num_shards}


def test_every_shards_file_present():
    assert _final_line(_final(["ab", "ab"], 2)) == "7, history ab, on 2 shards"


def test_a_hand_started_job_has_only_shard_zeros_file():
    line = _final_line(_final(["ab"], 3))
    assert line.startswith("7, history ab, on the 1 of 3 shards whose files are here")


def test_disagreement_and_nothing_saved():
    assert _final_line(_final(["ab", "cd"], 2)) == "SHARDS DISAGREE: 0: 7/ab, 1: 7/cd"
    assert _final_line(None) == "not saved"


def test_decision_time_in_the_summary():
    from ps_launcher.summary import _decision_lines, decision_stats

    coord = [{"duration": 0.1, "decision_s": 0.002, "decision_cpu_s": 0.001},
             {"duration": 0.1, "decision_s": 0.004, "decision_cpu_s": 0.001},
             {"duration": 0.1, "decision_s": 0.009, "decision_cpu_s": 0.004}]
    d = decision_stats(coord)
    assert d is not None
    assert d["median_s"] == 0.004 and d["p95_s"] == 0.009 and d["cpu_median_s"] == 0.001
    assert abs(d["mean_share"] - 0.05) < 1e-12 and abs(d["cpu_mean_share"] - 0.02) < 1e-12
    wall, cpu = _decision_lines(d)
    assert "4.000 / 5.000 / 9.000" in wall and "5.00% of an iteration" in wall
    assert "1.000 / 2.000 / 4.000" in cpu and "2.00% of an iteration" in cpu
    old = decision_stats([{"duration": 0.1, "decision_s": 0.002}])   # recorded before CPU times
    assert old is not None and "cpu_mean_s" not in old and len(_decision_lines(old)) == 1
    assert decision_stats([{"duration": 0.1}]) is None and _decision_lines(None) == []
