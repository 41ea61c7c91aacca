"""Finer levers than a whole layer, through torch's own selective checkpointing
(`create_selective_checkpoint_contexts`) with a policy that must save some operators' outputs and
prefers to recompute the rest (their `.default` overloads: a policy naming the packet matches
nothing, pytorch/pytorch#176065):

- keep the matmuls: the outputs of `mm`, `addmm`, `bmm`, `baddbmm` and the fused scaled-dot-product
  attention kernels, so the backward recomputes only the cheap work between them (norms,
  activations, rotary, pointwise ops);
- keep the attention output: the fused attention kernels' outputs alone (Axolotl's choice,
  axolotl-ai-cloud/axolotl#3786), so the backward recomputes the projections and the MLP but not
  attention, for a few bytes more than a whole layer holds. Unfused attention (CPU attention with
  dropout runs as matmul, softmax and dropout) has no such kernel: the lever keeps nothing there
  and is not offered.

Each is offered for a layer only where it runs exactly as decided: its checkpoint function is
non-reentrant (selective checkpointing needs that) and carries no `context_fn` of the user's (a
user's own selective checkpointing stands as given). Its cost is measured, not assumed
(`shares`): the policy is a Python call per op, in the forward and in the recompute, which on
small ops can cost more than the recompute it saves; the budget's solver then does not pick it.
It must fire: each layer's policy counts the outputs it kept in its forwards (`Keep.kept`); a
layer planned with it whose forward kept none falls back to whole checkpointing, said once
(gcpatch/step/shapes.py). A lever with no policy, the layer run plain with its feed-forward block
alone checkpointed (gcpatch/step/feed_forward.py), is offered under the same conditions and timed
here beside them.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from typing import Any, Callable, NamedTuple

from gcpatch.step import feed_forward, heap, offload, swap
from gcpatch.step.held import attention_ops, matmul_ops
from gcpatch.step.solver import FEED_FORWARD, KEEP_ATTENTION, KEEP_MATMULS, OFFLOAD
from gcpatch.step.swap import CONTEXT_FN

# the keyword names a decoder layer's key/value cache goes by across transformers' generations
CACHES = ("past_key_values", "past_key_value", "layer_past", "cache")
# measured rounds of plain, whole and keep on one layer, interleaved, after one warm-up round; on a
# machine too loaded to tell whole from plain in ROUNDS, more, up to MAX_ROUNDS. Nine, not five:
# under two CI jobs on two cores, the fastest of five once put the fused layer's keep above 0.47 of
# whole (the plan took 3 whole layers, not 2; quiet, it measures 0.16 to 0.20)
ROUNDS, MAX_ROUNDS = 9, 15


class Lever(NamedTuple):
    ops: Callable[[Any], frozenset]  # torch -> the operators whose outputs it keeps
    name: str  # in `gcpatch explain`
    says: str  # after a count of layers, in the plan's line
    idle: str = "saved nothing"  # after its name, where it did not fire


LEVERS = {
    KEEP_MATMULS: Lever(matmul_ops, "keeping the matmuls", "keeping their matmuls"),
    KEEP_ATTENTION: Lever(
        attention_ops, "keeping the attention output", "keeping their attention output"
    ),
}


class Keep:
    """The policy of one layer under one lever: keep its operators' outputs, recompute the rest;
    counts what its forwards kept."""

    def __init__(self, lever: str) -> None:
        torch = sys.modules["torch"]
        from torch.utils.checkpoint import CheckpointPolicy

        self.lever = lever
        self.ops = LEVERS[lever].ops(torch)
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


# what the plan's line and `gcpatch explain` call offloading and the feed-forward block's lever
OFFLOADING = Lever(
    lambda torch: frozenset(), "offloading the inputs", "offloading their inputs", "moved nothing"
)
SPLITTING = Lever(
    lambda torch: frozenset(),
    "checkpointing the feed-forward block alone",
    "checkpointing their feed-forward block alone",
    "saw no call of the block",
)
NAMED = {**LEVERS, FEED_FORWARD: SPLITTING, OFFLOAD: OFFLOADING}


def kept_text(modes: list[str]) -> str:
    """How a plan's line names its selective and offloaded layers: " (2 keeping their matmuls)",
    or ""."""
    parts = [f"{modes.count(lever)} {NAMED[lever].says}" for lever in NAMED if lever in modes]
    return f" ({', '.join(parts)})" if parts else ""


def available(layer: Any) -> bool:
    """Whether the layer's checkpoint function can take the policy."""
    return offered(own(getattr(layer, "_gradient_checkpointing_func", None)))


