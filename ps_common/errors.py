"""The one base class of every error this project raises on purpose.

Each subclass also keeps the built-in type it always had (``ConfigError`` is a ``ValueError``,
``TransportTimeout`` a ``TimeoutError``...), so existing handlers still match; a command-line
tool catches :class:`PsError` for its clear-message exit path instead of listing every type.
"""

from __future__ import annotations


class PsError(Exception):
    """A problem the project detected and can describe: the message says what to do next."""


class UsageError(PsError, ValueError):
    """A flag, setting or model that cannot work, found where it is used (not by the config
    schema): a shard index beyond ``cluster.num_shards``, ``worker.device=cuda`` on a host
    without CUDA, a worker whose model is not the servers'."""
