"""torchrun + gloo on CPU: a tiny Llama checkpointed with use_reentrant=True inside
DDP(find_unused_parameters=True) (R4's set-up), one training step compared with the same DDP model
without checkpointing. Ordinary user code: gcpatch comes in through GCPATCH=1, the fault through
the fault kit's plugin (FAULT_HOOK / FAULT_RANK). Each rank writes RESULT_DIR/rank<N>.json."""

import json
import os
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore")


def llama():
    torch.manual_seed(0)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).train()


def checkpoint_use_reentrant(model):
    found = set()
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if func is None or not getattr(module, "gradient_checkpointing", False):
            continue
        while not hasattr(func, "keywords") and hasattr(func, "func"):
            func = func.func
        found.add(repr(getattr(func, "keywords", {}).get("use_reentrant")))
    return sorted(found)


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(rank))
    ref = DDP(llama(), find_unused_parameters=True)
    ref(input_ids=ids, labels=ids).loss.backward()
    result = {"rank": rank, "world": dist.get_world_size(), "error": None, "max_grad_err": None}
    try:
        model = llama()
        ask = os.environ.get("ASK_REENTRANT", "1") == "1"  # R4's set-up asks reentrant
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ask})
        ddp = DDP(model, find_unused_parameters=True)
        result["use_reentrant"] = checkpoint_use_reentrant(model)
        for _ in range(2):  # the second step is where "marked ready twice" shows with reentrant
            ddp.zero_grad(set_to_none=True)
            ddp(input_ids=ids, labels=ids).loss.backward()
        errs = [
            (p.grad - r.grad).abs().max().item() if p.grad is not None else float("inf")
            for p, r in zip(ddp.module.parameters(), ref.module.parameters())
            if r.grad is not None
        ]
        result["max_grad_err"] = max(errs)
    except Exception as exc:  # noqa: BLE001
        result["error"] = f"{type(exc).__name__}: {exc}"[:1500]
    with open(os.path.join(os.environ["RESULT_DIR"], f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)  # a file per rank: torchrun interleaves the ranks' stdout
    if result["error"] is None:
        dist.barrier()  # no rank tears gloo down while another still finishes its step
    dist.destroy_process_group()
    # Leave before the DDP wrappers die: the Reducer dropping the last reference to the gloo group
    # with the GIL held can deadlock in ~ProcessGroupGloo (seen plainly, without gcpatch; the class
    # of pytorch/pytorch#56297). The rank's result is on disk.
    os._exit(0)


if __name__ == "__main__":
    main()