def splittable(layer: Any) -> bool:
    """Whether the layer can run plain with its feed-forward block alone checkpointed
    (gcpatch/step/feed_forward.py): a block to checkpoint, under the layer's own non-reentrant
    function without a context_fn of the user's (the selective levers' condition)."""
    return available(layer) and feed_forward.block(layer) is not None


def offloadable(layer: Any) -> bool:
    """Whether the layer can be offloaded (gcpatch/step/offload.py): on an accelerator, its own
    checkpoint function without a context_fn of the user's."""
    func = own(getattr(layer, "_gradient_checkpointing_func", None))
    return offload.accelerator(layer) is not None and offload.offered(func)


def offered(func: Any) -> bool:
    """A partial of a checkpoint function, non-reentrant, without a context_fn of its own."""
    return (
        isinstance(func, functools.partial)
        and func.keywords.get("use_reentrant") is False
        and CONTEXT_FN not in func.keywords
    )


def not_offered(layers: list[Any]) -> str | None:
    """Why no layer offers the lever, said to the user (None where one does)."""
    funcs = [own(getattr(m, "_gradient_checkpointing_func", None)) for m in layers]
    if any(offered(f) for f in funcs):
        return None
    partials = [f for f in funcs if isinstance(f, functools.partial)]
    if any(CONTEXT_FN in f.keywords for f in partials):
        return "the user's own context_fn stands as given"
    if any(f.keywords.get("use_reentrant") is not False for f in partials):
        return (
            "reentrant checkpointing, which selective checkpointing cannot run under"
            " (use_reentrant=False offers it)"
        )
    return "the layers' checkpoint function takes no context_fn"


def own(func: Any) -> Any:
    """The layer's own function where `func` is it under a lever, around its feed-forward block or
    offloaded (a copy of a planned model carries that one)."""
    func = feed_forward.own(offload.own(func))
    if isinstance(func, functools.partial):
        context = func.keywords.get(CONTEXT_FN)
        if isinstance(getattr(context, "__self__", None), Keep):
            rest = {k: v for k, v in func.keywords.items() if k != CONTEXT_FN}
            return functools.partial(func.func, *func.args, **rest)
    return func


def keeping(func: functools.partial, policy: Keep) -> functools.partial:
    """The layer's own checkpoint function (its use_reentrant and every other argument as
    decided), keeping what `policy` says."""
    return functools.partial(func.func, *func.args, **{**func.keywords, CONTEXT_FN: policy.context})


def switched(layers: list[Any], policies: list[Keep | None]) -> Any:
    """The layers with a policy checkpointed under it (for a measuring pass); their own flags and
    functions back afterwards."""
    return swap.switched(
        layers, [None if p is None else functools.partial(keeping, policy=p) for p in policies]
    )


