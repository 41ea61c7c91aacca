"""FSDP2 (`fully_shard`, gloo on CPU, 2 ranks) with FSDP's own `apply_activation_checkpointing`
(reentrant) around decoder layers that transformers also checkpoints (reentrant asked): how many
times each layer runs per step, and the gradients against the same model without checkpointing.

Ordinary user code: nothing here imports gcpatch.
"""

from __future__ import annotations

import argparse
import functools

import torch.distributed as dist
from _common import compare_grads, emit, input_ids, llama

parser = argparse.ArgumentParser()
parser.add_argument("--impl", choices=("reentrant", "no_reentrant"), default="reentrant")
args = parser.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # noqa: E402
    CheckpointImpl,
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard  # noqa: E402
from transformers.models.llama.modeling_llama import LlamaDecoderLayer  # noqa: E402

ids = input_ids()

# the reference: the same weights, no checkpointing, no sharding (both ranks see the same batch)
reference = llama()
reference.train()
reference(input_ids=ids, labels=ids).loss.backward()
ref = {n: p.grad.detach().clone() for n, p in reference.named_parameters()}

model = llama()
model.train()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
impl = CheckpointImpl.REENTRANT if args.impl == "reentrant" else CheckpointImpl.NO_REENTRANT
apply_activation_checkpointing(
    model,
    checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper, checkpoint_impl=impl),
    check_fn=lambda m: isinstance(m, LlamaDecoderLayer),
)
runs = {}
for i, layer in enumerate(model.model.layers):
    layer.mlp.register_forward_pre_hook(lambda m, a, i=i: runs.__setitem__(i, runs.get(i, 0) + 1))
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
error = None
try:
    model(input_ids=ids, labels=ids).loss.backward()
    got = {}
    for name, param in model.named_parameters():
        clean = name.replace("_checkpoint_wrapped_module.", "")
        got[clean] = None if param.grad is None else param.grad.full_tensor().detach().clone()
    report = compare_grads(got, ref, atol=1e-6)
except Exception as exc:  # the plain run's failure is the result
    error, report = f"{type(exc).__name__}: {exc}", {}
emit(
    {
        "rank": rank,
        "world": dist.get_world_size(),
        "error": error,
        "layer_runs": [runs.get(i, 0) for i in range(len(runs))],
        "max_layer_runs": max(runs.values()) if runs else 0,
        **report,
    }
)
dist.destroy_process_group()
