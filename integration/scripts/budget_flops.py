"""What a memory budget's plan holds and recomputes on an 8-layer Llama (hidden 256, batch 2 x 256
tokens, fp32, dropout 0): the same model, from the same seed and on the same two batches, trained
two steps with checkpointing never enabled (`none`) and then with `gradient_checkpointing_enable()`
asking for `use_reentrant=False`
(`enabled`: under GCPATCH=1 with GCPATCH_MEMORY_BUDGET set, the budget's plan; plainly, full
checkpointing). Ordinary user code: nothing here imports gcpatch.

At the second step the script measures by itself
  held   every storage an operator allocated inside the forward and still alive after it (a
         dispatch mode of its own): what the backward holds;
  flops  torch.utils.flop_counter.FlopCounterMode's total over the backward (matmuls and
         attention): with checkpointing, the backward's own plus what it recomputes;
and compares the second step's trainable gradients with the run without checkpointing.

usage: budget_flops.py
prints one line: RESULT {json}
"""

import os
import warnings

import _common as c
import torch
from torch.utils.flop_counter import FlopCounterMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS, HIDDEN, BATCH, SEQ, VOCAB = 8, 256, 2, 256, 256


def llama():
    # the MLP at 688: Llama's ratio, a multiple of 8
    config = c.llama_config(
        LAYERS, HIDDEN, HIDDEN * 43 // 16, vocab_size=VOCAB, max_position_embeddings=1024
    )
    return c.llama_of(config)


def batches() -> list:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(2)]


def train(checkpointing: bool) -> dict:
    model = llama()
    if checkpointing:
        # non-reentrant, as a user who wants the levers between plain and whole asks on 4.x (whose
        # default is reentrant, which selective checkpointing cannot run under); 5.x's default
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    out = {}
    for step, ids in enumerate(batches(), start=1):
        opt.zero_grad(set_to_none=True)
        loss, nbytes = c.held_forward(model, ids)
        with FlopCounterMode(display=False) as flops:
            loss.backward()
        if step == 2:
            out = {
                "held": nbytes,
                "backward_flops": flops.get_total_flops(),
                "grads": c.trainable_grads(model),
                "checkpointed": c.checkpointed_layers(model),
            }
        opt.step()
    return out


def main() -> None:
    warnings.filterwarnings("ignore")
    none = train(checkpointing=False)
    enabled = train(checkpointing=True)
    compared = c.compare_grads(enabled.pop("grads"), none.pop("grads"), atol=1e-5)
    c.emit(
        {
            "scenario": "budget_flops",
            "shape": [BATCH, SEQ],
            "layers": LAYERS,
            "budget": os.environ.get("GCPATCH_MEMORY_BUDGET"),
            "none": none,
            "enabled": enabled,
            "held_fraction": enabled["held"] / none["held"],
            "recomputed_flops": enabled["backward_flops"] - none["backward_flops"],
            "wrong": compared["wrong"],
            "grad_none": compared["grad_none"],
        }
    )


if __name__ == "__main__":
    main()
