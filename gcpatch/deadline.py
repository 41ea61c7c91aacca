"""Waiting for code gcpatch does not own (a third-party plugin's hook) no longer than a deadline.

Python cannot stop a running function from outside, so the call runs in a daemon thread (with the
caller's context variables) and the caller waits for it at most `limit` seconds: past that it goes
on without the result, and the thread is left to finish or not (a daemon thread never holds up the
interpreter's exit). What it raised comes back to the caller, KeyboardInterrupt included.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, Callable


class Outcome:
    """What a call under a deadline gave: its value or what it raised, or that it timed out."""

    __slots__ = ("value", "error", "timed_out")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.timed_out = False


def run(function: Callable[..., Any], kwargs: dict, limit: float) -> Outcome:
    """`function(**kwargs)` in a daemon thread, waited for at most `limit` seconds."""
    outcome = Outcome()
    context = contextvars.copy_context()

    def call() -> None:
        try:
            outcome.value = context.run(function, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting caller, which decides)
            outcome.error = exc

    thread = threading.Thread(target=call, name="gcpatch-plugin-hook", daemon=True)
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        outcome.timed_out = True
    return outcome
