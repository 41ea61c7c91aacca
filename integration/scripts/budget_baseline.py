"""What a fractional memory budget is a fraction of: the activation bytes the user's own step would
hold without checkpointing. An 8-layer tiny Llama (hidden 64, dropout 0) whose embeddings and
bottom half of the layers are frozen (requires_grad False) is trained twice on the same batches
from the same initial weights: first with checkpointing never enabled (the job as it would run
without checkpointing: the frozen bottom builds no graph and holds nothing), then with
`gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})` (and, under
GCPATCH=1, GCPATCH_MEMORY_BUDGET as the environment sets it). Ordinary user code: nothing here
imports gcpatch. Each step's forward is measured by the script itself: every storage an operator
allocated inside the forward and still alive after it (a dispatch mode of its own), which is what
the backward holds. Each step's trainable gradients are compared with the run without
checkpointing.

  --setup frozen   four steps of 2 x 64 tokens
  --setup growing  batches that grow: 2 x 64, 2 x 128, then one row of 512 and one row of 1024
                   tokens

usage: budget_baseline.py --setup frozen|growing
prints one line: RESULT {json}
"""

import argparse
import os
import warnings

import _common as c
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LAYERS, HIDDEN = 8, 64
SHAPES = {
    "frozen": [(2, 64)] * 4,
    "growing": [(2, 64), (2, 128), (1, 512), (1, 1024)],
}


def llama():
    return c.llama_of(c.llama_config(LAYERS, HIDDEN, max_position_embeddings=2048))


def freeze_bottom_half(model) -> None:
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(False)
    for layer in model.model.layers[: LAYERS // 2]:
        for p in layer.parameters():
            p.requires_grad_(False)


def batches(setup: str) -> list:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, c.VOCAB, shape, generator=gen) for shape in SHAPES[setup]]


def train(setup: str, checkpointing: bool) -> list[dict]:
    model = llama()
    freeze_bottom_half(model)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.train()
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.05)
    steps = []
    for ids in batches(setup):
        opt.zero_grad(set_to_none=True)
        loss, nbytes = c.held_forward(model, ids)
        loss.backward()
        steps.append(
            {
                "shape": list(ids.shape),
                "held": nbytes,
                "grads": c.trainable_grads(model),
                "checkpointed": c.checkpointed_layers(model),
            }
        )
        opt.step()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=sorted(SHAPES), default="frozen")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    ref = train(args.setup, checkpointing=False)
    run = train(args.setup, checkpointing=True)
    steps = []
    for step, ref_step in zip(run, ref):
        compared = c.compare_grads(step["grads"], ref_step["grads"], atol=1e-5)
        steps.append(
            {
                "shape": step["shape"],
                "held": step["held"],
                "plain_held": ref_step["held"],
                "fraction": step["held"] / ref_step["held"],
                "checkpointed": step["checkpointed"],
                "wrong": compared["wrong"],
                "grad_none": compared["grad_none"],
                "trainable": compared["trainable"],
            }
        )
    c.emit(
        {
            "scenario": "budget_baseline",
            "setup": args.setup,
            "layers": LAYERS,
            "budget": os.environ.get("GCPATCH_MEMORY_BUDGET"),
            "steps": steps,
        }
    )


if __name__ == "__main__":
    main()