def shares(
    layers: list[Any], forward: Callable[[], Any], split: list[bool] | None = None
) -> dict[str, float | None]:
    """What each lever costs a step against checkpointing whole, measured on one layer (the first
    that offers them; its kind's kernels are the others'): called alone on the inputs it got in
    `forward` (the model's forward on the batch's slice, with every layer plain), its forward and
    backward (`torch.autograd.grad` on its input and trainable parameters: no `.grad` is touched)
    plain, checkpointed whole and under each lever, interleaved, after a warm-up round;
    (lever - plain) / (whole - plain) of each mode's fastest time (`_share`), in the process's CPU
    time on a CPU (other jobs on a shared machine do not count), with more rounds while the clock
    cannot tell whole from plain. One layer, not the model's step: a step's time on a shared CPU
    moves by more than a layer's recompute, and a big plain step pays for its own memory, so steps
    told the lever's cost by chance. The policy's Python call per op is in it, so a device where
    that outweighs the recompute saved gets a share that makes the solver pass the option over.
    None for a lever where no layer offers it, where its policy kept nothing in the warm-up round
    (it would not fire; it is not timed further), or where the clock could not tell whole
    checkpointing from plain. The feed-forward block checkpointed alone
    (gcpatch/step/feed_forward.py) is timed the same way where the layer has one and `split` (the
    measuring forward's word per layer) does not rule it out (None where the layer never called
    it), and on an accelerator offloading (gcpatch/step/offload.py), its copies in it (a share
    above 1)."""
    torch = sys.modules["torch"]
    out: dict[str, float | None] = dict.fromkeys(LEVERS)
    layer = next((m for m in layers if available(m) or offloadable(m)), None)
    call = _first_call(torch, layer, forward) if layer is not None else None
    if call is None:
        return out
    args, kwargs, at = call
    params = [p for p in layer.parameters() if p.requires_grad]
    policies = {lever: Keep(lever) for lever in LEVERS} if available(layer) else {}
    cuda = any(p.is_cuda for p in layer.parameters())
    clock = time.perf_counter if cuda else time.process_time
    modes: dict[str, Callable[[], Any]] = {
        "plain": contextlib.nullcontext,
        "whole": lambda: swap.switched([layer], [_same]),
    }
    for lever, policy in policies.items():
        modes[lever] = functools.partial(switched, [layer], [policy])
    splitter = mover = None
    if splittable(layer) and (split is None or split[layers.index(layer)]):
        out[FEED_FORWARD] = None
        splitter = feed_forward.FeedForward(
            own(layer._gradient_checkpointing_func), feed_forward.block(layer)
        )
        modes[FEED_FORWARD] = lambda: swap.switched([layer], [lambda _: splitter])
    if offloadable(layer):
        out[OFFLOAD] = None
        mover = offload.Offload(own(layer._gradient_checkpointing_func))
        modes[OFFLOAD] = lambda: swap.switched([layer], [lambda _: mover])

    def step(mode: str) -> float:
        # a view, not a leaf: a host's module tracker (a FLOP counter around the step) hooks the
        # layer's inputs, and autograd.grad refuses such hooks on a leaf
        hidden = args[at].detach().requires_grad_().view_as(args[at])
        with modes[mode]():
            if cuda:
                torch.cuda.synchronize()
            start = clock()
            value = _scalar(torch, layer(*args[:at], hidden, *args[at + 1 :], **kwargs))
            torch.autograd.grad(value, [hidden, *params], allow_unused=True)
            if cuda:
                torch.cuda.synchronize()
            spent = clock() - start
        del value
        heap.release()  # outside the clock: what the step freed goes back (gcpatch/step/heap.py)
        return spent

    for mode in modes:  # a warm-up round, not counted
        step(mode)
    for lever, policy in policies.items():
        if not policy.kept:
            del modes[lever]  # it would not fire: not timed
    if splitter is not None and not splitter.ran:
        del modes[FEED_FORWARD]
    if mover is not None and not mover.moved:
        del modes[OFFLOAD]
    if len(modes) == 2:
        return out
    samples: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(1, MAX_ROUNDS + 1):
        for mode in modes:
            samples[mode].append(step(mode))
        if round_ >= ROUNDS:
            found = {lever: _share(samples, lever) for lever in modes if lever in out}
            if all(share is not None for share in found.values()):
                break
    out.update(found)
    return out


def _first_call(torch: Any, layer: Any, forward: Callable[[], Any]) -> tuple | None:
    """The positional and keyword arguments of the layer's first call in `forward` (run without
    a graph; its cache, if any, taken out), and the position of its hidden states (its first
    floating-point tensor)."""
    calls: list[tuple] = []

    def hook(module: Any, args: tuple, kwargs: dict) -> None:
        if not calls:
            calls.append((args, dict(kwargs)))

    handle = layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            forward()
    finally:
        handle.remove()
    if not calls:
        return None
    args, kwargs = calls[0]
    # no cache: a layer called again would append to the one the forward built, whose tensors
    # then carry the previous call's graph into the next
    for name, value in kwargs.items():
        if name in CACHES or "Cache" in type(value).__name__:
            kwargs[name] = None
    if "use_cache" in kwargs:
        kwargs["use_cache"] = False
    if "hidden_states" in kwargs and not args:
        args = (kwargs.pop("hidden_states"),)
    at = next(
        (i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.is_floating_point()),
        None,
    )
    return None if at is None else (tuple(args), kwargs, at)


def _share(samples: dict[str, list[float]], lever: str) -> float | None:
    """(lever - plain) / (whole - plain) of each mode's fastest time, where the clock can tell: the
    recompute (whole's fastest less plain's) must exceed the clock's own noise (the widest gap
    between a mode's two fastest times). A shared machine only adds to a time, so the fastest is
    the truest; a loaded machine, or a layer whose recompute is too short to time, cannot tell
    them apart, and None keeps the plan to whole layers rather than a lever chosen by chance."""
    fastest = {mode: sorted(times)[:2] for mode, times in samples.items()}
    noise = max(two[-1] - two[0] for two in fastest.values())
    recompute = fastest["whole"][0] - fastest["plain"][0]
    if recompute <= noise:
        return None
    return max(0.0, fastest[lever][0] - fastest["plain"][0]) / recompute


def _same(func: Any) -> Any:
    return func


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
