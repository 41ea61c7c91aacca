"""accelerate's FSDP plugin (FSDP2, `fully_shard` of each LlamaDecoderLayer and the root,
reshard_after_forward) on 2 gloo CPU ranks; the model's checkpointing enabled before
`accelerator.prepare`, as the Trainer does. Ordinary user code: nothing here imports gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 fsdp_frozen.py --reentrant true|false|nogc --model frozen|all
  frozen: embeddings and layer 0 frozen, the batch as inputs_embeds (which transformers' own
          input-grads hook does not cover); all: every parameter trains, the batch as input_ids
  --fsdp-ac: accelerate's own activation checkpointing as well (FSDP's checkpoint_wrapper)

accelerate runs FSDP only on an accelerator (on CPU it picks MULTI_CPU and wraps DDP), so the
state is set to FSDP by hand: prepare() then takes the very path it takes on GPUs.
Prints one RESULT line per rank: the trainable gradients against the same weights without
checkpointing or sharding, and the FSDP2 all-gathers in forward and in backward.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
from _common import compare_grads, emit, freeze_embeddings_and_first_layer, input_ids, llama

parser = argparse.ArgumentParser()
parser.add_argument("--reentrant", choices=("true", "false", "nogc"), default="true")
parser.add_argument("--model", choices=("frozen", "all"), default="frozen")
parser.add_argument("--fsdp-ac", action="store_true")
args = parser.parse_args()

gathers = [0]
_all_gather = param_group.foreach_all_gather


def counted(*a, **k):
    gathers[0] += 1
    return _all_gather(*a, **k)


param_group.foreach_all_gather = counted  # each FSDP2 unshard of a parameter group

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402

plugin = FullyShardedDataParallelPlugin(
    fsdp_version=2,
    auto_wrap_policy="transformer_based_wrap",
    transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
    reshard_after_forward=True,
    activation_checkpointing=args.fsdp_ac,
)
accelerator = Accelerator(cpu=True)
accelerator.state.distributed_type = DistributedType.FSDP
accelerator.state.fsdp_plugin = plugin
rank = dist.get_rank()

frozen = args.model == "frozen"
ids = input_ids()
reference = llama()
if frozen:
    freeze_embeddings_and_first_layer(reference)
reference.train()
embeds = reference.get_input_embeddings()(ids).detach() if frozen else None
batch = {"inputs_embeds": embeds} if frozen else {"input_ids": ids}
reference(**batch, labels=ids).loss.backward()
ref = {
    n: p.grad.detach().clone() if p.grad is not None else None
    for n, p in reference.named_parameters()
    if p.requires_grad
}

model = llama()
if frozen:
    freeze_embeddings_and_first_layer(model)
model.train()
if args.reentrant != "nogc":
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": args.reentrant == "true"}
    )
optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0)
model, optimizer = accelerator.prepare(model, optimizer)
gathers[0] = 0
error, report, forward_gathers = None, {}, 0
try:
    loss = model(**batch, labels=ids).loss
    forward_gathers = gathers[0]
    loss.backward()
    got = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            clean = name.replace("_checkpoint_wrapped_module.", "")
            got[clean] = None if param.grad is None else param.grad.full_tensor().detach().clone()
    report = compare_grads(got, ref, atol=1e-6)
except Exception as exc:  # the plain run's failure is the result
    error = f"{type(exc).__name__}: {exc}"
layer = model.model.layers[0]
func = getattr(layer, "_gradient_checkpointing_func", None)
emit(
    {
        "rank": rank,
        "world": dist.get_world_size(),
        "error": error,
        "model_class": type(model).__name__,
        # accelerate 1.15 wraps each decoder layer, 1.12 each of its children; fully_shard
        # renames a sharded module's class (FSDPCheckpointWrapper), its bases stay
        "checkpoint_wrappers": sum(
            any(c.__name__ == "CheckpointWrapper" for c in type(m).__mro__) for m in model.modules()
        ),
        "forward_all_gathers": forward_gathers,
        "backward_all_gathers": gathers[0] - forward_gathers,
        "applied_use_reentrant": (getattr(func, "keywords", None) or {}).get(
            "use_reentrant", "unset"
        )
        if getattr(layer, "gradient_checkpointing", False)
        else "no checkpointed layer",
        **report,
    }
)
dist.destroy_process_group()
