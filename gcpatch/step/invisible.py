"""What keeps gcpatch's own passes at the first step invisible to the user's job.

A pass (verify's two passes on one row) runs the user's model
outside the user's step. It must leave nothing behind and change nothing the step sees: the RNG
streams are forked and rewound (torch's, each device's, Python's), the buffers are put back,
checkpointing flags a pass changed are restored, and the user's own module hooks do not run (a
hook may count, log or change state; running it as the user's step would is impossible, so it
does not run at all: hooks of gcpatch and of the frameworks it supports stay, being the model's).
While a pass runs, `active()` is true, so gcpatch's first-forward hooks stand aside. Where an extra
pass could not be invisible (sharded parameters, an optimizer in backward, a KV cache passed in, an
outer checkpoint), `unsupported` says why and nothing runs.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import random
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any, Iterator

from gcpatch import console, context
from gcpatch.facts import passes_kv_cache

log = logging.getLogger("gcpatch")

# Hooks whose function comes from these packages are the model's own, and run in a pass.
FRAMEWORKS = (
    "gcpatch",
    "gcpatch_plugins",
    "transformers",
    "peft",
    "accelerate",
    "torch",
    "deepspeed",
    "trl",
)
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
)


def active() -> bool:
    """Whether one of gcpatch's own passes is running now."""
    return context.in_own_pass()


@contextlib.contextmanager
def gcpatch_pass(torch: Any, model: Any, keep_rng: bool = True) -> Iterator[None]:
    """Run a pass of gcpatch's own on `model`: `active()` is true, the user's hooks are off, the
    buffers and (with `keep_rng`) the RNG streams are as they were afterwards."""
    context.own_pass_began()
    try:
        with _user_hooks_off(torch, model), _buffers_kept(torch, model):
            if keep_rng:
                with rng_kept(torch, model):
                    yield
            else:
                yield
    finally:
        context.own_pass_ended()


@contextlib.contextmanager
def rng_kept(torch: Any, model: Any) -> Iterator[None]:
    """The RNG streams a pass draws from, forked: torch's CPU stream, the stream of each device the
    model's parameters are on, and Python's `random`."""
    devices, device_type = _devices(model)
    state = random.getstate()
    try:
        with torch.random.fork_rng(devices=devices, device_type=device_type):
            yield
    finally:
        random.setstate(state)


def rng_state(torch: Any, model: Any) -> tuple:
    """The RNG state to start a second pass from (verify runs its two passes from one state)."""
    devices, device_type = _devices(model)
    module = getattr(torch, device_type) if devices else None
    return torch.get_rng_state(), [module.get_rng_state(d) for d in devices] if module else []


def set_rng_state(torch: Any, model: Any, state: tuple) -> None:
    devices, device_type = _devices(model)
    torch.set_rng_state(state[0])
    if devices:
        module = getattr(torch, device_type)
        for device, saved in zip(devices, state[1]):
            module.set_rng_state(saved, device)


def _devices(model: Any) -> tuple[list[int], str]:
    on = [p.device for p in model.parameters() if p.device.type not in ("cpu", "meta")]
    return sorted({d.index or 0 for d in on}), on[0].type if on else "cuda"


@contextlib.contextmanager
def _buffers_kept(torch: Any, model: Any) -> Iterator[None]:
    """Each buffer the pass wrote into put back, its version counter too; the others untouched. The
    budget measures between the user's first forward and its backward, and autograd refuses a
    tensor that forward saved whose version moved since ('modified by an inplace operation'):
    Gemma's embedding normalizer, BERT's token_type_ids."""
    buffers = [(b, b._version, b.detach().clone()) for b in model.buffers()]
    try:
        yield
    finally:
        written = [(b, version, saved) for b, version, saved in buffers if b._version != version]
        with torch.no_grad():
            for buffer, _, saved in written:
                buffer.copy_(saved)
        _versions_back(torch, [(b, version) for b, version, _ in written])


