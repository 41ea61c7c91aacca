"""Scenario 3: torchrun --nproc_per_node=2, gloo, DDP(find_unused_parameters=True) around a tiny
Llama checkpointed with use_reentrant=True. Ordinary user code: nothing here imports gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 ddp_unused.py --frozen no|yes
  no:  all parameters train
  yes: embed_tokens and layers[0] frozen

The reference is an identical DDP model without checkpointing, same batch per rank (so the same
all-reduced gradients are expected). Each rank prints one RESULT line.
"""

import argparse
import os
import warnings

import _common as c
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build(frozen: bool):
    model = c.llama()
    if frozen:
        c.freeze_embeddings_and_first_layer(model)
    model.train()
    return model


def step(ddp_model, ids):
    ddp_model.zero_grad(set_to_none=True)
    out = ddp_model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--frozen", choices=("no", "yes"), default="no")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    frozen = args.frozen == "yes"

    ref = DDP(build(frozen), find_unused_parameters=True)
    model = build(frozen)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ddp = DDP(model, find_unused_parameters=True)

    result = {
        "scenario": "ddp_unused",
        "frozen": args.frozen,
        "rank": rank,
        "world": dist.get_world_size(),
    }
    error = None
    wrong_per_step = []
    try:
        for s in range(args.steps):
            ids = c.input_ids(seed=100 * s + rank)
            ref_loss = step(ref, ids)
            reference = c.trainable_grads(ref.module)
            loss = step(ddp, ids)
            got = c.trainable_grads(ddp.module)
            cmp = c.compare_grads(got, reference)
            wrong_per_step.append(
                {
                    "step": s,
                    "wrong": cmp["wrong"],
                    "grad_none": cmp["grad_none"],
                    "trainable": cmp["trainable"],
                    "loss_equal": bool(torch.allclose(loss, ref_loss, atol=1e-6)),
                }
            )
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:500]
    result.update(
        {
            "error": error,
            "steps": wrong_per_step,
            "applied_use_reentrant": c.checkpoint_use_reentrant(ddp.module),
            "use_cache": ddp.module.config.use_cache,
        }
    )
    c.emit(result)
    if error is None:
        dist.barrier()
    c.end_ranks()


if __name__ == "__main__":
    main()
