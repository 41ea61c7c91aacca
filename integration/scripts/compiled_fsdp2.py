"""A compiled training step under FSDP2 on 2 gloo CPU ranks: a tiny Llama, embedding frozen,
`gradient_checkpointing_enable()` with default arguments, `fully_shard` of every decoder layer and
the root, `torch.compile(model, backend="aot_eager")`, one step. Ordinary user code: nothing here
imports gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 compiled_fsdp2.py [--use-cache-off]
  --use-cache-off: `config.use_cache = False` by hand (what R6 does), a plain baseline that differs from
                   the default one only in the KV-cache warning transformers logs inside the forward
Prints one RESULT line per rank: the trainable gradients (full tensors) against the same weights run
eagerly without checkpointing or sharding, and dynamo's graph breaks by reason.
"""

from __future__ import annotations

import sys

import _common as c
import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch.distributed.fsdp import fully_shard


def frozen_llama():
    model = c.llama().train()
    model.model.embed_tokens.weight.requires_grad_(False)
    return model


def main() -> None:
    dist.init_process_group("gloo")
    ids = c.input_ids()
    reference = frozen_llama()
    reference(input_ids=ids, labels=ids).loss.backward()
    model = frozen_llama()
    model.gradient_checkpointing_enable()
    if "--use-cache-off" in sys.argv:
        model.config.use_cache = False
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    counters.clear()
    compiled = torch.compile(model, backend="aot_eager")
    compiled(input_ids=ids, labels=ids).loss.backward()
    got = {
        name: None if p.grad is None else p.grad.full_tensor().detach().clone()
        for name, p in model.named_parameters()
        if p.requires_grad
    }
    report = c.compare_grads(got, c.trainable_grads(reference), atol=1e-5)
    breaks = {reason.split("\n")[0]: n for reason, n in counters["graph_break"].items()}
    c.emit(
        {
            "rank": dist.get_rank(),
            "graph_breaks": sum(breaks.values()),
            "break_reasons": breaks,
            **report,
        }
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
