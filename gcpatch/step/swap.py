"""The layers' checkpointing switched for a measuring pass (gcpatch/step/selective.py: under a
lever, whole, offloaded): each checkpointed under a function made from its own, its own flag and
function back afterwards, whatever the pass raised."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

FLAG, FUNC = "gradient_checkpointing", "_gradient_checkpointing_func"
# the checkpoint's argument a selective policy (the user's, or a lever's) comes in
CONTEXT_FN = "context_fn"


@contextlib.contextmanager
def switched(layers: list[Any], make: list[Callable[[Any], Any] | None]) -> Iterator[None]:
    """Each layer with a `make` checkpointed under `make(its function)`; a layer whose `make` is
    None is left as it is."""
    saved = [(m, vars(m).get(FLAG), vars(m).get(FUNC)) for m in layers]
    try:
        for m, how in zip(layers, make):
            if how is not None:
                setattr(m, FUNC, how(getattr(m, FUNC, None)))
                setattr(m, FLAG, True)
        yield
    finally:
        for m, flag, func in saved:
            for name, value in ((FLAG, flag), (FUNC, func)):
                if value is None:
                    vars(m).pop(name, None)
                else:
                    setattr(m, name, value)
