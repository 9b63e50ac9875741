"""The one exception type of the heterogeneity lab.

Callers (the launcher, tests) need to tell "this machine cannot do it" apart from bugs, so every
missing or failing mechanism raises :class:`LabUnavailable` with a sentence a user can act on.
"""

from __future__ import annotations

from ps_common.errors import PsError


class LabError(PsError, RuntimeError):
    """Base class: a lab mechanism failed (a command or a kernel interface refused)."""


class LabUnavailable(LabError):
    """A mechanism is missing or not usable here; ``reason`` says why (not root, no controller)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason
