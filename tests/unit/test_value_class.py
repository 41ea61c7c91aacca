"""A value class behaves as the dataclass it stands for, to everything plugins use of it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest

from gcpatch.schema import Facts, Vote
from gcpatch.value_class import Value, value_class


@dataclass(frozen=True)
class Generated:
    name: str
    count: int = 0
    tags: dict = field(default_factory=dict)


@value_class()
class Written(Value):
    name: str
    count: int = 0
    tags: dict = field(default_factory=dict)


@value_class(frozen=False)
class Mutable(Value):
    name: str
    items: list = field(default_factory=list)


def _same(a, b):
    assert repr(a).split("(", 1)[1] == repr(b).split("(", 1)[1]
    assert dataclasses.asdict(a) == dataclasses.asdict(b)


def test_construction_repr_and_dataclass_functions_match_a_generated_dataclass():
    for args, kwargs in (
        ((("x",), {})),
        (("x", 2), {}),
        (("x",), {"tags": {"a": 1}}),
        ((), {"name": "y", "count": 3}),
    ):
        _same(Written(*args, **kwargs), Generated(*args, **kwargs))
    w = Written("x", 2)
    assert dataclasses.is_dataclass(w)
    assert [f.name for f in dataclasses.fields(w)] == ["name", "count", "tags"]
    assert dataclasses.replace(w, count=5) == Written("x", 5)
    assert Written("x").tags is not Written("x").tags  # a fresh default per instance


def test_errors_match_a_generated_dataclass():
    for call in (
        lambda c: c(),
        lambda c: c("x", 1, {}, 4),
        lambda c: c("x", name="y"),
        lambda c: c("x", other=1),
    ):
        with pytest.raises(TypeError):
            call(Generated)
        with pytest.raises(TypeError):
            call(Written)
    with pytest.raises(dataclasses.FrozenInstanceError):
        Written("x").count = 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        del Written("x").name


def test_equality_and_hash_follow_the_fields():
    assert Written("x", 1) == Written("x", 1) != Written("x", 2)
    assert hash(Written("x", 1, ())) == hash(Written("x", 1, ())) == hash(("x", 1, ()))
    for cls in (Generated, Written):  # a dict field cannot be hashed, as with a dataclass
        with pytest.raises(TypeError):
            hash(cls("x"))
    assert Written("x") != Generated("x")  # another class, as dataclasses compare
    m = Mutable("x")
    m.name = "y"
    assert m == Mutable("y") and m.items == []
    with pytest.raises(TypeError):
        hash(m)


def test_the_plugin_api_types_are_still_dataclasses():
    vote = Vote("use_reentrant", False, "required", "R1", "why")
    assert dataclasses.replace(vote, plugin="p").plugin == "p"
    assert dataclasses.asdict(vote)["rule"] == "R1"
    assert "asked_kwargs" in {f.name for f in dataclasses.fields(Facts)}
