"""The grid of checkpoint call shapes, each run four ways on a tiny module: no checkpointing (the
reference), as called (torch's checkpoint), forced non-reentrant (the blunt patch many scripts carry)
and under gcpatch (its call-site decision wrapped around torch's checkpoint, the engine running in
fix mode). A cell's outcome is its gradients compared with the reference, or the error it raised.

    python tests/kit/testkit/call_grid.py > tests/CALL_GRID.md     # the committed summary table

tests/unit/test_call_grid.py checks the properties on cells hypothesis draws from this grid (gcpatch is
never worse than the blunt patch; it never changes a call whose gradients are already exact for
gradients' sake) and that the committed table is this grid's.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import logging
import sys
from dataclasses import dataclass

import torch
from torch import nn

# How the layer's hidden state reaches the checkpointed function: as a positional tensor, bound
# into the function, or inside a list or dict argument (which reentrant does not look into).
INPUT_VIA = ("positional", "keyword", "partial_arg", "closure", "default_arg", "in_list", "in_dict")
# A second tensor the layer uses: a trainable leaf, or a tensor with a graph used by one checkpoint,
# shared by both checkpoints, or used inside a checkpoint and outside it; by keyword or closure.
EXTRA = (
    "none",
    "leaf_keyword",
    "graph_keyword",
    "shared_keyword",
    "outside_keyword",
    "graph_closure",
    "shared_closure",
)
ASKED = (True, None, False)
GRADS = ("backward", "autograd.grad", "backward(inputs=)")
# Cells whose outcome can be known only at backward time: how the gradients are taken (CK6).
BACKWARD_TIME = ("autograd.grad", "backward(inputs=)")
# What the checkpointed function returns: the tensor, a dict holding it, or a tuple (tensor, None).
OUTPUT = ("tensor", "dict", "tuple_none")
# Whether the layer saves the same tensors when recomputed, or a different number (a cache built on
# its first call: the same values, other operations), which non-reentrant checkpointing refuses.
RECOMPUTE = ("same", "differs")


@dataclass(frozen=True)
class Cell:
    input_via: str
    extra: str
    upstream_trains: bool  # the hidden state requires grad (something trainable before the layers)
    layer_trains: bool
    asked: bool | None  # use_reentrant at the call (None: torch's default, reentrant)
    context_fn: bool  # selective checkpointing
    nested: bool  # the layer checkpoints an inner module itself
    grads: str
    covered: bool  # an enable-time decision (the user's reentrant ask) covers the layers (CK4)
    output: str = "tensor"
    recompute: str = "same"


def cells() -> list[Cell]:
    out = []
    for values in itertools.product(
        INPUT_VIA,
        EXTRA,
        (True, False),
        (True, False),
        ASKED,
        (False, True),
        (False, True),
        GRADS,
        (False, True),
        OUTPUT,
        RECOMPUTE,
    ):
        cell = Cell(*values)
        if cell.covered and cell.asked is not True:
            continue  # an enable-time decision that covers a call hands it its own use_reentrant
        if not (cell.upstream_trains or cell.layer_trains or cell.extra != "none"):
            continue  # nothing trains: no training step to compare
        out.append(cell)
    return out


class Layer(nn.Module):
    def __init__(self, nested: bool, ckpt, kw: dict, output: str, recompute: str) -> None:
        super().__init__()
        self.lin, self.inner = nn.Linear(4, 4), nn.Linear(4, 4)
        self.nested, self.ckpt, self.kw = nested, ckpt, kw
        self.output, self.recompute, self.calls = output, recompute, 0

    def forward(self, h, extra=None):
        inner = (
            self.ckpt(self.inner, h, **self.kw)
            if self.nested and self.ckpt is not None
            else self.inner(h)
        )
        z = self.lin(h) + inner
        self.calls += 1
        if self.recompute == "differs" and self.calls == 1:
            z = z.relu() - (-z).relu()  # the same values; two more saved tensors than a recompute
        out = torch.tanh(z)
        out = out if extra is None else out * extra
        if self.output == "dict":
            return {"h": out}
        return (out, None) if self.output == "tuple_none" else out


def _unwrap(result):
    """The layer's hidden state from what its call returned (OUTPUT)."""
    if isinstance(result, dict):
        return result["h"]
    return result[0] if isinstance(result, tuple) else result


