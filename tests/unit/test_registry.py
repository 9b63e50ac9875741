"""The one registry helper behind sync policies, batch policies, predictors and models."""

from __future__ import annotations

import pytest

from batchsize_manager import BATCH_POLICIES
from predictors.base import PREDICTOR_REGISTRY
from ps_common.registry import Registry
from ps_ml.models import MODEL_REGISTRY
from ps_server.sync import SYNC_POLICIES


class Base:
    name = ""

    def __init__(self, size: int = 1) -> None:
        if size < 1:
            raise ValueError("size must be >= 1")
        self.size = size


def test_register_get_create_and_names():
    r: Registry[type[Base]] = Registry("widget", base=Base)

    @r.register("b")
    class B(Base):
        pass

    @r.register("a")
    class A(Base):
        pass

    assert r.names() == ["a", "b"] and list(r) == ["a", "b"] and len(r) == 2 and "a" in r
    assert r.get("a") is A and A.name == "a", "a registered class knows its name"
    assert r.create("b", size=3).size == 3
    with pytest.raises(ValueError, match="^unknown widget 'c'; known: a, b$"):
        r.get("c")
    with pytest.raises(ValueError, match="^widget 'a' is already registered$"):
        r.register("a")(A)
    with pytest.raises(ValueError, match=r"^widget 'a': bad arguments \{'colour': 1\}"):
        r.create("a", colour=1)
    with pytest.raises(ValueError, match="^widget 'a': size must be >= 1$"):
        r.create("a", size=0)
    with pytest.raises(TypeError, match="must be a Base subclass"):
        r.register("x")(int)
    r.unregister("b")
    assert r.names() == ["a"]


@pytest.mark.parametrize("registry, kind", [(SYNC_POLICIES, "sync policy"), (BATCH_POLICIES, "batch policy"),
                                            (PREDICTOR_REGISTRY, "predictor"), (MODEL_REGISTRY, "model")])
def test_every_registry_says_the_same_things(registry, kind):
    first = registry.names()[0]
    with pytest.raises(ValueError, match=f"^unknown {kind} 'nope'; known: {', '.join(registry.names())}$"):
        registry.get("nope")
    with pytest.raises(ValueError, match=f"^{kind} '{first}' is already registered$"):
        registry.register(first)(registry.get(first))
