"""transformers' Trainer grouping by length (`group_by_length=True`; 5.x:
`train_sampling_strategy="group_by_length"`) with a collator that pads each batch to its own
longest row, on PEFT LoRA over the 8-layer tiny Llama of budget_lengths.py: the batches' lengths
vary from step to step as in a real fine-tuning job. Run once without checkpointing and once with
`gradient_checkpointing=True` under the memory budget given by --budget (set in the environment
before the model is built; `half128`: half of what a 2 x 128-token step holds without
checkpointing). Ordinary user code: nothing here imports gcpatch.

Each step's loss forward is measured by the script itself (budget_train's dispatch mode) and its
LoRA gradients are compared with the run without checkpointing (an lr=0 optimizer, so every step
sees the same weights).

usage: budget_trainer_lengths.py --budget half128|0.5
prints one line: RESULT {json}
"""

import argparse
import os
import tempfile
import warnings

import _common as c
import torch
from budget_lengths import build
from budget_train import HeldBytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LENGTHS = [32, 256, 64, 128, 48, 200, 96, 160] * 2  # one row each; batches of 2 rows


class Rows(torch.utils.data.Dataset):
    def __init__(self) -> None:
        gen = torch.Generator().manual_seed(3)
        self.rows = [torch.randint(1, c.VOCAB, (n,), generator=gen) for n in LENGTHS]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.rows[i]}


def pad(rows: list[dict]) -> dict:
    """Pads to the batch's own longest row (as DataCollatorWithPadding does); labels -100 there."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r["input_ids"])] = r["input_ids"]
        mask[i, : len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class Args:
    family, attn = "llama", "eager"


def train(checkpointing: bool) -> list[dict]:
    from transformers import Trainer, TrainingArguments

    model = c.lora(build(Args))
    steps: list[dict] = []

    class Measuring(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            with HeldBytes() as mode:
                loss = super().compute_loss(model, inputs, *args, **kwargs)
            steps.append({"tokens": int(inputs["input_ids"].shape[1]), "held": mode.alive()})
            return loss

    class Probe(torch.optim.SGD):
        def step(self, closure=None):
            steps[-1]["grads"] = c.trainable_grads(model)
            return super().step(closure)

    probe = Probe([p for p in model.parameters() if p.requires_grad], lr=0.0)
    import inspect

    # group_by_length=True up to 4.x; train_sampling_strategy="group_by_length" in 5.x
    if "group_by_length" in inspect.signature(TrainingArguments).parameters:
        grouping = {"group_by_length": True}
    else:
        grouping = {"train_sampling_strategy": "group_by_length"}
    out = tempfile.mkdtemp(prefix="budget-lengths-", dir=".")  # in the run's own folder
    args = c.measured_trainer_args(
        out, 2, len(LENGTHS) // 2, checkpointing, remove_unused_columns=False, **grouping
    )
    Measuring(
        model=model, args=args, train_dataset=Rows(), data_collator=pad, optimizers=(probe, None)
    ).train()
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", default="half128")
    budget = parser.parse_args().budget
    warnings.filterwarnings("ignore")
    os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    reference = train(False)
    by_tokens = {s["tokens"]: s["held"] for s in reference}
    if budget == "half128":
        near = min(by_tokens, key=lambda t: abs(t - 128))
        budget = f"{by_tokens[near] // 2}B"
    os.environ["GCPATCH_MEMORY_BUDGET"] = budget
    steps = train(True)
    os.environ.pop("GCPATCH_MEMORY_BUDGET")
    out = []
    for step, ref in zip(steps, reference):
        compared = c.compare_grads(step["grads"], ref["grads"], atol=0.0)
        out.append(
            {
                "tokens": step["tokens"],
                "ref_tokens": ref["tokens"],
                "held": step["held"],
                "plain_held": ref["held"],
                "wrong": compared["wrong"],
                "grad_none": compared["grad_none"],
            }
        )
    c.emit({"scenario": "budget_trainer_lengths", "budget": budget, "steps": out})


if __name__ == "__main__":
    main()
