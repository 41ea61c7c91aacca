"""Dataclasses whose methods are written once, here, instead of generated for each class.

`dataclasses.dataclass` compiles every generated method from source text at class creation
(`exec`, about 45 of them for gcpatch's schema), which cost a checkpointing job about 6 ms at its
first enable on Python 3.11 (`python -X importtime`: gcpatch.schema). A class made by
`value_class` is still a dataclass to `dataclasses.fields`, `replace`, `asdict` and
`is_dataclass`, so plugins keep using those; only its `__init__`, `__repr__`, `__eq__`,
`__hash__` and frozen `__setattr__` come from `Value`, compiled once in this module's .pyc.
"""

from __future__ import annotations

from dataclasses import MISSING, FrozenInstanceError, dataclass, fields
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class Value:
    """What a value class shares: keyword or positional construction in field order, defaults
    and default factories as declared, equality and hash by fields, a dataclass-style repr."""

    __slots__ = ()
    _names: tuple[str, ...] = ()
    _defaults: dict[str, tuple[Any, Callable[[], Any] | None]] = {}
    _frozen = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        cls = type(self)
        names = cls._names
        if len(args) > len(names):
            raise TypeError(f"{cls.__name__}() takes {len(names)} arguments, {len(args)} given")
        values = dict(zip(names, args))
        for name, value in kwargs.items():
            if name in values:
                raise TypeError(f"{cls.__name__}() got multiple values for argument {name!r}")
            if name not in cls._defaults:
                raise TypeError(f"{cls.__name__}() got an unexpected keyword argument {name!r}")
            values[name] = value
        for name in names:
            if name in values:
                value = values[name]
            else:
                default, factory = cls._defaults[name]
                if default is MISSING and factory is None:
                    raise TypeError(f"{cls.__name__}() missing required argument: {name!r}")
                value = factory() if factory is not None else default
            object.__setattr__(self, name, value)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, name) for name in self._names)

    def __repr__(self) -> str:
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self._names)
        return f"{type(self).__qualname__}({shown})"

    def __eq__(self, other: object) -> bool:
        if other.__class__ is not self.__class__:
            return NotImplemented
        return self._values() == other._values()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash(self._values())

    def __setattr__(self, name: str, value: Any) -> None:
        if self._frozen:
            raise FrozenInstanceError(f"cannot assign to field {name!r}")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self._frozen:
            raise FrozenInstanceError(f"cannot delete field {name!r}")
        object.__delattr__(self, name)


def value_class(frozen: bool = True) -> Callable[[type[T]], type[T]]:
    """Make a subclass of `Value` a dataclass without generated methods. A frozen one hashes by
    its fields; a mutable one is unhashable, as a dataclass with `eq=True` is."""

    def make(cls: type[T]) -> type[T]:
        cls = dataclass(init=False, repr=False, eq=False)(cls)
        declared = fields(cls)
        cls._names = tuple(f.name for f in declared)  # type: ignore[attr-defined]
        cls._defaults = {  # type: ignore[attr-defined]
            f.name: (f.default, None if f.default_factory is MISSING else f.default_factory)
            for f in declared
        }
        cls._frozen = frozen  # type: ignore[attr-defined]
        if not frozen:
            cls.__hash__ = None  # type: ignore[assignment]
        return cls

    return make
