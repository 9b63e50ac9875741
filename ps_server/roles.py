"""Which role may send which message to a shard (checked on every message by the router loop).

The role is what the connection authenticated as in the ZeroMQ handshake: the job secret's
role (PLAIN) or the CURVE key's role. On top of it, a worker's messages carry its membership
token (it proves *which* worker), and shard control messages only ever come from the ``shard``
role. Nothing an anonymous client can do reaches a handler: it cannot even connect.
"""

from __future__ import annotations

from ps_common import protocol as P

ANY = frozenset({"shard", "worker", "evaluator", "operator"})

SHARD_PERMISSIONS: dict[type[P.Message], frozenset[str]] = {
    P.Hello: ANY,
    P.StatusRequest: ANY,
    P.Join: frozenset({"worker", "evaluator"}),
    P.Heartbeat: frozenset({"worker"}),
    P.Leave: frozenset({"worker"}),
    P.Push: frozenset({"worker"}),
    P.OutOfMemory: frozenset({"worker"}),
    P.TakeChunk: frozenset({"worker"}),
    P.Pull: frozenset({"worker", "evaluator", "operator"}),
    P.EvalReport: frozenset({"evaluator"}),
    P.Shutdown: frozenset({"operator"}),
    P.ClaimShard: frozenset({"shard"}),
    P.RegisterShard: frozenset({"shard"}),
    P.Have: frozenset({"shard"}),
    P.ShardSync: frozenset({"shard"}),
    P.Rollback: frozenset({"shard"}),  # a restarted coordinator to a follower's own socket
}
