"""Activation bytes measured at one batch shape, told apart by how they grow: with rows x tokens
(`linear`), with rows x tokens squared (`square`: attention scores), or either (`either`: two
dimensions equal to the token count where a weight has that size too, a hidden size equal to the
token count). One probed step plans any other shape: `either` bytes are planned from the bound
that errs towards holding more, and a fraction is taken of the bound that errs towards less."""

from __future__ import annotations

from dataclasses import dataclass

LINEAR, SQUARE, EITHER = "linear", "square", "either"


@dataclass(frozen=True)
class Bytes:
    linear: float = 0.0
    square: float = 0.0
    either: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.square + self.either

    def plus(self, nbytes: float, kind: str) -> Bytes:
        return self + Bytes(**{kind: float(nbytes)})

    def __add__(self, other: Bytes) -> Bytes:
        return Bytes(
            self.linear + other.linear, self.square + other.square, self.either + other.either
        )

    def __sub__(self, other: Bytes) -> Bytes:
        return Bytes(
            max(0.0, self.linear - other.linear),
            max(0.0, self.square - other.square),
            max(0.0, self.either - other.either),
        )

    def at(self, rows: float, tokens: float, upper: bool = True) -> float:
        """At `rows` and `tokens` times the measured ones; `either` bytes as square or linear,
        whichever holds more (`upper`) or less."""
        grown = tokens * tokens
        either = max(grown, tokens) if upper else min(grown, tokens)
        return rows * (self.linear * tokens + self.square * grown + self.either * either)

    def to_list(self) -> list[float]:
        return [self.linear, self.square, self.either]

    @classmethod
    def from_list(cls, data: list[float]) -> Bytes:
        return cls(*(float(v) for v in data))
