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
import logging
import statistics
import sys
import time
from typing import Any, Callable, NamedTuple

from gcpatch.step import feed_forward, flops, heap, offload, swap
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
# a share is taken where the recompute clock's noise is within this share of whole's recompute: on
# two loaded cores a tiny layer's recompute (2 x 64 tokens) timed 1 to 110 ms round to round
RESOLUTION = 0.25

log = logging.getLogger("gcpatch")


class Lever(NamedTuple):
    ops: Callable[[Any], frozenset]  # torch -> the operators whose outputs it keeps
    name: str  # in `gcpatch explain`
    says: str  # after a count of layers, in the plan's line
    idle: str = "saved nothing"  # after its name, where it did not fire
    brief: str = ""  # `says` in short, where the plan's line needs the room


class Timed(NamedTuple):
    """One measured step of the layer: its seconds, and those of its recompute alone."""

    total: float
    recompute: float


LEVERS = {
    KEEP_MATMULS: Lever(
        matmul_ops, "keeping the matmuls", "keeping their matmuls", brief="matmuls kept"
    ),
    KEEP_ATTENTION: Lever(
        attention_ops,
        "keeping the attention output",
        "keeping their attention output",
        brief="attention kept",
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
    lambda torch: frozenset(),
    "offloading the inputs",
    "offloading their inputs",
    "moved nothing",
    "offloaded",
)
SPLITTING = Lever(
    lambda torch: frozenset(),
    "checkpointing the feed-forward block alone",
    "checkpointing their feed-forward block alone",
    "saw no call of the block",
    "MLP alone",
)
NAMED = {**LEVERS, FEED_FORWARD: SPLITTING, OFFLOAD: OFFLOADING}


def kept_text(modes: list[str], brief: bool = False) -> str:
    """How a plan's line names its selective and offloaded layers: " (2 keeping their matmuls)",
    or "" (`brief`: " (2 matmuls kept)")."""
    parts = [
        f"{modes.count(lever)} {NAMED[lever].brief if brief else NAMED[lever].says}"
        for lever in NAMED
        if lever in modes
    ]
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


def shares(
    layers: list[Any],
    forward: Callable[[], Any],
    split: list[bool] | None = None,
    refused: dict[str, dict[int, str]] | None = None,
    matmuls: dict[str, float] | None = None,
) -> dict[str, float | None]:
    """What each lever costs a step against checkpointing whole, measured on one layer (the first
    that offers them; its kind's kernels are the others'): called alone on the inputs it got in
    `forward` (the model's forward on the batch's slice, with every layer plain), its forward and
    backward (`torch.autograd.grad` on its input and trainable parameters: no `.grad` is touched)
    plain, checkpointed whole and under each lever, interleaved, after a warm-up round; each
    mode's recompute timed by itself, besides the step (`_share`: its recompute and what else it
    adds to the step, over whole's), in the process's CPU time on a CPU (other jobs on a shared
    machine do not count), with more rounds while the clock cannot tell. One layer, not the
    model's step: a step's time on a shared CPU moves by more than a layer's recompute, and a big
    plain step pays for its own memory, so steps told the lever's cost by chance; and the
    recompute by itself, not the difference of two steps: on two loaded cores a layer's step
    moved by as much as its recompute between rounds, and levers that recompute a third of a
    layer measured at or below plain (shares of 0, which the solver took as free). The policy's
    Python call per op is in it, so a device where that outweighs the recompute saved gets a
    share that makes the solver pass the option over. None for a lever where no layer offers it,
    where its policy kept nothing in the warm-up round (it would not fire; it is not timed
    further), or where the clock could not time whole's recompute. The feed-forward block
    checkpointed alone (gcpatch/step/feed_forward.py) is timed the same way where the layer has
    one and `split` (the measuring forward's word per layer) does not rule it out (None where the
    layer never called it), and on an accelerator offloading (gcpatch/step/offload.py), its
    copies in it (a share above 1).

    A lever must also run: a model may write into an output the lever keeps (GPT-OSS's experts
    add their bias in place to the grouped matmul's output, transformers/integrations/moe.py),
    which selective checkpointing refuses in the backward. Each lever is tried once, forward and
    backward, on the timed layer and on the first layer of every other build (its modules'
    classes: a dense first layer before mixture-of-experts ones); a lever that fails is not
    offered on the layers of that build, and `refused` gets {lever: {layer index: why}}.

    `matmuls` gets what each lever recomputes of whole's matmul FLOPs, counted once on the timed
    layer (`_Trial.matmul_shares`): the clock-free measure the solver breaks its ties by."""
    torch = sys.modules["torch"]
    out: dict[str, float | None] = dict.fromkeys(LEVERS)
    index = next((i for i, m in enumerate(layers) if available(m) or offloadable(m)), None)
    if index is None:
        return out
    # the inputs of the timed layer and of the first layer of every other build alone: each
    # holds a hidden state of the batch's slice
    builds = [_build(m) for m in layers]
    firsts: dict[tuple[str, ...], int] = {builds[index]: index}
    for i, build in enumerate(builds):
        firsts.setdefault(build, i)
    calls = _calls(torch, layers, forward, set(firsts.values()))
    if index not in calls:
        return out
    layer = layers[index]
    cuda = any(p.is_cuda for p in layer.parameters())
    clock = time.perf_counter if cuda else time.process_time
    trial = _Trial(torch, layer, calls[index], split is None or split[index], cuda, clock)
    for lever in trial.modes:
        if lever in (FEED_FORWARD, OFFLOAD):
            out[lever] = None

    def step(mode: str) -> Timed:
        spent = trial.step(mode)
        heap.release()  # outside the clock: what the step freed goes back (gcpatch/step/heap.py)
        return spent

    failed = trial.warm_up()  # a round not counted
    for lever, why in failed.items():
        _refuse(refused, lever, builds, index, why)
    for i in sorted(set(firsts.values()) - {index}):
        tried = _try(torch, layers[i], calls.get(i), split is None or split[i], trial)
        for lever, why in tried.items():
            _refuse(refused, lever, builds, i, why)
    modes = trial.modes
    if len(modes) == 2:
        return out
    if matmuls is not None:
        matmuls.update(trial.matmul_shares())
    samples: dict[str, list[Timed]] = {mode: [] for mode in modes}
    for round_ in range(1, MAX_ROUNDS + 1):
        for mode in modes:
            samples[mode].append(step(mode))
        if round_ >= ROUNDS:
            found = {lever: _share(samples, lever) for lever in modes if lever in out}
            if all(share is not None for share in found.values()):
                break
    out.update(found)
    return out


class _Trial:
    """One layer called alone on the inputs it got, plain, whole and under each lever it offers:
    `step(mode)` runs its forward and backward; `modes` holds those still to time."""

    def __init__(
        self,
        torch: Any,
        layer: Any,
        call: tuple,
        split: bool,
        cuda: bool,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.torch, self.layer, self.cuda = torch, layer, cuda
        self.args, self.kwargs, self.at = call
        self.params = [p for p in layer.parameters() if p.requires_grad]
        self.policies = {lever: Keep(lever) for lever in LEVERS} if available(layer) else {}
        self.watch = watch = _Recompute(clock, torch.cuda.synchronize if cuda else _nothing)
        self.modes: dict[str, Callable[[], Any]] = {
            "plain": contextlib.nullcontext,
            "whole": lambda: swap.switched([layer], [watch.around]),
        }
        for lever, policy in self.policies.items():
            timed = functools.partial(_timed_keeping, watch=watch, policy=policy)
            self.modes[lever] = functools.partial(swap.switched, [layer], [timed])
        self.splitter = self.mover = None
        func = own(getattr(layer, "_gradient_checkpointing_func", None))
        if splittable(layer) and split:
            splitter = feed_forward.FeedForward(watch.around(func), feed_forward.block(layer))
            self.modes[FEED_FORWARD] = lambda: swap.switched([layer], [lambda _: splitter])
            self.splitter = splitter
        if offloadable(layer):
            mover = offload.Offload(watch.around(func))
            self.modes[OFFLOAD] = lambda: swap.switched([layer], [lambda _: mover])
            self.mover = mover

    def step(self, mode: str) -> Timed:
        """One forward and backward in `mode`: its seconds, and those of its recompute alone
        (synchronized on an accelerator)."""
        torch, args, at, watch = self.torch, self.args, self.at, self.watch
        # a view, not a leaf: a host's module tracker (a FLOP counter around the step) hooks the
        # layer's inputs, and autograd.grad refuses such hooks on a leaf
        hidden = args[at].detach().requires_grad_().view_as(args[at])
        with self.modes[mode]():
            watch.reset()
            watch.sync()
            start = watch.clock()
            value = _scalar(torch, self.layer(*args[:at], hidden, *args[at + 1 :], **self.kwargs))
            torch.autograd.grad(value, [hidden, *self.params], allow_unused=True)
            watch.sync()
            return Timed(watch.clock() - start, watch.seconds)

    def matmul_shares(self) -> dict[str, float]:
        """What each lever still to time recomputes of whole's matmul FLOPs: each mode's step
        counted once (gcpatch/step/flops.py), less plain's, over whole's less plain's. Empty where
        this torch has no counter, or the count failed (said in one line)."""
        if flops.counter() is None:
            return {}
        counts: dict[str, float] = {}
        for mode in self.modes:
            counting = flops.counter()  # a fresh one per mode: a counter keeps what it counted
            try:
                with counting:
                    self.step(mode)
            except Exception as exc:  # noqa: BLE001 (the ties are broken by seconds instead)
                log.warning(
                    "gcpatch: counting the levers' FLOPs failed (%s: %s); the budget breaks its"
                    " ties by their seconds",
                    type(exc).__name__,
                    exc,
                )
                return {}
            finally:
                heap.release()
            counts[mode] = float(counting.get_total_flops())
        plain, whole = counts["plain"], counts["whole"] - counts["plain"]
        if whole <= 0:
            return {}
        return {
            mode: max(0.0, (count - plain) / whole)
            for mode, count in counts.items()
            if mode not in ("plain", "whole")
        }

    def warm_up(self) -> dict[str, str]:
        """Each mode once; the levers that failed (why) or would not fire leave `modes`. Plain or
        whole failing is the measuring's failure: raised."""
        failed = {}
        for mode in list(self.modes):
            try:
                self.step(mode)
            except Exception as exc:  # noqa: BLE001 (the lever is not offered; said in the plan)
                if mode in ("plain", "whole"):
                    raise
                failed[mode] = f"{type(exc).__name__}: {exc}"
                del self.modes[mode]
            heap.release()
        for lever, policy in self.policies.items():
            if not policy.kept:
                self.modes.pop(lever, None)  # it would not fire: not timed
        if self.splitter is not None and not self.splitter.ran:
            self.modes.pop(FEED_FORWARD, None)
        if self.mover is not None and not self.mover.moved:
            self.modes.pop(OFFLOAD, None)
        return failed


class _Recompute:
    """Times the recompute of the checkpoints it is `around` (`seconds`, since the last `reset`):
    the calls of a checkpointed function made inside a backward (torch's checkpoint tells its
    recompute by the same sign, torch/utils/checkpoint.py `_current_graph_task_id`; where torch
    lacks it, the calls after the first). Non-reentrant checkpointing may stop a recompute early
    by raising inside it: the time is taken whatever the call raised."""

    def __init__(self, clock: Callable[[], float], sync: Callable[[], Any]) -> None:
        self.clock, self.sync = clock, sync
        self.seconds = 0.0
        self._task = getattr(sys.modules["torch"]._C, "_current_graph_task_id", None)

    def reset(self) -> None:
        self.seconds = 0.0

    def around(self, func: Callable[..., Any]) -> Callable[..., Any]:
        """The checkpoint function `func`, its recompute timed."""

        def checkpointed(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
            return func(self._timed(function), *args, **kwargs)

        return checkpointed

    def _timed(self, function: Callable[..., Any]) -> Callable[..., Any]:
        calls = 0

        def timed(*args: Any, **kwargs: Any) -> Any:
            nonlocal calls
            calls += 1
            backward = calls > 1 if self._task is None else self._task() != -1
            if not backward:
                return function(*args, **kwargs)
            self.sync()
            start = self.clock()
            try:
                return function(*args, **kwargs)
            finally:
                self.sync()
                self.seconds += self.clock() - start

        return timed


def _timed_keeping(func: functools.partial, watch: _Recompute, policy: Keep) -> Any:
    """The layer's own checkpoint function keeping what `policy` says, its recompute timed."""
    return watch.around(keeping(func, policy))


def _nothing() -> None:
    return None


def _try(torch: Any, layer: Any, call: tuple | None, split: bool, trial: _Trial) -> dict[str, str]:
    """The levers `trial`'s layer runs, tried once on `layer` (of another build): those that
    failed there, and why."""
    levers = [mode for mode in trial.modes if mode not in ("plain", "whole")]
    if call is None or not levers:
        return {}
    other = _Trial(torch, layer, call, split, trial.cuda, trial.watch.clock)
    other.modes = {m: f for m, f in other.modes.items() if m in levers}
    return other.warm_up()


def _build(layer: Any) -> tuple[str, ...]:
    """The classes of the layer's modules, in order: layers alike run the same code."""
    return tuple(type(m).__name__ for m in layer.modules())


def _refuse(
    refused: dict[str, dict[int, str]] | None,
    lever: str,
    builds: list[tuple[str, ...]],
    at: int,
    why: str,
) -> None:
    """Every layer built as layer `at` (`builds`: each layer's) is refused `lever`, for `why`."""
    if refused is None:
        return
    for i, build in enumerate(builds):
        if build == builds[at]:
            refused.setdefault(lever, {})[i] = why


def _calls(
    torch: Any, layers: list[Any], forward: Callable[[], Any], wanted: set[int]
) -> dict[int, tuple]:
    """The first call in `forward` of each layer whose index is `wanted` (see `_first_call`), by
    its index."""
    seen: dict[int, tuple] = {}
    handles = []

    def hook(index: int) -> Callable[..., None]:
        def note(module: Any, args: tuple, kwargs: dict) -> None:
            seen.setdefault(index, (args, dict(kwargs)))

        return note

    try:
        for i in wanted:
            handles.append(layers[i].register_forward_pre_hook(hook(i), with_kwargs=True))
        with torch.no_grad():
            forward()
    finally:
        for handle in handles:
            handle.remove()
    out = {}
    for i, (args, kwargs) in seen.items():
        call = _first_call(torch, args, kwargs)
        if call is not None:
            out[i] = call
    return out


def _first_call(torch: Any, args: tuple, kwargs: dict) -> tuple | None:
    """A layer's positional and keyword arguments from its call in a forward run without a graph
    (its cache, if any, taken out), and the position of its hidden states (its first
    floating-point tensor)."""
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


def _share(samples: dict[str, list[Timed]], lever: str) -> float | None:
    """What `lever` costs a step over plain, as a share of what checkpointing whole costs, where
    the clock can tell. A mode's cost is its recompute, timed by itself (`Timed.recompute`; its
    fastest: a shared machine only adds to a time), and what else it adds to the step (the
    policy's Python call per op in the forward, offloading's copies): the median over rounds of
    the rest of its step less the rest of plain's in the same round (a round's steps run back to
    back, so a machine's load moves both), none where that is below zero. None where the
    recompute clock's noise (the widest gap between a mode's two fastest recomputes) exceeds
    RESOLUTION of whole's recompute: a loaded machine, or a layer whose recompute is too short to
    time, keeps the plan to whole layers rather than a lever chosen by chance."""
    recompute = {mode: sorted(t.recompute for t in times)[:2] for mode, times in samples.items()}
    noise = max(two[-1] - two[0] for two in recompute.values())
    if recompute["whole"][0] <= 0 or noise > RESOLUTION * recompute["whole"][0]:
        return None

    def cost(mode: str) -> float:
        rests = zip(samples[mode], samples["plain"])
        extra = statistics.median(t.total - t.recompute - p.total for t, p in rests)
        return recompute[mode][0] + max(0.0, extra)

    return cost(lever) / cost("whole")


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