class Net(nn.Module):
    def __init__(self, cell: Cell, ckpt, kw: dict) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up = nn.Linear(4, 4)
        self.layers = nn.ModuleList(
            Layer(cell.nested, ckpt, kw, cell.output, cell.recompute) for _ in range(2)
        )
        self.seed = nn.Parameter(torch.randn(4))
        self.proj = nn.Linear(4, 4)
        self.up.requires_grad_(cell.upstream_trains)
        for layer in self.layers:
            layer.requires_grad_(cell.layer_trains)


def _call(cell: Cell, ckpt, kw: dict, layer, h, extra):
    """One checkpointed layer call, in the cell's shape."""
    via = cell.input_via
    on_keyword = extra is not None and "keyword" in cell.extra
    if via == "positional":
        fn = functools.partial(layer, extra=extra) if on_keyword else (lambda x: layer(x, extra))
        return ckpt(fn, h, **kw)
    if via == "keyword":
        return ckpt(functools.partial(layer, h=h, extra=extra), **kw)
    if via == "partial_arg":
        return ckpt(functools.partial(layer, h, extra=extra), **kw)
    if via == "closure":
        return ckpt(lambda: layer(h, extra), **kw)
    if via in ("in_list", "in_dict"):
        box = [h] if via == "in_list" else {"h": h}

        def unbox(b, extra=None):
            return layer(b[0] if isinstance(b, list) else b["h"], extra)

        fn = functools.partial(unbox, extra=extra) if on_keyword else (lambda b: unbox(b, extra))
        return ckpt(fn, box, **kw)

    def run(layer=layer, h=h, extra=extra):
        return layer(h, extra)

    return ckpt(run, **kw)


def forward(cell: Cell, net: Net, ckpt, kw: dict):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    h = net.up(x)
    extra = None
    if cell.extra == "leaf_keyword":
        extra = net.seed
    elif cell.extra != "none":
        extra = net.proj(net.seed)  # a tensor with a graph of its own
    out = h
    for i, layer in enumerate(net.layers):
        used = extra if (i == 0 or cell.extra.startswith(("shared", "leaf"))) else None
        out = _unwrap(
            _call(cell, ckpt, kw, layer, out, used) if ckpt is not None else layer(out, used)
        )
    loss = out.pow(2).sum()
    if cell.extra.startswith("outside"):
        loss = loss + extra.sum()
    return loss


def gradients(cell: Cell, net: Net, loss, gcpatch: bool) -> dict:
    """The cell's way of taking gradients; torch's own autograd entries unless this is gcpatch's run
    (gcpatch wraps them for CK6, which the other ways must not get)."""
    params = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    grad, backward = torch.autograd.grad, torch.autograd.backward
    if not gcpatch:
        grad, backward = inspect.unwrap(grad), inspect.unwrap(backward)
    if cell.grads == "autograd.grad":
        got = grad(loss, [p for _, p in params], allow_unused=True)
        return {n: g for (n, _), g in zip(params, got)}
    backward(loss, inputs=[p for _, p in params] if cell.grads == "backward(inputs=)" else None)
    return {n: p.grad for n, p in params}


def outcome(cell: Cell, ckpt, kw: dict, gcpatch: bool = False) -> tuple[str, dict | None]:
    net = Net(cell, ckpt, kw)
    try:
        grads = gradients(cell, net, forward(cell, net, ckpt, kw), gcpatch)
    except Exception as exc:  # noqa: BLE001 (the outcome is the error)
        return f"crash: {type(exc).__name__}", None
    return "ran", grads


