"""What lives as long as one activation, and the one path that ends it.

Every module whose state must not outlive `gcpatch.deactivate()` (cached call outcomes, plans,
models already verified, lines already said) registers its `reset` here with `@activation`;
`engine.stop()` runs them all, so `deactivate(); activate()` starts as a fresh process would.
What lives as long as the process is listed, with why, in tests/unit/test_state.py.
"""

from __future__ import annotations

import logging
from typing import Callable

_resets: list[Callable[[], None]] = []


def activation(reset: Callable[[], None]) -> Callable[[], None]:
    """Register a module's `reset` (a decorator); it runs at every `reset_all()`."""
    if reset not in _resets:
        _resets.append(reset)
    return reset


def reset_all() -> None:
    """Run every registered reset; one that fails is said in one line and the others still run."""
    for reset in list(_resets):
        try:
            reset()
        except Exception as exc:  # noqa: BLE001 (fail open: the other resets still run)
            logging.getLogger("gcpatch").error(
                "gcpatch: resetting %s failed (%s: %s)",
                getattr(reset, "__module__", "?"),
                type(exc).__name__,
                exc,
            )


def registered() -> list[str]:
    """The modules whose state an activation owns (what tests check against the listed names)."""
    return [reset.__module__ for reset in _resets]
