"""The curried checkpoint of torch 2.14 and later: `checkpoint(use_reentrant=True)(function)`, and
its decorator form `@checkpoint(use_reentrant=False)`.

torch's wrapper (`_CheckpointedFunction` in torch/utils/checkpoint.py) calls the implementation
directly, past the patched `checkpoint`, so without this a call made that way met no rule: after a
frozen embedding its reentrant call dropped the block's gradients as plainly. Each call of the
wrapped function is made as the direct call `checkpoint(function, *args, **options, **kwargs)`,
through `torch.utils.checkpoint.checkpoint` as it stands at that call: decided while gcpatch is
active, torch's own after a `gcpatch.deactivate()`. Where the function's own keywords share a name
with one of checkpoint's, the direct call would read them as checkpoint's: that call runs as
torch's own wrapper runs it, said once.
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Any, Callable

from gcpatch import lifetime

log = logging.getLogger("gcpatch")


def curry(original: Callable[..., Any], options: dict, names: frozenset) -> Any:
    """What `checkpoint(**options)` returns, made by torch itself (it checks the options; a torch
    without the curried form raises as it does plainly), wrapped so that each function it is
    applied to makes its calls as direct ones."""
    made = original(**options)
    if not callable(made):
        return made

    def apply(function: Callable[..., Any]) -> Routed:
        return Routed(function, made(function), options, names)

    return apply


class Routed:
    """A function wrapped by a curried checkpoint: called, it is checkpointed as decided; read off
    an instance (the decorator on a method), it binds as torch's wrapper does."""

    def __init__(
        self, function: Callable[..., Any], own: Callable[..., Any], options: dict, names: frozenset
    ) -> None:
        self.function, self.own, self.options, self._names = function, own, options, names
        functools.update_wrapper(self, function, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        clash = self._names.intersection(kwargs)
        if clash:
            _say_clash(self.function, clash)
            return self.own(*args, **kwargs)
        checkpoint = sys.modules["torch.utils.checkpoint"].checkpoint
        return checkpoint(self.function, *args, **self.options, **kwargs)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        bind = getattr(self.function, "__get__", None)
        if instance is None or bind is None:
            return self
        own = self.own.__get__(instance, owner) if hasattr(self.own, "__get__") else self.own
        return type(self)(bind(instance, owner), own, self.options, self._names)


_clashes_said: set[str] = set()


@lifetime.activation
def reset() -> None:
    """Say each clash again after a re-activation, as a fresh process would."""
    _clashes_said.clear()


def _say_clash(function: Any, names: set) -> None:
    key = getattr(function, "__qualname__", repr(function))
    if key in _clashes_said:
        return
    _clashes_said.add(key)
    log.warning(
        "gcpatch: %s is checkpointed through torch's curried checkpoint with keyword arguments"
        " named as checkpoint's own (%s): its calls run as torch runs them, undecided",
        key,
        ", ".join(sorted(names)),
    )
