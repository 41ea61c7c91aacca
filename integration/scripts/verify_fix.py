"""One training step of a model whose checkpointing is wrong in a way no call-site rule sees: the
layers take their hidden states by keyword (_kwarg_model.py), reentrant is asked, and the run
blocks gcpatch's torch plugin (GCPATCH_DISABLE_PLUGINS=torch), so only verify can find it. With
--offloader the layers checkpoint through a tool's own reentrant-only function in place of
transformers' `checkpoint` (as offloading checkpointers do), which no use_reentrant can correct;
--no-checkpointing is the same step with checkpointing never enabled. Ordinary user code: nothing
here imports gcpatch.

Prints the first step's figures as digests, so that two runs compare bit for bit: the gradients,
the optimizer state after the step, the loss, and the RNG state after the step; and how many
trainable tensors got no gradient.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402
from _kwarg_model import build  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--reentrant", choices=("true", "false"), required=True)
parser.add_argument("--offloader", action="store_true")
parser.add_argument("--no-checkpointing", action="store_true")
args = parser.parse_args()


class _Offload(torch.autograd.Function):
    """A reentrant-only checkpoint of its own (no RNG state kept, positional inputs only)."""

    @staticmethod
    def forward(ctx, run, *inputs):
        ctx.run = run
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return run(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        with torch.enable_grad():
            out = ctx.run(*inputs)
        torch.autograd.backward(out, grads)
        return (None, *(t.grad for t in inputs))


def offload_checkpoint(function, *inputs, use_reentrant=None, **kwargs):
    return _Offload.apply(function, *inputs)


if args.offloader:
    import transformers.modeling_utils

    transformers.modeling_utils.checkpoint = offload_checkpoint


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(b"none" if t is None else t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


model = build()
model.train()
if not args.no_checkpointing:
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": args.reentrant == "true"}
    )
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
torch.manual_seed(5)
ids = torch.randint(0, model.config.vocab_size, (4, 12))
loss = model(input_ids=ids, labels=ids).loss
loss.backward()
grads = [p.grad for p in model.parameters()]
missing = sum(1 for g in grads if g is None)
grad_digest = digest(grads)
optimizer.step()
state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
print(
    "RESULT "
    + json.dumps(
        {
            "trainable": len(grads),
            "missing": missing,
            "grads": grad_digest,
            "loss": loss.item(),
            "optimizer_state": digest(state),
            "params_after": digest(list(model.parameters())),
            "rng_after": digest([torch.get_rng_state()]),
        }
    ),
    flush=True,
)
