"""A finer lever than a whole layer: checkpoint a layer but keep its matrix multiplies' and fused
attention's outputs, so its backward recomputes only the cheap work between them (norms,
activations, rotary, pointwise ops). torch's own selective checkpointing
(`create_selective_checkpoint_contexts`) with a policy that must save `mm`, `addmm`, `bmm`,
`baddbmm` and the scaled-dot-product attention kernels (their `.default` overloads: a policy naming
the packet matches nothing, pytorch/pytorch#176065) and prefers to recompute the rest.

Offered for a layer only where it runs exactly as decided: its checkpoint function is
non-reentrant (selective checkpointing needs that) and carries no `context_fn` of the user's (a
user's own selective checkpointing stands as given). Its cost is measured, not assumed
(`seconds`): the policy is a Python call per op, in the forward and in the recompute, which on
small ops can cost more than the recompute it saves; the budget's solver then does not pick it.
It must fire: each layer's policy counts the outputs it kept in its forwards (`KeepMatmuls.kept`);
a layer planned with it whose forward kept none falls back to whole checkpointing, said once
(gcpatch/step/shapes.py).
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Any, Callable, Iterator

from gcpatch.step.held import matmul_ops

CONTEXT_FN = "context_fn"
# measured rounds of plain, whole and keep, interleaved, after one warm-up round
ROUNDS = 3


class KeepMatmuls:
    """The policy of one layer: keep every matrix multiply's output, recompute the rest; counts
    what its forwards kept."""

    def __init__(self) -> None:
        torch = sys.modules["torch"]
        from torch.utils.checkpoint import CheckpointPolicy

        self.ops = matmul_ops(torch)
        self.save, self.recompute = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
        self.kept = 0

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        if func in self.ops:
            if not getattr(ctx, "is_recompute", False):
                self.kept += 1
            return self.save
        return self.recompute

    def context(self) -> Any:
        from torch.utils.checkpoint import create_selective_checkpoint_contexts

        return create_selective_checkpoint_contexts(self)


def available(layer: Any) -> bool:
    """Whether the layer's checkpoint function can take the policy."""
    return offered(own(getattr(layer, "_gradient_checkpointing_func", None)))


def offered(func: Any) -> bool:
    """A partial of a checkpoint function, non-reentrant, without a context_fn of its own."""
    return (
        isinstance(func, functools.partial)
        and func.keywords.get("use_reentrant") is False
        and CONTEXT_FN not in func.keywords
    )


def own(func: Any) -> Any:
    """The layer's own function where `func` is it keeping matmuls (a copy of a planned model
    carries the kept one)."""
    if isinstance(func, functools.partial):
        context = func.keywords.get(CONTEXT_FN)
        if isinstance(getattr(context, "__self__", None), KeepMatmuls):
            rest = {k: v for k, v in func.keywords.items() if k != CONTEXT_FN}
            return functools.partial(func.func, *func.args, **rest)
    return func


def keeping(func: functools.partial, policy: KeepMatmuls) -> functools.partial:
    """The layer's own checkpoint function (its use_reentrant and every other argument as
    decided), keeping what `policy` says."""
    return functools.partial(func.func, *func.args, **{**func.keywords, CONTEXT_FN: policy.context})


@contextlib.contextmanager
def switched(layers: list[Any], policies: list[KeepMatmuls | None]) -> Iterator[None]:
    """The layers with a policy checkpointed keeping their matmuls (for a measuring pass); their
    own flags and functions back afterwards."""
    saved = [
        (m, vars(m).get("gradient_checkpointing"), vars(m).get("_gradient_checkpointing_func"))
        for m in layers
    ]
    try:
        for m, policy in zip(layers, policies):
            if policy is not None:
                m._gradient_checkpointing_func = keeping(m._gradient_checkpointing_func, policy)
                m.gradient_checkpointing = True
        yield
    finally:
        for m, flag, func in saved:
            for name, value in (
                ("gradient_checkpointing", flag),
                ("_gradient_checkpointing_func", func),
            ):
                if value is None:
                    vars(m).pop(name, None)
                else:
                    setattr(m, name, value)


