"""Gradients asked for by `torch.autograd.grad` or `backward(inputs=...)` through reentrant
checkpoints (CK6).

Reentrant checkpointing runs each checkpointed block's backward as a backward of its own that
accumulates into `.grad`, and torch refuses it inside `torch.autograd.grad()` or
`backward(inputs=...)` ("torch.utils.checkpoint is incompatible with .grad()"). That is known only
when the gradients are taken: nothing in the forward shows how they will be. Where the graph holds a
reentrant checkpoint and the gradients asked for are of leaf tensors, fix mode takes them by one
ordinary backward into `.grad` instead and gives every other leaf its `.grad` back as it was: the
result is what the call would return under non-reentrant checkpointing. Anything this cannot
reproduce exactly (non-leaf inputs, `create_graph`, batched grads, a process group whose hooks a
full backward would fire, hooks on other leaves) is left to torch, whose error then carries
gcpatch's note naming `use_reentrant=False` (crash_notes: reentrant_grad).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from gcpatch import headline, lifetime, record, settings

log = logging.getLogger("gcpatch")

_seen = [False]  # a reentrant checkpoint ran in this process: only then is a graph looked at
_said: set[str] = set()


@lifetime.activation
def reset() -> None:
    _seen[0] = False
    _said.clear()


_CHECKPOINT_NODE = "CheckpointFunctionBackward"
_GRAD_NAMES = (
    "outputs",
    "inputs",
    "grad_outputs",
    "retain_graph",
    "create_graph",
    "only_inputs",
    "allow_unused",
    "is_grads_batched",
    "materialize_grads",
)
_BACKWARD_NAMES = (
    "tensors",
    "grad_tensors",
    "retain_graph",
    "create_graph",
    "grad_variables",
    "inputs",
)


def reentrant_ran() -> None:
    """Called by the checkpoint call when a call runs reentrant (once is enough)."""
    _seen[0] = True


def grad(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """torch.autograd.grad, wrapt's wrapper protocol."""
    if not _seen[0]:
        return wrapped(*args, **kwargs)
    call = {**dict(zip(_GRAD_NAMES, args)), **kwargs}
    outputs, inputs = _seq(call.get("outputs")), _seq(call.get("inputs"))
    leaves = _planned(outputs, inputs, call.get("create_graph") or call.get("is_grads_batched"))
    if leaves is None:
        return wrapped(*args, **kwargs)
    stash = [(leaf, leaf.grad) for leaf in leaves]
    try:
        for leaf in leaves:
            leaf.grad = None
        _backward(outputs, call.get("grad_outputs"), call.get("retain_graph"))
        found = tuple(leaf.grad for leaf in inputs)
    finally:
        for leaf, before in stash:
            leaf.grad = before
    if any(g is None for g in found):
        if call.get("materialize_grads"):
            torch = sys.modules["torch"]
            found = tuple(torch.zeros_like(i) if g is None else g for i, g in zip(inputs, found))
        elif not call.get("allow_unused"):
            raise RuntimeError(
                "One of the differentiated Tensors appears to not have been used in the graph. "
                "Set allow_unused=True if this is the desired behavior."
            )
    _say("torch.autograd.grad")
    return found


def backward(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """torch.autograd.backward (Tensor.backward calls it), wrapt's wrapper protocol: only a call
    with
    `inputs=` is looked at."""
    if not _seen[0] or (kwargs.get("inputs") is None and len(args) < 6):
        return wrapped(*args, **kwargs)
    call = {**dict(zip(_BACKWARD_NAMES, args)), **kwargs}
    tensors, inputs = _seq(call.get("tensors")), _seq(call.get("inputs"))
    leaves = _planned(
        tensors, inputs, call.get("create_graph") or call.get("grad_variables") is not None
    )
    if leaves is None:
        return wrapped(*args, **kwargs)
    asked = {id(i) for i in inputs}
    stash = [(leaf, leaf.grad) for leaf in leaves]
    done = False
    try:
        for leaf in leaves:
            leaf.grad = None
        _backward(tensors, call.get("grad_tensors"), call.get("retain_graph"))
        done = True
    finally:
        for leaf, before in stash:
            new = leaf.grad
            if done and id(leaf) in asked and new is not None:
                leaf.grad = (
                    new if before is None else before + new
                )  # backward accumulates into .grad
            else:
                leaf.grad = before
    _say("backward(inputs=...)")
    return None


def _backward(tensors: list, grad_tensors: Any, retain_graph: Any) -> None:
    # the module attribute: crash notes and every other wrapper of it run as for any backward
    sys.modules["torch"].autograd.backward(
        tensors, grad_tensors=grad_tensors, retain_graph=retain_graph
    )


def _planned(outputs: list, inputs: list, unsupported: Any) -> list | None:
    """The leaves to stand in for, or None: torch runs the call as made. gcpatch's own failure
    here leaves the call to torch (one log line); the backward itself is the host's."""
    if unsupported or not _leaves_only(inputs):
        return None
    try:
        return _served(outputs, inputs)
    except Exception as exc:  # noqa: BLE001 (fail open)
        if "failed" not in _said:
            _said.add("failed")
            log.error(
                "gcpatch: CK6 left the gradients to torch, looking at the graph failed (%s: %s)",
                type(exc).__name__,
                exc,
            )
        return None


def _served(outputs: list, inputs: list) -> list | None:
    """The leaves a full backward from `outputs` reaches, where the graph holds a reentrant
    checkpoint
    and that backward can stand in for the call: else None (torch runs the call as made)."""
    if settings.read().mode != "fix" or not outputs:
        return None
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return None  # a full backward would fire DDP's and FSDP's gradient hooks on every parameter
    leaves, reentrant = _walk(outputs)
    if not reentrant:
        return None
    asked = {id(i) for i in inputs}
    for leaf in leaves:
        if getattr(leaf, "_post_accumulate_grad_hooks", None) or (
            id(leaf) not in asked and leaf._backward_hooks
        ):
            return None  # hooks that would run for a leaf the call never asked about
    return leaves


def _walk(outputs: list) -> tuple[list, bool]:
    """Every leaf the outputs' graph reaches, and whether it holds a reentrant checkpoint."""
    pending = [t.grad_fn for t in outputs if getattr(t, "grad_fn", None) is not None]
    seen: set[int] = set()
    leaves: list = []
    reentrant = False
    while pending:
        node = pending.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name == _CHECKPOINT_NODE:
            reentrant = True
        variable = getattr(node, "variable", None) if name == "AccumulateGrad" else None
        if variable is not None:
            leaves.append(variable)
        pending.extend(fn for fn, _ in node.next_functions)
    return leaves, reentrant


def _seq(value: Any) -> list:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return list(value)
    return [value]


def _leaves_only(inputs: list) -> bool:
    torch = sys.modules["torch"]
    return bool(inputs) and all(
        isinstance(i, torch.Tensor) and i.is_leaf and i.requires_grad for i in inputs
    )


def _say(entry: str) -> None:
    if entry in _said:
        return
    _said.add(entry)
    line = (
        f"gcpatch: {entry} through reentrant checkpoints: the gradients asked for are taken by one"
        " backward into .grad, every other .grad left as it was (CK6: torch refuses reentrant"
        " checkpointing there)"
    )
    log.info("%s", headline.wrap(line))
    record.event(
        {"stage": "grads", "entry": entry, "line": line, "rules": ["CK6"]},
        settings.read().record_dir,
    )
