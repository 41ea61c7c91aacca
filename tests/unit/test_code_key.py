"""A checkpoint call's key (what its result looked like is kept by it) names the function called,
the same on every call, however the hot path's fast paths reach it."""

from __future__ import annotations

import functools

import torch

from gcpatch.call import call_facts


def generic_key(function):
    """The key as asked of any callable, without fast paths."""
    while type(function) is functools.partial:
        function = function.func
    owner = getattr(function, "__self__", None)
    code = getattr(getattr(function, "__func__", function), "__code__", None)
    if code is None:
        return type(function)
    return (code, type(owner)) if owner is not None else code


class Callable_:
    def __call__(self, x):
        return x


class Layer(torch.nn.Linear):
    pass


def plain(x):
    return x


def test_every_kind_of_callable_keys_as_the_generic_path_does_on_every_call():
    layer = Layer(2, 2)
    carrying = Callable_()
    carrying.__code__ = plain.__code__  # an object that says it has code, as a Cython function does
    callables = [
        plain,
        lambda x: x,
        layer,
        layer.forward,
        layer.__call__,
        functools.partial(layer.__call__, x=1),
        functools.partial(functools.partial(plain), 1),
        torch.nn.Linear(2, 2),
        Callable_(),
        carrying,
        len,
        torch.relu,
        [].append,
    ]
    for _ in range(2):  # the second call meets the classes the first one learnt
        for function in callables:
            assert call_facts.code_key(function) == generic_key(function), function
    assert call_facts.code_key(layer) is Layer
    assert call_facts.code_key(layer.__call__) == (
        torch.nn.Module._wrapped_call_impl.__code__,
        Layer,
    )


def test_a_module_is_keyed_without_calling_its_getattr():
    asked = []

    class Watched(torch.nn.Linear):
        def __getattr__(self, name):
            asked.append(name)
            return super().__getattr__(name)

    module = Watched(2, 2)
    call_facts.code_key(module)  # learns that the class defines none of a function's attributes
    asked.clear()
    assert call_facts.code_key(module) is Watched
    assert asked == []
