"""Calling a wrapped framework function as if from the user's own frame.

A wrapper adds Python frames between the user's code and the framework, so a warning the
framework raises with `stacklevel=2` (DDP's deprecated `broadcast_buffers`, torch's "pass
use_reentrant explicitly") would name gcpatch as its source. The original is therefore called
through a one-line trampoline whose code carries the caller's file and line and whose globals are
the caller's module: the warning names the caller the framework meant, with that module's
warning registry and filters. In a traceback the trampoline shows as `<gcpatch>` at the user's line.
"""

from __future__ import annotations

import sys
import types
from typing import Any, Callable

_CODE = compile(
    "lambda function, args, kwargs: function(*args, **kwargs)", "<gcpatch>", "eval"
).co_consts[0]
_PREFIXES = ("gcpatch", "gcpatch_plugins", "wrapt")
_trampolines: dict[tuple[int, str, int], Callable[..., Any]] = {}


def user_frame(depth: int = 1) -> types.FrameType | None:
    """The nearest frame, `depth` above the caller's, that is not gcpatch's or wrapt's."""
    frame = sys._getframe(depth + 1)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PREFIXES):
        frame = frame.f_back
    return frame


def call_from(
    frame: types.FrameType | None, function: Callable[..., Any], args: tuple, kwargs: dict
) -> Any:
    """`function(*args, **kwargs)`, one frame below a trampoline that stands for `frame`."""
    if frame is None:
        return function(*args, **kwargs)
    key = (id(frame.f_globals), frame.f_code.co_filename, frame.f_lineno)
    trampoline = _trampolines.get(key)
    if trampoline is None:
        code = _CODE.replace(
            co_filename=frame.f_code.co_filename, co_firstlineno=frame.f_lineno, co_name="<gcpatch>"
        )
        trampoline = types.FunctionType(code, frame.f_globals)
        if (
            len(_trampolines) < 4096
        ):  # call sites are few; a bound keeps a generated-code storm cheap
            _trampolines[key] = trampoline
    return trampoline(function, args, kwargs)