def exact(got: dict | None, ref: dict) -> bool:
    if got is None:
        return False
    return all(
        (got[n] is None) == (ref[n] is None)
        and (ref[n] is None or torch.allclose(got[n], ref[n], atol=1e-6))
        for n in ref
    )


class Spy:
    """The original checkpoint as gcpatch calls it: records what gcpatch changed."""

    def __init__(self, original) -> None:
        self.original, self.calls = original, []

    def __call__(self, function, *args, **kwargs):
        self.calls.append(kwargs.get("use_reentrant"))
        return self.original(function, *args, **kwargs)


def run(cell: Cell, original, gcpatch_call) -> dict:
    """The four ways of one cell, and what gcpatch did to its calls."""
    kw = {} if cell.asked is None else {"use_reentrant": cell.asked}
    if cell.context_fn:
        kw["context_fn"] = functools.partial(
            torch.utils.checkpoint.create_selective_checkpoint_contexts, [torch.ops.aten.mm.default]
        )
    ref_state, ref = outcome(cell, None, {})
    assert ref_state == "ran", (cell, ref_state)
    as_called = outcome(cell, original, kw)
    forced = outcome(cell, lambda *a, **k: original(*a, **{**k, "use_reentrant": False}), kw)
    spy = Spy(original)
    gcpatch = outcome(cell, gcpatch_call(spy, cell), kw, gcpatch=True)
    reentrant = kw.get("use_reentrant", True)
    changed = any(ur is not None and ur != reentrant for ur in spy.calls)
    return {
        "as_called": _verdict(as_called, ref),
        "forced": _verdict(forced, ref),
        "gcpatch": _verdict(gcpatch, ref),
        "changed": changed,
    }


def _verdict(result: tuple[str, dict | None], ref: dict) -> str:
    state, grads = result
    if state != "ran":
        return state
    return "exact" if exact(grads, ref) else "wrong"


def gcpatch_caller():
    """A factory of gcpatch-wrapped checkpoint functions, the engine started in fix mode."""
    from gcpatch import engine, resolve
    from gcpatch.call import checkpoint_call
    from gcpatch.schema import USE_REENTRANT, USER, Vote

    engine.start()
    logging.getLogger("gcpatch").setLevel(logging.CRITICAL)

    def make(spy: Spy, cell: Cell):
        # each cell is a program of its own: nothing seen of another cell's calls carries over
        checkpoint_call.reset()

        def ckpt(function, *args, **kwargs):
            return checkpoint_call.run(spy, None, (function, *args), kwargs)

        if (
            cell.covered
        ):  # the user asked reentrant at the enable call, and that decision covers the layers
            decision = resolve.resolve(
                [Vote(USE_REENTRANT, True, USER, "USER", "asked", plugin="core")], "fix"
            )
            ckpt = _Covering(ckpt, decision, checkpoint_call)
        return ckpt

    return make


class _Covering:
    """Covers each Net built with this checkpoint function by an enable-time decision (CK4)."""

    def __init__(self, ckpt, decision, checkpoint_call) -> None:
        self.ckpt, self.decision, self.checkpoint_call, self.seen = (
            ckpt,
            decision,
            checkpoint_call,
            set(),
        )

    def __call__(self, function, *args, **kwargs):
        for module in _modules(function):
            if id(module) not in self.seen:
                self.seen.add(id(module))
                self.checkpoint_call.cover(module, self.decision)
        return self.ckpt(function, *args, **kwargs)


def _modules(function) -> list:
    found, pending = [], [function]
    while pending:
        item = pending.pop()
        if isinstance(item, nn.Module):
            found.append(item)
        elif isinstance(item, functools.partial):
            pending += [item.func, *item.args]
        elif getattr(item, "__self__", None) is not None:
            pending.append(item.__self__)
        else:
            for c in getattr(item, "__closure__", None) or ():
                pending.append(c.cell_contents)
            pending += list(getattr(item, "__defaults__", None) or ())
    return found


