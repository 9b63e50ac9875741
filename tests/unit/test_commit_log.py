"""The coordinator's log of recent commits, which lets it catch followers up and check the
history hash a follower's beat or an evaluator's report names."""

from __future__ import annotations

from ps_common import protocol as P
from ps_server.control import COMMIT_LOG, Followers


def test_the_commit_log_knows_the_hash_just_before_its_oldest_commit():
    """Also once the log is full and drops its oldest commits, and not after a restore clears it."""
    followers = Followers(lambda _ident, _msg: True)
    prev = "genesis"
    hashes = {0: prev}
    for v in range(1, COMMIT_LOG + 6):
        commit = P.Commit(version=v, iteration=v - 1, log_hash=f"h{v}")
        followers.broadcast(commit, prev_hash=prev)
        hashes[v], prev = commit.log_hash, commit.log_hash
    oldest = followers.log[0].version
    assert oldest == 6
    assert followers.hash_of(oldest - 1) == hashes[oldest - 1]
    assert followers.hash_of(oldest - 2) is None
    assert all(followers.hash_of(v) == hashes[v] for v in range(oldest, COMMIT_LOG + 6))
    followers.clear_log()
    assert followers.hash_of(oldest - 1) is None
    followers.broadcast(P.Commit(version=70, iteration=69, log_hash="h70"), prev_hash="h69")
    assert followers.hash_of(69) == "h69" and followers.hash_of(70) == "h70"
    assert followers.hash_of(68) is None