def _versions_back(torch: Any, written: list[tuple[Any, int]]) -> None:
    """Version counters set back to what they were before the pass: the contents are."""
    if not written:
        return
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    why = "torch has no _unsafe_set_version_counter"
    if setter is not None:
        try:
            try:
                setter(tuple(b for b, _ in written), tuple(v for _, v in written))
            except TypeError:  # an older torch takes one tensor and one version
                for tensor, version in written:
                    setter(tensor, version)
            return
        except (TypeError, RuntimeError) as exc:
            why = f"{type(exc).__name__}: {exc}"
    console.warn(  # once per job: the plan's measuring pass and verify's would each say it
        f"gcpatch: {len(written)} buffer(s) written by gcpatch's own pass keep a new version"
        f" ({why}): a backward of the forward before it that saved them may be refused"
    )


@contextlib.contextmanager
def _user_hooks_off(torch: Any, model: Any) -> Iterator[None]:
    """The user's module hooks (on every submodule, and torch's global module hooks) taken out for
    the pass and put back in their order afterwards, however the pass ends."""
    taken: list[tuple[Any, str, Any]] = []
    owners = [(m, name) for m in model.modules() for name in _HOOK_DICTS]
    owners += [(_globals(torch), name) for name in _GLOBAL_DICTS if _globals(torch) is not None]
    try:
        for owner, name in owners:
            hooks = getattr(owner, name, None)
            if not isinstance(hooks, Mapping) or not hooks:
                continue
            users = [k for k, fn in hooks.items() if not _frameworks(fn)]
            if users:
                taken.append((owner, name, OrderedDict(hooks)))
                for key in users:
                    del hooks[key]
        yield
    finally:
        for owner, name, saved in reversed(taken):
            hooks = getattr(owner, name)
            added = [(k, v) for k, v in hooks.items() if k not in saved]
            hooks.clear()
            hooks.update(saved)
            hooks.update(added)


_GLOBAL_DICTS = (
    "_global_forward_pre_hooks",
    "_global_forward_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


class _GlobalHooks:
    """torch's global module hooks as attributes of one object, for `_user_hooks_off`."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


def _globals(torch: Any) -> Any:
    module = getattr(getattr(torch.nn, "modules", None), "module", None)
    return _GlobalHooks(module) if module is not None else None


def _frameworks(hook: Any) -> bool:
    """Whether a hook is part of the model: a function (or a callable object's class) defined in
    gcpatch or in a framework it supports."""
    function = hook
    while isinstance(function, functools.partial):
        function = function.func
    function = getattr(function, "__func__", function)  # a bound method: its function
    module = getattr(function, "__module__", None)
    if not isinstance(module, str):  # a callable object
        module = type(function).__module__
    return module.split(".", 1)[0] in FRAMEWORKS


def unsupported(torch: Any, model: Any, trainable: list, kwargs: Mapping[str, Any]) -> str:
    """Set-ups where an extra forward and backward would not be invisible to the user's step."""
    if not trainable:
        return "no trainable parameters"
    if any(hasattr(p, "ds_id") for _, p in trainable):
        return (
            "DeepSpeed ZeRO-3 partitions the parameters: an extra pass would gather them and"
            " reduce its gradients into the optimizer's partitions"
        )
    if any(type(p).__name__ in ("FlatParameter", "DTensor") for _, p in trainable):
        return "FSDP-sharded parameters: an extra pass would run FSDP's collectives"
    if any(getattr(p, "_post_accumulate_grad_hooks", None) for _, p in trainable):
        return (
            "parameters carry post-accumulate-grad hooks (optimizer in backward): they would run"
            " twice"
        )
    if passes_kv_cache(kwargs):
        return "a KV cache is passed in: the extra passes would write into it"
    if _inside_saved_tensor_hooks(torch):
        return "the forward runs inside saved-tensor hooks (an outer checkpoint or offload)"
    return ""


def _inside_saved_tensor_hooks(torch: Any) -> bool:
    try:
        return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
    except Exception as exc:  # noqa: BLE001 (private API: only a precaution)
        log.debug("gcpatch: cannot read torch's saved-tensor hooks (%s); checked without it", exc)
        return False