def classify(result: dict) -> str:
    """worse: the call as made (plain) or the blunt patch is exact and gcpatch is not (a crash
    counts as not exact); overrode: gcpatch changed use_reentrant on a call whose gradients were
    exact as called."""
    if result["gcpatch"] != "exact" and "exact" in (result["as_called"], result["forced"]):
        return "worse"
    if result["as_called"] == "exact" and result["changed"]:
        return "overrode"
    return "ok"


def table(results: list[tuple[Cell, dict]]) -> str:
    """The committed summary: counts per outcome, and every cell that is not ok, with why."""
    total = len(results)
    counts = {
        k: sum(1 for _, r in results if classify(r) == k) for k in ("worse", "overrode", "ok")
    }
    exact_ways = {
        w: sum(1 for _, r in results if r[w] == "exact") for w in ("as_called", "forced", "gcpatch")
    }
    worse_than = {
        w: sum(1 for _, r in results if r[w] == "exact" and r["gcpatch"] != "exact")
        for w in ("as_called", "forced")
    }
    lines = [
        "# Checkpoint call grid: gcpatch against the blunt patch",
        "",
        "Generated by `python tests/kit/testkit/call_grid.py > tests/CALL_GRID.md`; `tests/unit/test_call_grid.py` checks it and "
        "the properties. Each cell is a checkpoint call shape on a tiny two-layer module, run four ways: no "
        "checkpointing (the reference), as called, forced non-reentrant (the blunt patch), and under gcpatch "
        "(fix mode). *worse*: the call as made (plain) or forced non-reentrant gets the reference's gradients "
        "and gcpatch does not (a crash is not exact). *overrode*: gcpatch changed use_reentrant on a call "
        "whose gradients were already exact as called.",
        "",
        f"Dimensions: hidden state {', '.join(INPUT_VIA)}; second tensor {', '.join(EXTRA)}; upstream trains "
        "or not; layer trains or not; use_reentrant True / unset / False; context_fn or not; nested "
        f"checkpoint or not; gradients by {', '.join(GRADS)}; covered by an enable-time reentrant ask or not; "
        f"the function returns {', '.join(OUTPUT)}; its recompute saves the {' or '.join(RECOMPUTE)} tensors.",
        "",
        "| cells | exact as called | exact forced non-reentrant | exact under gcpatch | gcpatch worse than "
        "plain | gcpatch worse than the blunt patch | gcpatch overrode an exact call |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| {total} | {exact_ways['as_called']} | {exact_ways['forced']} | {exact_ways['gcpatch']} | "
        f"{worse_than['as_called']} | {worse_than['forced']} | {counts['overrode']} |",
        "",
    ]
    groups: dict[tuple, list[Cell]] = {}
    for cell, result in results:
        kind = classify(result)
        if kind == "ok":
            continue
        groups.setdefault(
            (kind, _why(cell, result), result["as_called"], result["forced"], result["gcpatch"]), []
        ).append(cell)
    if groups:
        lines += [
            "## Cells that are not ok, grouped by why",
            "",
            "| kind | cells | as called | forced | gcpatch | why |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for (kind, why, a, f, g), members in sorted(
            groups.items(), key=lambda item: (item[0][0], -len(item[1]))
        ):
            lines.append(f"| {kind} | {len(members)} | {a} | {f} | {g} | {why} |")
        lines.append("")
    return "\n".join(lines)


def _why(cell: Cell, result: dict) -> str:
    if classify(result) == "overrode" and "closure" in cell.extra:
        return (
            "CK5: a tensor with a graph reaches the function through a closure, which gcpatch cannot pass "
            "positionally; reentrant is exact only while nothing else uses that tensor, which the call cannot "
            "know, so it runs non-reentrant (a crash avoided, not gradients)"
        )
    return f"unexplained: {cell}"


def main() -> None:
    original = torch.utils.checkpoint.checkpoint
    make = gcpatch_caller()
    results = [(cell, run(cell, original, make)) for cell in cells()]
    sys.stdout.write(table(results) + "\n")


if __name__ == "__main__":
    main()
