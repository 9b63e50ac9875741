"""Frozen dataclasses built without their ``__init__``, where that is safe.

A frozen dataclass's ``__init__`` stores each field through ``object.__setattr__``: 3.4 µs for a
worker's report of 28 fields, and ``dataclasses.replace`` pays it again (6.5 µs). Shard 0 decodes
every worker's report and copies it once more to add the servers' finish time, every iteration.
For a class whose ``__init__`` does nothing but store its fields (no ``__post_init__``, no
default factories, no slots, every field defaulted and set by ``__init__``), filling the
instance's ``__dict__`` gives the same value: equal, hashable, still frozen.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping


def fillable(cls: type) -> bool:
    """Is ``cls`` a frozen dataclass whose ``__init__`` only stores its fields (no
    ``__post_init__``, no slots, every field set by ``__init__``)? Then a copy of an instance
    with some fields changed can be made with :func:`fill` from its ``__dict__``."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or hasattr(cls, "__post_init__") or "__slots__" in vars(cls):
        return False
    return all(f.init for f in dataclasses.fields(cls))


def plain_defaults(cls: type) -> dict[str, Any] | None:
    """Every field's default if ``cls`` is such a plain frozen dataclass, else None."""
    if not fillable(cls):
        return None
    fields = dataclasses.fields(cls)
    if any(f.default is dataclasses.MISSING for f in fields):
        return None
    return {f.name: f.default for f in fields}


def fill(cls: type, *states: Mapping[str, Any]) -> Any:
    """An instance of the plain frozen dataclass ``cls`` holding ``states`` merged in order (they
    must name every field, with values already checked). A copy from an instance's ``__dict__``
    also copies what the instance caches beside its fields (``Telemetry.row``): a copy that
    changes a field must change the cache too, as ``Telemetry.with_finish`` does."""
    obj: Any = object.__new__(cls)
    state = obj.__dict__
    for s in states:
        state.update(s)
    return obj
