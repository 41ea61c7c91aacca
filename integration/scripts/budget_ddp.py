"""torchrun --nproc_per_node=2 (gloo, CPU): DDP around the 8-layer tiny Llama of budget_train.py,
`gradient_checkpointing_enable()`, one step with AdamW, each rank on its own batch. Ordinary user code:
nothing here imports gcpatch. Each rank prints which layers checkpoint after the first step, what
its forward held (measured by budget_train's own dispatch mode), how many layers its backward
recomputed, and a digest of its (all-reduced) gradients, so a run with GCPATCH_MEMORY_BUDGET can be
compared rank by rank with the same run without gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 budget_ddp.py
"""

import os
import warnings

import _common as c
import torch
import torch.distributed as dist
from budget_train import BATCH, SEQ, HeldBytes, Recomputes, decoder_layers, digest, llama
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
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
    ids = torch.randint(0, c.VOCAB, (BATCH, SEQ), generator=gen)
    torch.manual_seed(11 + rank)
    with HeldBytes() as held:
        loss = ddp(input_ids=ids, labels=ids).loss
    nbytes = held.alive()
    counter.backward = True
    loss.backward()
    grads = digest(p.grad for p in model.parameters())
    opt.step()
    c.emit(
        {
            "scenario": "budget_ddp",
            "rank": rank,
            "world": dist.get_world_size(),
            "held_bytes": nbytes,
            "recomputed": counter.count,
            "flags": [bool(m.gradient_checkpointing) for m in decoder_layers(model)],
            "first_step_grads": grads,
            "params_after": digest(model.parameters()),
            "rng_after": torch.rand(2).tolist(),
        }
    )
    dist.barrier()
    c.end_ranks()


if __name__ == "__main__":
    main()
