"""FSDP with each LlamaDecoderLayer its own unit (as transformers' and accelerate's
transformer-based wrap policy makes it) on 2 gloo CPU ranks, the model's checkpointing enabled
before the wrap. Ordinary user code: nothing here imports gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 fsdp_all_gather.py --fsdp 1|2 --ask none|true|false|nogc
  --fsdp 1: FSDP1 `FullyShardedDataParallel`, FULL_SHARD, transformer_auto_wrap_policy
  --fsdp 2: FSDP2 `fully_shard` of each layer and the root, each layer prefetching the next in
            forward (`set_modules_to_forward_prefetch`) and the previous in backward
  --ask none: gradient_checkpointing_enable() with no kwargs (transformers 4.x then runs reentrant)
  --ask true/false: gradient_checkpointing_kwargs={"use_reentrant": ...}; nogc: no checkpointing

Where the checkpoint call encloses FSDP's unshard, reentrant recompute runs it again inside
backward: FSDP1 all-gathers a unit's parameters a second time (transformers#30404, pytorch#105635)
where the stack's loop checkpoints the wrapped layer (`_gradient_checkpointing_func(layer.__call__)`,
before GradientCheckpointingLayer); FSDP2's hooks, whose forward prefetch then runs again, sit inside
the checkpoint there and also where GradientCheckpointingLayer checkpoints `nn.Module.__call__`.
Prints one RESULT line per rank: where the checkpoint sits, the all-gathers in forward and in
backward, and every gradient against the same weights without checkpointing or sharding.
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.distributed as dist
import torch.distributed.fsdp._flat_param as flat_param
import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
from _common import checkpoint_use_reentrant, compare_grads, emit, input_ids, llama, trainable_grads
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy


def checkpoint_site(layer_cls) -> str:
    """loop: the model's loop checkpoints `layer.__call__`; layer_call: GradientCheckpointingLayer's
    `__call__` checkpoints `nn.Module.__call__` (hooks inside); layer_forward: it checkpoints `forward`."""
    base = next((c for c in layer_cls.__mro__ if c.__name__ == "GradientCheckpointingLayer"), None)
    return "loop" if base is None else "layer_call" if "__call__" in vars(base) else "layer_forward"


parser = argparse.ArgumentParser()
parser.add_argument("--fsdp", choices=("1", "2"), default="1")
parser.add_argument("--ask", choices=("none", "true", "false", "nogc"), default="none")
args = parser.parse_args()

gathers = [0]
_all_gather = flat_param.FlatParamHandle._all_gather_flat_param


_foreach_all_gather = param_group.foreach_all_gather


def counted(self, *a, **k):
    gathers[0] += 1
    return _all_gather(self, *a, **k)


def counted2(*a, **k):
    gathers[0] += 1
    return _foreach_all_gather(*a, **k)


flat_param.FlatParamHandle._all_gather_flat_param = counted  # each FSDP1 unshard of a unit
param_group.foreach_all_gather = counted2  # each FSDP2 unshard of a parameter group

dist.init_process_group("gloo")
rank = dist.get_rank()
ids = input_ids()
reference = llama()
reference.train()
reference(input_ids=ids, labels=ids).loss.backward()
ref = trainable_grads(reference)

model = llama()
model.train()
if args.ask == "none":
    model.gradient_checkpointing_enable()
elif args.ask != "nogc":
    model.gradient_checkpointing_enable(
        gradient_checkpointing_kwargs={"use_reentrant": args.ask == "true"}
    )
layer_cls = type(model.model.layers[0])
applied = checkpoint_use_reentrant(model)
if args.fsdp == "1":
    sharded = FSDP(
        model,
        device_id=torch.device("cpu"),
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=functools.partial(
            transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}
        ),
        use_orig_params=True,
    )
else:
    layers = list(model.model.layers)
    for layer in layers:
        fully_shard(layer)
    sharded = fully_shard(model)
    for layer, following in zip(layers, layers[1:]):
        layer.set_modules_to_forward_prefetch([following])
        following.set_modules_to_backward_prefetch([layer])
gathers[0] = 0
loss = sharded(input_ids=ids, labels=ids).loss
forward_gathers = gathers[0]
loss.backward()
backward_gathers = gathers[0] - forward_gathers
if args.fsdp == "1":
    with FSDP.summon_full_params(sharded, with_grads=True):
        got = {
            name.replace("_fsdp_wrapped_module.", ""): None
            if p.grad is None
            else p.grad.detach().clone()
            for name, p in sharded.named_parameters()
            if p.requires_grad
        }
else:
    got = {
        name: None if p.grad is None else p.grad.full_tensor().detach().clone()
        for name, p in sharded.named_parameters()
        if p.requires_grad
    }
units = sum(
    type(m).__name__.startswith(("FullyShardedDataParallel", "FSDP")) for m in sharded.modules()
)
emit(
    {
        "rank": rank,
        "world": dist.get_world_size(),
        "fsdp": args.fsdp,
        "units": units,
        "forward_all_gathers": forward_gathers,
        "backward_all_gathers": backward_gathers,
        "applied_use_reentrant": checkpoint_use_reentrant(model),
        "enabled_use_reentrant": applied,
        "checkpoint_site": checkpoint_site(layer_cls),
        **compare_grads(got, ref, atol=1e-6),
    }
)
dist.barrier()  # no rank tears gloo down while another still talks to it
dist.destroy_process_group()
