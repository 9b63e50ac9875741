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
