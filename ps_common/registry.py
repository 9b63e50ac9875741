"""Named entries of one kind, found by name: sync policies, batch policies, predictors, models.

One helper for every registry, so each says the same things the same way: a name registered
twice is refused (``<kind> 'x' is already registered``), an unknown name lists the known ones
(``unknown <kind> 'x'; known: a, b, c``), and building an entry with arguments it does not take
names the entry (``<kind> 'x': bad arguments {...}``). Adding a mode, a policy, a predictor or a
model is adding one entry; whatever lists or validates the names reads them from here.

It lives at the bottom layer because it knows nothing of what it holds: the registries
themselves live with their entries (``ps_server.sync``, ``batchsize_manager.policies``, ...).
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Entries of one ``kind`` by name.

    With ``base``, entries must be subclasses of it, and registering one sets its ``name``
    attribute to the registered name (so an instance can say what it is).
    """

    def __init__(self, kind: str, base: type | None = None) -> None:
        self.kind = kind
        self.base = base
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator adding an entry under ``name``; a name already taken is refused."""

        def decorator(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            if self.base is not None:
                if not (isinstance(entry, type) and issubclass(entry, self.base)):
                    raise TypeError(f"{self.kind} {name!r} must be a {self.base.__name__} subclass")
                entry.name = name  # type: ignore[attr-defined]
            self._entries[name] = entry
            return entry

        return decorator

    def unregister(self, name: str) -> None:
        """Remove an entry (a test's or a plug-in's own); unknown names are ignored."""
        self._entries.pop(name, None)

    def get(self, name: str) -> T:
        """The entry registered as ``name``; an unknown name raises ``ValueError`` listing the known."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}") from None

    def create(self, name: str, **args: Any) -> Any:
        """Call the entry ``name`` with ``args`` (build a policy or predictor from its settings).

        Arguments it does not take, and a ``ValueError`` it raises, come back as ``ValueError``
        naming the entry, so a typo in a config says which entry to fix."""
        entry = self.get(name)
        try:
            return entry(**args)  # type: ignore[operator]
        except TypeError as exc:  # an unexpected or missing keyword
            raise ValueError(f"{self.kind} {name!r}: bad arguments {args}: {exc}") from None
        except ValueError as exc:
            msg = str(exc)
            raise ValueError(msg if msg.startswith(name) else f"{self.kind} {name!r}: {msg}") from None

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def __len__(self) -> int:
        return len(self._entries)
