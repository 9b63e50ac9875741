"""Who may talk to a shard: role credentials, CURVE keys and the server's ZAP authenticator.

Every connection to a shard authenticates as a role (``shard``, ``worker``, ``evaluator``,
``operator``), with the job secret (PLAIN) or with CURVE keys (encryption plus an allow-list
of client keys); ZAP tells the server each message's role. One module per job:

- :mod:`~ps_common.security.settings`: the ``security:`` config section and what each role needs;
- :mod:`~ps_common.security.credentials`: job secret files and the role secrets derived from them;
- :mod:`~ps_common.security.keys`: CURVE key files (zmq certificates) and the role a file name grants;
- :mod:`~ps_common.security.authenticator`: the ZAP handler of a context and the allow-list it reads;
- :mod:`~ps_common.security.sockets`: what the transport calls to secure a ROUTER or a DEALER.

``ps-keys`` (:mod:`ps_launcher.keys_cli`) makes secrets and key files. With no credentials
configured every helper is a no-op, so the transport calls them unconditionally.

Multi-host deployment with CURVE
--------------------------------
1. One server key pair shared by all shards: ``ps-keys generate keys server`` once; copy
   ``server.key_secret`` (secretly, mode 0600) to every server host and ``server.key`` (public,
   not secret) to every host that runs a client.
2. One key pair per client process kind and host: worker, evaluator, launcher
   (``ps-keys generate keys worker-hostA`` ...). Each secret file stays on its own host.
3. Copy every client's public ``.key`` file into ``allowed_clients_dir`` on **every** server
   host (only files ending in ``.key`` are read; secret files there are ignored). The directory
   is re-read when it changes, so a worker added between iterations needs no server restart;
   removing a file refuses *new* connections from that key (open ones stay up). A refused
   client sees only silence (its request times out) and libzmq does not retry a refused
   handshake on that socket: it must dial again with a new socket once its key is allowed.
4. Per-host settings, e.g. through the environment::

       # server hosts
       LBBSP__SECURITY__CURVE=true
       LBBSP__SECURITY__SERVER_SECRET_KEY=/etc/lbbsp/server.key_secret
       LBBSP__SECURITY__ALLOWED_CLIENTS_DIR=/etc/lbbsp/allowed
       # client hosts
       LBBSP__SECURITY__CURVE=true
       LBBSP__SECURITY__SERVER_PUBLIC_KEY=/etc/lbbsp/server.key
       LBBSP__SECURITY__CLIENT_SECRET_KEY=/etc/lbbsp/worker-hostA.key_secret

Shards are also clients of each other (registration with shard 0, shard-to-shard links). A shard
with no ``client_secret_key`` dials with the shared *server* key pair, and the servers' own
public key is always allowed, so shard hosts need nothing beyond the server settings. Likewise
a client with no ``server_public_key`` takes it from ``server_secret_key`` when set.

Security settings are per host and are *not* part of the job digest.
"""
