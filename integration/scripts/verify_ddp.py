"""torchrun --nproc_per_node=2 (gloo, CPU): DDP around a tiny Llama with dropout, checkpointed
with use_reentrant=True, trained 2 steps with AdamW. Ordinary user code: nothing here imports
gcpatch. Each rank prints digests of its first step's (all-reduced) gradients, its parameters
and optimizer state after training and its RNG stream afterwards, so a run with
GCPATCH_VERIFY=1 can be compared with one without, rank by rank.

usage: python -m torch.distributed.run --nproc_per_node=2 verify_ddp.py --find-unused no|yes
  no:  DDP(model): reentrant is kept (no rule applies); verify's own backward runs reentrant
  yes: DDP(model, find_unused_parameters=True): gcpatch's R4 switches to non-reentrant
"""

import argparse
import os
import warnings

import _common as c
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from verify_train import digest, llama, optimizer_tensors

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--find-unused", choices=("no", "yes"), default="no")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()

    model = llama()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ddp = DDP(model, find_unused_parameters=args.find_unused == "yes")
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    torch.manual_seed(2024 + rank)
    losses, first = [], None
    for step in range(args.steps):
        ids = c.input_ids(batch=4, seed=100 * step + rank)
        opt.zero_grad(set_to_none=True)
        loss = ddp(input_ids=ids, labels=ids).loss
        loss.backward()
        if first is None:
            first = digest(p.grad for p in model.parameters())
        opt.step()
        losses.append(loss.item())
    c.emit(
        {
            "scenario": "verify_ddp",
            "rank": rank,
            "world": dist.get_world_size(),
            "losses": losses,
            "first_step_grads": first,
            "params_after": digest(model.parameters()),
            "optimizer_state": digest(optimizer_tensors(opt)),
            "rng_after": torch.rand(4).tolist(),
            "applied_use_reentrant": c.checkpoint_use_reentrant(model),
        }
    )
    dist.barrier()
    c.end_ranks()


if __name__ == "__main__":
    main()