def ratio(model: Any, layers: list[Any], forward: Callable[[], Any]) -> float | None:
    """What keeping the matmuls costs a step against checkpointing whole, measured: the model's
    forward and backward on `forward`'s slice (up to two rows at the batch's token count: the
    attention kernel a shape gets and its share of a layer change with both), through
    `torch.autograd.grad` on the trainable parameters (no `.grad` is touched), with every offering
    layer plain, checkpointed whole and keeping its matmuls, interleaved, after a warm-up round;
    (keep - plain) / (whole - plain) of the round least favourable to keeping (`_worst`), in the
    process's CPU time on a CPU (other jobs on a shared machine do not count). The policy's Python
    call per op, in the forward and the recompute, is in it, so a device where that outweighs the
    recompute saved gets a ratio that makes the solver pass the option over. None where no layer
    offers it, where its policy kept nothing (it would not fire), or where the clock could not
    tell whole checkpointing from plain."""
    torch = sys.modules["torch"]
    offered = [available(m) for m in layers]
    if not any(offered):
        return None
    trainable = [p for p in model.parameters() if p.requires_grad]
    policies = [KeepMatmuls() if ok else None for ok in offered]
    cuda = any(p.is_cuda for p in trainable)
    clock = time.perf_counter if cuda else time.process_time

    def step(mode: str) -> float:
        with contextlib.ExitStack() as stack:
            if mode == "keep":
                stack.enter_context(switched(layers, policies))
            elif mode == "whole":
                stack.enter_context(_whole(layers, offered))
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            value = _scalar(torch, forward())
            torch.autograd.grad(value, trainable, allow_unused=True)
            if cuda:
                torch.cuda.synchronize()
            return clock() - start

    rounds: list[dict[str, float]] = []
    for round_ in range(1 + ROUNDS):  # the first round warms up and is not counted
        took = {mode: step(mode) for mode in ("plain", "whole", "keep")}
        if round_:
            rounds.append(took)
    if not any(p is not None and p.kept for p in policies):
        return None
    return _worst(rounds)


def _worst(rounds: list[dict[str, float]]) -> float | None:
    """(keep - plain) / (whole - plain) of the round that makes keeping look worst, where the clock
    can tell: the recompute (whole - plain, in every round) must exceed the clock's own noise (the
    widest spread of one mode's time across the rounds). On a loaded machine, or a model whose
    recompute is a few milliseconds, it cannot (the process's CPU time then counts other
    threads' waiting too), and None keeps the plan to whole layers rather than a lever chosen by
    chance; where it can, the least favourable round keeps a lucky one from choosing it."""
    noise = max(max(r[m] for r in rounds) - min(r[m] for r in rounds) for m in rounds[0])
    recompute = min(r["whole"] - r["plain"] for r in rounds)
    if recompute <= noise:
        return None
    return max(max(0.0, r["keep"] - r["plain"]) / (r["whole"] - r["plain"]) for r in rounds)


@contextlib.contextmanager
def _whole(layers: list[Any], offered: list[bool]) -> Iterator[None]:
    saved = [vars(m).get("gradient_checkpointing") for m in layers]
    try:
        for m, ok in zip(layers, offered):
            if ok:
                m.gradient_checkpointing = True
        yield
    finally:
        for m, flag in zip(layers, saved):
            if flag is None:
                vars(m).pop("gradient_checkpointing", None)
            else:
                m.gradient_checkpointing = flag


def _scalar(torch: Any, output: Any) -> Any:
    """What a backward starts from: the loss a model returned, else the sum of the first output
    that has a graph (a layer's hidden states)."""
    from gcpatch.step.batch import tensors

    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.grad_fn is not None:
        return loss
    found = output if isinstance(output, (torch.Tensor, tuple, list, dict)) else vars(output)
    for tensor in tensors(torch, found):
        if tensor.grad_fn is not None and tensor.is_floating_point():
            return tensor.float().sum()
    raise RuntimeError("the forward returned nothing to take a backward from")
