"""Code that calls `torch.utils.checkpoint.checkpoint` itself, on a hand-written model (no
transformers): the calls gcpatch meets only at the checkpoint call.

--case frozen_embedding   reentrant asked after a frozen embedding: no input of the first block
                          requires grad (reentrant drops its gradients; CK1)
--case frozen_embedding_global   the same, the block reached through a module-level function that
                          looks it up in a global (nothing the call holds shows what runs inside)
--case context_fn         selective checkpointing, use_reentrant not passed (torch's default is
                          reentrant, which refuses context_fn; CK3)
--case context_fn_non_reentrant   the same asked non-reentrant: must stay non-reentrant
--case correct_reentrant  all trainable, reentrant asked: correct as called, left untouched
--case nested             blocks checkpointed by the loop that also checkpoint their own inner
                          module (recomputed twice; CK2)
--case curried_frozen_embedding   frozen_embedding through torch 2.14's curried form,
                          `checkpoint(use_reentrant=True)(block)(h)`
--case decorated_frozen_embedding frozen_embedding through a method decorated
                          `@checkpoint(use_reentrant=True)` (torch 2.14's decorator form)
--case nested_curried     nested, the inner module checkpointed non-reentrant through the
                          curried form with an option of torch 2.14's
                          (respect_saved_tensors_hooks)

A case torch has no form for prints `"unsupported"` and its torch version.

Ordinary user code: nothing here imports gcpatch.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--case", required=True)
parser.add_argument("--reentrant", choices=("true", "false"), default="true")
args = parser.parse_args()
REENTRANT = args.reentrant == "true"
RUNS: dict[str, int] = {}
# torch 2.14 and later: `checkpoint(**options)` returns a decorator
CURRIED = tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 14)


def policy(ctx, op, *a, **k):
    from torch.utils.checkpoint import CheckpointPolicy

    return (
        CheckpointPolicy.MUST_SAVE
        if op is torch.ops.aten.addmm.default
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


class Inner(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(dim, dim)

    def forward(self, h):
        RUNS["inner"] = RUNS.get("inner", 0) + 1
        return torch.tanh(self.lin(h))


class Block(nn.Module):
    def __init__(self, dim: int, nested: bool) -> None:
        super().__init__()
        self.inner, self.norm, self.nested = Inner(dim), nn.LayerNorm(dim), nested

    def forward(self, h):
        if self.nested == "curried":
            options = {"use_reentrant": False, "respect_saved_tensors_hooks": True}
            inner = checkpoint(**options)(self.inner)(h)
        elif self.nested:
            inner = checkpoint(self.inner, h, use_reentrant=REENTRANT)
        else:
            inner = self.inner(h)
        return h + self.norm(inner)


class Net(nn.Module):
    def __init__(self, nested: bool | str = False, dim: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, dim)
        self.blocks = nn.ModuleList(Block(dim, nested) for _ in range(3))
        self.head = nn.Linear(dim, 50)

    def forward(self, ids, ckpt):
        h = self.emb(ids)
        for block in self.blocks:
            h = ckpt(block, h) if ckpt else block(h)
        return self.head(h)


# frozen_embedding_global: module-level functions that look their block up in a global table
BLOCKS: dict = {}


def run_block_0(h):
    return BLOCKS[0](h)


def run_block_1(h):
    return BLOCKS[1](h)


def run_block_2(h):
    return BLOCKS[2](h)


RUNNERS = (run_block_0, run_block_1, run_block_2)


def through_global(block, h):
    index = next((i for i, b in BLOCKS.items() if b is block), None)
    if index is None:
        index = len(BLOCKS) % len(RUNNERS)
        BLOCKS[index] = block
    return checkpoint(RUNNERS[index], h, use_reentrant=REENTRANT)


def decorated():
    """A block runner whose method is checkpointed by torch 2.14's decorator form (defined only
    where asked: on an older torch the decorator line itself raises)."""

    class Runner:
        @checkpoint(use_reentrant=REENTRANT)
        def run(self, block, h):
            return block(h)

    runner = Runner()
    return lambda block, h: runner.run(block, h)


def call(case):
    if case in ("frozen_embedding", "correct_reentrant", "nested", "nested_curried"):
        return lambda block, h: checkpoint(block, h, use_reentrant=REENTRANT)
    if case == "curried_frozen_embedding":
        return lambda block, h: checkpoint(use_reentrant=REENTRANT)(block)(h)
    if case == "decorated_frozen_embedding":
        return decorated()
    if case == "frozen_embedding_global":
        return through_global
    context = functools.partial(torch.utils.checkpoint.create_selective_checkpoint_contexts, policy)
    if case == "context_fn":
        return lambda block, h: checkpoint(block, h, context_fn=context)
    if case == "context_fn_non_reentrant":
        return lambda block, h: checkpoint(block, h, use_reentrant=False, context_fn=context)
    raise SystemExit(f"unknown case {case}")


def step(ckpt):
    torch.manual_seed(0)
    BLOCKS.clear()
    model = Net(nested={"nested": True, "nested_curried": "curried"}.get(args.case, False))
    if "frozen_embedding" in args.case:
        model.emb.weight.requires_grad_(False)
    ids = torch.randint(0, 50, (2, 8), generator=torch.Generator().manual_seed(1))
    RUNS.clear()
    out = model(ids, ckpt)
    grad_fns = sorted({type(t.grad_fn).__name__ for t in [out]})
    out.float().pow(2).mean().backward()
    grads = {
        n: (None if p.grad is None else p.grad.clone())
        for n, p in model.named_parameters()
        if p.requires_grad
    }
    return grads, dict(RUNS), grad_fns


def main():
    result = {"case": args.case, "error": None, "torch": torch.__version__}
    if ("curried" in args.case or "decorated" in args.case) and not CURRIED:
        result["unsupported"] = True
        print("RESULT " + json.dumps(result, sort_keys=True), flush=True)
        return
    ref, _, _ = step(None)
    try:
        got, runs, _ = step(call(args.case))
        wrong = sorted(n for n in ref if got[n] is None or not torch.equal(got[n], ref[n]))
        result.update(
            trainable=len(ref),
            wrong=len(wrong),
            wrong_names=wrong,
            inner_runs_per_block=runs.get("inner", 0) / 3,
        )
        # which variant really ran: reentrant leaves CheckpointFunctionBackward in the graph
        torch.manual_seed(0)
        BLOCKS.clear()
        model = Net()
        if "frozen_embedding" in args.case:
            model.emb.weight.requires_grad_(False)
        h = model.emb(torch.zeros(1, 4, dtype=torch.long))
        out = call(args.case)(model.blocks[0], h)
        result["ran_reentrant"] = type(out.grad_fn).__name__ == "CheckpointFunctionBackward"
    except Exception as exc:  # the plain run's failure is the result
        result["error"] = f"{type(exc).__name__}: {exc}"
    module = sys.modules.get("gcpatch")
    result.update(gcpatch_loaded=module is not None, env_GCPATCH=os.environ.get("GCPATCH"))
    print("RESULT " + json.dumps(result, sort_keys=True), flush=True)


main()
