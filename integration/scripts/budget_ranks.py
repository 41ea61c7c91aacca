"""torchrun --nproc_per_node=2 (gloo, CPU): two ranks whose first steps differ, each training an
8-layer tiny Llama (budget_train.py's, 2 rows x 64 tokens, AdamW) with
`gradient_checkpointing_enable()`, or without checkpointing (`--checkpointing off`: the same job's
reference). Ordinary user code: nothing here imports gcpatch.

usage: python -m torch.distributed.run --nproc_per_node=2 budget_ranks.py
       --setup skip|evaluate|widths [--check loss|batch] [--checkpointing on|off]
  skip:     DDP. Rank 0's first batch is bad (every label masked: its loss is NaN); each rank runs
            its training forward, the ranks agree with an all_reduce of an ok flag, and both skip
            that step's backward and optimizer step; three steps follow. With --check batch rank 0
            sees the bad batch before its forward and runs none that step (rank 1 runs its forward).
  evaluate: DDP. Rank 0's first step only evaluates (model.eval(), no_grad, through the DDP wrapper)
            while rank 1 trains its first batch under `no_sync()` (gradient accumulation); the ranks
            then all_reduce the first step's losses for the log, and both train three steps with
            DDP's all-reduce (rank 1's accumulated gradients go with its second step's).
  widths:   no DDP: each rank trains its own model of the same class, rank 0 at hidden 64 and rank 1
            at hidden 128, three steps; the ranks all_reduce each step's loss for the log.

Each rank measures by itself what every training forward holds for the backward (the storages an
operator allocated during the forward that are still alive after it: _common.HeldBytes), how
many layers its backward recomputed, and a digest of every gradient it steps with (after DDP's
all-reduce; rank 1's accumulated first step before it), so that a run with GCPATCH_MEMORY_BUDGET
can be compared step by step and tensor by tensor with the same job without checkpointing. Prints
one RESULT line per rank.
"""

import argparse
import os
import warnings

import _common as c
import torch
import torch.distributed as dist
from budget_train import CONFIG, Recomputes, decoder_layers
from torch.nn.parallel import DistributedDataParallel as DDP

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROWS, TOKENS, STEPS = 2, 64, 4
WIDTHS = (64, 128)  # widths: rank 0's hidden size, rank 1's


def llama(hidden: int = CONFIG["hidden_size"]):
    return c.llama_of({**CONFIG, "hidden_size": hidden, "intermediate_size": 2 * hidden})


def batch(rank: int, step: int, masked: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    ids = torch.randint(0, c.VOCAB, (ROWS, TOKENS), generator=gen)
    labels = torch.full_like(ids, -100) if masked else ids.clone()
    return ids, labels


class Steps:
    """One rank's training steps, as measured by the script itself."""

    def __init__(self, model, forward) -> None:
        self.model, self.forward = model, forward
        self.counter = Recomputes(model)
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        self.log: list[dict] = []

    def train_forward(self, step: int, ids, labels):
        """The training forward, measured; returns the loss."""
        self.counter.backward, self.counter.count = False, 0
        torch.manual_seed(10 * step + dist.get_rank())  # attention dropout: the same on every run
        loss, held = c.held_forward(self.forward, ids, labels)
        self.log.append(
            {
                "step": step,
                "kind": "train",
                "rows": ids.shape[0],
                "tokens": ids.shape[1],
                "held": held,
                "loss": float(loss.detach()),
            }
        )
        return loss

    def backward(self, loss, kind: str = "train", update: bool = True) -> None:
        self.counter.backward = True
        loss.backward()
        self.counter.backward = False
        entry = self.log[-1]
        entry["kind"] = kind
        entry["recomputed"] = self.counter.count
        entry["grads"] = [c.digest([p.grad]) for p in self.model.parameters()]
        if update:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)

    def skip(self, why: str) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.log[-1].update(kind="skipped", why=why, grads=None)


def skip(rank: int, checkpointing: bool, check: str) -> Steps:
    model = llama()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    # the rotary table is the model's only buffer, the same on every rank: nothing to broadcast,
    # so a rank that runs no forward in a step meets the others at the flag's all_reduce
    ddp = DDP(model, broadcast_buffers=False)
    steps = Steps(model, ddp)
    for step in range(1, STEPS + 1):
        ids, labels = batch(rank, step, masked=rank == 0 and step == 1)
        loss = None
        if check == "loss" or bool((labels != -100).any()):
            loss = steps.train_forward(step, ids, labels)
            ok = bool(torch.isfinite(loss))
        else:  # a batch with nothing to learn from: not run
            steps.log.append({"step": step, "kind": "not run", "held": None})
            ok = False
        # a bad batch on any rank skips the step on all
        agreed = torch.tensor([1.0 if ok else 0.0])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if agreed.item() == 0.0:
            steps.skip("a rank's batch was bad")
            continue
        steps.backward(loss)
    return steps


def evaluate(rank: int, checkpointing: bool) -> Steps:
    model = llama()
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    ddp = DDP(model)
    steps = Steps(model, ddp)
    for step in range(1, STEPS + 1):
        ids, labels = batch(rank, step)
        if step == 1 and rank == 0:
            model.eval()
            with torch.no_grad():
                first = ddp(input_ids=ids, labels=labels).loss
            model.train()
            steps.log.append({"step": step, "kind": "eval", "loss": float(first)})
        elif step == 1:
            with ddp.no_sync():  # accumulated: all-reduced with the next step's gradients
                first = steps.train_forward(step, ids, labels)
                steps.backward(first, kind="accumulated", update=False)
        else:
            steps.backward(steps.train_forward(step, ids, labels))
        if step == 1:
            losses = torch.tensor([float(first.detach()) if rank == r else 0.0 for r in (0, 1)])
            dist.all_reduce(losses)  # rank 0's evaluation loss and rank 1's training loss, logged
    return steps


def widths(rank: int, checkpointing: bool) -> Steps:
    model = llama(WIDTHS[rank])
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    steps = Steps(model, model)
    for step in range(1, STEPS):
        ids, labels = batch(rank, step)
        loss = steps.train_forward(step, ids, labels)
        steps.backward(loss)
        logged = loss.detach().clone()
        dist.all_reduce(logged)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=("skip", "evaluate", "widths"), required=True)
    parser.add_argument("--checkpointing", choices=("on", "off"), default="on")
    parser.add_argument("--check", choices=("loss", "batch"), default="loss")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    checkpointing = args.checkpointing == "on"
    if args.setup == "skip":
        steps = skip(rank, checkpointing, args.check)
    else:
        steps = {"evaluate": evaluate, "widths": widths}[args.setup](rank, checkpointing)
    c.emit(
        {
            "scenario": "budget_ranks",
            "setup": args.setup,
            "check": args.check,
            "checkpointing": args.checkpointing,
            "rank": rank,
            "world": dist.get_world_size(),
            "hidden": steps.model.config.hidden_size,
            "layers": len(decoder_layers(steps.model)),
            "steps": steps.log,
            "params_after": c.digest(steps.model.parameters()),
        }
    )
    dist.barrier()
    c.end_ranks()


if __name__ == "__main__":
    main()
