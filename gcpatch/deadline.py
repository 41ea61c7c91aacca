"""Waiting for code gcpatch does not own (a third-party plugin's import or hook) no longer than a
deadline.

Python cannot stop a running function from outside, so the call runs in a daemon thread (with the
caller's context variables) and the caller waits for it at most `limit` seconds: past that it goes
on without the result, and the thread is left to finish or not (a daemon thread never holds up the
interpreter's exit). What it raised comes back to the caller, KeyboardInterrupt included. What a
call left behind gives or raises once its caller stopped waiting is dropped, said in a DEBUG line:
its plugin was already switched off with a line of its own.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from typing import Any, Callable

log = logging.getLogger("gcpatch")


class Outcome:
    """What a call under a deadline gave: its value or what it raised, or that it timed out."""

    __slots__ = ("value", "error", "timed_out")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.timed_out = False


def run(
    function: Callable[..., Any],
    kwargs: dict,
    limit: float,
    what: str = "a plugin's hook",
    thread_name: str = "gcpatch-plugin-hook",
) -> Outcome:
    """`function(**kwargs)` in a daemon thread, waited for at most `limit` seconds; `what` names
    it in the DEBUG line of a call that ends after its caller went on."""
    outcome = Outcome()
    context = contextvars.copy_context()
    lock = threading.Lock()  # the call's end against the caller's giving up: one of them is first
    settled = False

    def call() -> None:
        nonlocal settled
        value, error = None, None
        try:
            value = context.run(function, **kwargs)
        except BaseException as exc:  # noqa: BLE001 (handed to the waiting caller, which decides)
            error = exc
        with lock:
            late = outcome.timed_out
            if not late:
                outcome.value, outcome.error, settled = value, error, True
        if late:
            log.debug(
                "gcpatch: %s ended after its deadline; ignored: %s",
                what,
                f"it raised {error!r}" if error is not None else "its result",
            )

    thread = threading.Thread(target=call, name=thread_name, daemon=True)
    thread.start()
    thread.join(limit)
    with lock:
        if not settled:
            outcome.timed_out = True
    return outcome
