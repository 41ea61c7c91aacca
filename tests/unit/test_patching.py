"""What stands for a patched callable (gcpatch/patching.py): a method is replaced by a plain function
that binds as the method did, so the plugin's wrapper gets the bound original and the instance
however the method is reached (an instance, the class with the instance first, `super()`); a
module's function by a plain function; anything else by wrapt's proxy. Each is put back by
identity."""

from __future__ import annotations

import copy
import functools
import inspect
import sys
import types

import pytest

from gcpatch.patching import Patcher
from gcpatch.schema import PatchPoint

pytestmark = pytest.mark.unit


class Base:
    def scale(self, x: int, factor: int = 2) -> int:
        return x * factor


class Child(Base):
    def scale(self, x: int, factor: int = 2) -> int:
        return super().scale(x, factor) + 1


def double(x: int) -> int:
    return 2 * x


@pytest.fixture
def module():
    mod = types.ModuleType("gcpatch_test_patch_target")
    mod.Base, mod.double, mod.triple = Base, double, functools.partial(lambda x, k: k * x, k=3)
    sys.modules[mod.__name__] = mod
    yield mod
    del sys.modules[mod.__name__]


def patched(module, target, seen):
    def wrapper(wrapped, instance, args, kwargs):
        seen.append((instance, args))
        return wrapped(*args, **kwargs)

    patcher = Patcher()
    patcher.register(PatchPoint(module.__name__, target, wrapper, guarded=True), "test")
    return patcher


def test_a_method_binds_as_the_method_did_however_it_is_reached(module):
    original = vars(Base)["scale"]
    seen: list = []
    patcher = patched(module, "Base.scale", seen)
    stands = vars(Base)["scale"]
    assert isinstance(stands, types.FunctionType) and stands is not original
    a, c = Base(), Child()
    assert a.scale(3) == 6 and Base.scale(a, 3, factor=3) == 9 and c.scale(3) == 7
    assert seen == [(a, (3,)), (a, (3,)), (c, (3, 2))]  # super() reaches it with the child
    assert inspect.signature(a.scale) == inspect.signature(original.__get__(a))
    patcher.uninstall_all()
    assert vars(Base)["scale"] is original


def test_a_module_function_is_a_plain_function_and_a_callable_object_wrapts_proxy(module):
    original_double, original_triple = module.double, module.triple
    seen: list = []
    patchers = [patched(module, "double", seen), patched(module, "triple", seen)]
    assert isinstance(module.double, types.FunctionType) and module.double(4) == 8
    assert not isinstance(module.triple, types.FunctionType) and module.triple(4) == 12
    assert seen == [(None, (4,)), (None, (4,))]
    import wrapt

    assert isinstance(module.triple, wrapt.FunctionWrapper)
    assert copy.deepcopy(module.triple) is module.triple  # a copy of a model keeps the patch
    for patcher in patchers:
        patcher.uninstall_all()
    assert module.double is original_double and module.triple is original_triple
