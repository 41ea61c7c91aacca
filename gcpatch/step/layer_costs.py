"""What each checkpointable layer costs, measured: the activation bytes it holds after the forward,
plain and checkpointed, and the seconds its recompute takes.

A plain layer holds what it allocated and is still alive; a checkpointed one holds only its inputs
and outputs: its outputs where the next layer holds them plain too, its inputs where nothing else
does (in bf16, a Llama layer's first op saves an fp32 copy of its input, so the plain run lets the
input die and a checkpoint keeps it); offloaded (on an accelerator, gcpatch/step/offload.py),
what checkpointed holds less its inputs; with its feed-forward block alone checkpointed
(gcpatch/step/feed_forward.py), what plain holds less what the block made; all read from one plain
forward counted by the instrument (gcpatch/step/held.py). Bytes are measured on one and two rows
of the batch, at its token count and a truncated one, and fitted as a cost model of the shape
(gcpatch/step/cost_model.py), so the measuring forwards hold at most two rows' plain activations
(a batch of one or two rows is measured whole, as it would run plain) and every later shape is
planned without measuring again. Seconds are timed on a separate pass without the instrument, and
averaged over layers of one kind holding the same bytes (they run the same kernels; the first one
also pays warm-up).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gcpatch.step import feed_forward, heap, offload, selective
from gcpatch.step.batch import tensors
from gcpatch.step.cost_model import CostModel, Curve
from gcpatch.step.held import OUTSIDE, Held
from gcpatch.step.solver import FEED_FORWARD, KEEP_ATTENTION, KEEP_MATMULS, OFFLOAD, LayerCost

# why no lever was offered where the user asked for whole layers alone
WHOLE_ASKED = "GCPATCH_BUDGET_LEVERS=whole asks for whole layers alone"


@dataclass
class Measured:
    """The fitted cost model, the costs it gives at the measured batch's shape, and how it was
    measured."""

    model: CostModel
    layers: list[LayerCost]  # at the batch's own shape
    outside: float
    rows: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    batch: int = 0
    seconds: float = 0.0  # what measuring took
    # each selective lever's cost over a whole layer's recompute (None: not chosen), or why no
    # layer offers them
    shares: dict[str, float | None] = field(default_factory=dict)
    not_offered: str | None = None
    # the levers a layer's trial run refused: {lever: {layer index: why}}
    refused: dict[str, dict[int, str]] = field(default_factory=dict)

    @property
    def plain_total(self) -> float:
        return self.outside + sum(layer.plain for layer in self.layers)


def measure(
    model: Any,
    layers: list[Any],
    run: Callable[[int, int], Callable[[], Any]],
    shape: tuple[int, int],
    kinds: list[str],
    token_lengths: list[int] | None = None,
    levers: bool = True,
    rows: list[int] | None = None,
) -> Measured:
    """`run(rows, tokens)` cuts the batch to its first `rows` rows and `tokens` tokens and returns
    the forward on them, which runs with every layer plain and returns its output (the cut is made
    before counting starts: the new leaves are not the forward's to hold); the caller owns RNG,
    flags and hooks (gcpatch/step/planner.py). `token_lengths`: the token counts to measure (the
    batch's own last); one count: tokens are not measured, only rows. Without `levers`
    (GCPATCH_BUDGET_LEVERS=whole) no lever is measured or offered: whole layers only. `rows`: the
    row counts to measure where not 1 and 2 (one count: taken as proportional to the rows)."""
    start = time.perf_counter()
    batch, full_tokens = shape
    sizes = rows or ([1] if batch <= 1 else [1, 2])
    lengths = token_lengths or [full_tokens]
    n = len(layers)
    plain: list[dict] = [{} for _ in range(n)]
    ckpt: list[dict] = [{} for _ in range(n)]
    matmul: list[dict] = [{} for _ in range(n)]
    attention: list[dict] = [{} for _ in range(n)]
    offloaded: list[dict] = [{} for _ in range(n)]
    split: list[dict] = [{} for _ in range(n)]  # with the feed-forward block alone checkpointed
    splits = [levers and selective.splittable(m) for m in layers]
    blocks = [feed_forward.block(m) if ok else None for m, ok in zip(layers, splits)]
    outside: dict = {}
    for tokens in lengths:
        for rows in sizes:
            forward = run(rows, tokens)
            held = Held(
                layers,
                device_only=offload.accelerator(model) is not None,
                savers=True,
                blocks=blocks,
            )
            with held:
                output = forward()
            # The graph stays, what the forward returned goes: the caller decides whether to keep
            # its logits, and they are held with or without checkpointing.
            graph = [
                t.grad_fn for t in tensors(sys.modules["torch"], output) if t.grad_fn is not None
            ]
            del output
            alive = held.alive()
            for i in range(n):
                plain[i][(rows, tokens)] = float(alive.get(i, 0))
                ckpt[i][(rows, tokens)] = float(held.checkpointed(i))
                matmul[i][(rows, tokens)] = float(held.matmul.get(i, 0))
                attention[i][(rows, tokens)] = float(held.attention.get(i, 0))
                offloaded[i][(rows, tokens)] = float(held.offloaded(i))
                shed = held.feed_forward_shed(i)
                if shed is None:
                    splits[i] = False  # its block did not run, or wrote into its input
                else:
                    split[i][(rows, tokens)] = plain[i][(rows, tokens)] - shed
            outside[(rows, tokens)] = float(alive.get(OUTSIDE, 0))
            del graph, held, forward
            heap.release()
    timed_at = (sizes[-1], lengths[-1])
    sync = _sync(model)
    seconds = _time_layers(layers, run(*timed_at), sync)
    seconds = _averaged(seconds, kinds, [p[timed_at] for p in plain], [c[timed_at] for c in ckpt])
    # the selective levers' costs, as shares of checkpointing whole, at the timed shape (the
    # attention kernel a shape gets, and its share of a layer, change with rows and tokens);
    # without `levers` none is timed, and a lever without a share has no seconds on any layer,
    # nor on a layer whose build refused it in its trial run
    refused: dict[str, dict[int, str]] = {}
    matmuls: dict[str, float] = {}
    shares = (
        selective.shares(layers, run(*timed_at), splits, refused, matmuls)
        if levers
        else dict.fromkeys(selective.LEVERS)
    )
    offered = [selective.available(m) for m in layers]
    offloads = [selective.offloadable(m) for m in layers]

    def lever_seconds(lever: str, offered: list[bool] = offered) -> list[float | None]:
        share, out = shares.get(lever), refused.get(lever, {})
        return [
            s * share if share is not None and ok and i not in out else None
            for i, (s, ok) in enumerate(zip(seconds, offered))
        ]

    costs = CostModel(
        plain=[Curve.fit(p) for p in plain],
        checkpointed=[Curve.fit(c) for c in ckpt],
        matmul=[Curve.fit(m) for m in matmul],
        kept_seconds=lever_seconds(KEEP_MATMULS),
        attention=[Curve.fit(a) for a in attention],
        attention_seconds=lever_seconds(KEEP_ATTENTION),
        offloaded=[Curve.fit(o) for o in offloaded],
        offloaded_seconds=lever_seconds(OFFLOAD, offloads),
        feed_forward=[Curve.fit(f) if ok else None for f, ok in zip(split, splits)],
        feed_forward_seconds=lever_seconds(FEED_FORWARD, splits),
        matmul_shares=matmuls or None,
        outside=Curve.fit(outside),
        seconds=seconds,
        timed_at=timed_at,
        kinds=list(kinds),
        measured_at=[(r, t) for t in lengths for r in sizes],
        tokens_measured=len(lengths) > 1,
    )
    at_batch, outside_at_batch = costs.layers(batch, full_tokens)
    return Measured(
        model=costs,
        layers=at_batch,
        outside=outside_at_batch,
        rows=sizes,
        tokens=list(lengths),
        batch=batch,
        seconds=time.perf_counter() - start,
        shares=shares,
        not_offered=selective.not_offered(layers) if levers else WHOLE_ASKED,
        refused=refused,
    )


def _averaged(
    seconds: list[float], kinds: list[str], plain: list[float], ckpt: list[float]
) -> list[float]:
    """Layers of one kind holding the same bytes run the same kernels: one mean time for them
    (the first one also paid warm-up)."""
    groups: dict[tuple, list[int]] = {}
    for i, key in enumerate(zip(kinds, plain, ckpt)):
        groups.setdefault(key, []).append(i)
    out = list(seconds)
    for members in groups.values():
        mean = sum(seconds[i] for i in members) / len(members)
        for i in members:
            out[i] = mean
    return out


def _time_layers(
    layers: list[Any], forward: Callable[[], Any], sync: Callable[[], None], grad: bool = False
) -> list[float]:
    """Each layer's forward seconds, from a pass without gradients (a recompute runs the same
    kernels), or with them (`grad`: what a forward that builds its graph costs)."""
    import torch

    spent = [0.0] * len(layers)
    began: dict[int, float] = {}
    handles = []

    def enter(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any) -> None:
            sync()
            began[index] = time.perf_counter()

        return hook

    def leave(index: int) -> Callable[..., None]:
        def hook(module: Any, args: Any, output: Any) -> None:
            sync()
            if index in began:
                spent[index] += time.perf_counter() - began.pop(index)

        return hook

    try:
        for index, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(enter(index)))
            handles.append(layer.register_forward_hook(leave(index), always_call=True))
        with torch.set_grad_enabled(grad):
            output = forward()
        del output  # a graph built with `grad` goes with it
    finally:
        for handle in handles:
            handle.remove()
    return spent


def _sync(model: Any) -> Callable[[], None]:
    torch = sys.modules["torch"]
    device = next((p.device for p in model.parameters()), None)
    if device is not None and device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None
