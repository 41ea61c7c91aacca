"""torchrun --nproc_per_node=2 (gloo, CPU): DDP around the 8-layer tiny Llama of budget_train.py,
`gradient_checkpointing_enable()`, two steps with AdamW, each rank on its own batch. Ordinary user
code: nothing here imports gcpatch. Each rank prints which layers checkpoint after the first step,
what its second forward held (the first with the budget's plan; measured by budget_train's own
dispatch mode), how many layers its backward recomputed, and a digest of its (all-reduced)
gradients, so a run with GCPATCH_MEMORY_BUDGET can be compared rank by rank with the same run
without gcpatch.

With --lengths (e.g. 64:64,128:32,256:64, one `rank0:rank1` token count per step) the ranks'
batches differ in length within a step and from step to step, as under dynamic padding: each rank
reports every step's held bytes and flags.

usage: python -m torch.distributed.run --nproc_per_node=2 budget_ddp.py [--lengths ...]
"""

import argparse
import os
import warnings

import _common as c
import torch
import torch.distributed as dist
from budget_train import BATCH, SEQ, HeldBytes, Recomputes, decoder_layers, digest, llama
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = llama()
    model.gradient_checkpointing_enable()
    model.train()
    counter = Recomputes(model)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(50 + rank)
    lengths = (
        [int(pair.split(":")[rank]) for pair in args.lengths.split(",")] if args.lengths else []
    )
    ids = torch.randint(0, c.VOCAB, (BATCH, SEQ), generator=gen)
    first_held = None
    per_step = []
    # the budget's plan is made at the first step and applies from the second
    for step in range(1, 1 + (len(lengths) or 2)):
        if lengths:
            ids = torch.randint(0, c.VOCAB, (BATCH, lengths[step - 1]), generator=gen)
        opt.zero_grad(set_to_none=True)
        counter.backward, counter.count = False, 0
        torch.manual_seed(10 * step + rank)
        with HeldBytes() as held:
            loss = ddp(input_ids=ids, labels=ids).loss
        nbytes = held.alive()
        first_held = nbytes if first_held is None else first_held
        counter.backward = True
        loss.backward()
        grads = digest(p.grad for p in model.parameters())
        opt.step()
        per_step.append(
            {
                "tokens": ids.shape[1],
                "held": nbytes,
                "flags": [bool(m.gradient_checkpointing) for m in decoder_layers(model)],
                "grads": grads,
            }
        )
    c.emit(
        {
            "scenario": "budget_ddp",
            "rank": rank,
            "world": dist.get_world_size(),
            "held_bytes": nbytes,
            "first_step_held_bytes": first_held,
            "recomputed": counter.count,
            "flags": [bool(m.gradient_checkpointing) for m in decoder_layers(model)],
            "second_step_grads": grads,
            "params_after": digest(model.parameters()),
            "rng_after": torch.rand(2).tolist(),
            "steps": per_step,
        }
    )
    dist.barrier()
    c.end_ranks()


if __name__ == "__main__":
    main()
