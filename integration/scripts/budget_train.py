"""An 8-layer tiny Llama (hidden 32, batch 2, sequence 64, attention dropout on) trained two steps,
once without checkpointing and then once per memory budget with `gradient_checkpointing_enable()`,
each budget set in the environment (GCPATCH_MEMORY_BUDGET) before its model is built. Ordinary
user code: nothing here imports gcpatch. It measures by itself what each step's forward holds for
the backward (every storage an operator allocated that is still alive after the forward, with a
dispatch mode of its own), how many layers its backward recomputes, and compares every gradient
with the run without checkpointing. The figures are the second step's (the first step runs with
checkpointing as enabled while the budget's plan is made, which applies from the second on); the
first step's held bytes are reported beside them.

usage: budget_train.py --setup loop|trainer|lora --budgets 0.6,0.25,0.01[,unset]
  loop:    a plain training loop
  trainer: transformers' Trainer, gradient_checkpointing=True (a probe optimizer, lr 0)
  lora:    PEFT LoRA (get_peft_model after gradient_checkpointing_enable)
  unset:   the budget variable removed (checkpointing as without it)
prints one line: RESULT {json}
"""

import argparse
import os
import tempfile
import warnings

import _common as c
import torch
from _common import HeldBytes, digest  # the other budget scripts import them from here too

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BATCH, SEQ, LAYERS = 2, 64, 8


# the tiny model's config (budget_lengths.py builds its families from it)
CONFIG = c.llama_config(LAYERS, 32, 64, dropout=0.1)


def llama():
    return c.llama_of(CONFIG)


class Recomputes(c.Recomputes):
    """Counts the model's decoder layers whose MLP runs during the backward: a recomputed layer."""

    def __init__(self, model):
        super().__init__(decoder_layers(model))


def decoder_layers(model):
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def ids():
    gen = torch.Generator().manual_seed(5)
    return torch.randint(0, c.VOCAB, (BATCH, SEQ), generator=gen)


def loop_step(budget):
    model = llama()
    if budget is not None:
        model.gradient_checkpointing_enable()
    if ARGS.setup == "lora":
        model = c.lora(model)
        c.trained_lora_b(model)
    model.train()
    counter = Recomputes(model)
    batch = ids()
    held_per_step = []
    for step in (1, 2):
        model.zero_grad(set_to_none=True)
        counter.backward, counter.count = False, 0
        torch.manual_seed(10 + step)
        loss, nbytes = c.held_forward(model, batch)
        held_per_step.append(nbytes)
        counter.backward = True
        loss.backward()
    grads = c.trainable_grads(model)
    return model, held_per_step, counter.count, grads, torch.rand(2).tolist()


def trainer_step(budget):
    from transformers import Trainer

    model = llama()
    held = []

    class MeasuringTrainer(Trainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            counter.backward, counter.count = False, 0
            with HeldBytes() as mode:
                loss = super().compute_loss(model, inputs, *args, **kwargs)
            held.append(mode.alive())
            counter.backward = True
            return loss

    counter = Recomputes(model)
    probe = StepProbe(model, counter, at=2)
    out = tempfile.mkdtemp(prefix="budget-trainer-", dir=".")  # in the run's own folder
    args = c.measured_trainer_args(out, BATCH, 2, budget is not None)
    MeasuringTrainer(
        model=model, args=args, train_dataset=c.Batch(ids()), optimizers=(probe, None)
    ).train()
    return model, held, probe.recomputed, probe.grads, torch.rand(2).tolist()


class StepProbe(torch.optim.SGD):
    """An lr=0 SGD handed to the Trainer: at its `at`-th step it records the trainable gradients
    and, given a `counter`, how many layers that step's backward recomputed."""

    def __init__(self, model, counter, at: int) -> None:
        super().__init__([p for p in model.parameters() if p.requires_grad], lr=0.0)
        self.model, self.counter, self.at, self.steps = model, counter, at, 0
        self.grads, self.recomputed = None, None

    def step(self, closure=None):
        self.steps += 1
        if self.steps == self.at:
            self.grads = c.trainable_grads(self.model)
            self.recomputed = None if self.counter is None else self.counter.count
        return super().step(closure)


def main() -> None:
    global ARGS
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=("loop", "trainer", "lora"), default="loop")
    parser.add_argument("--budgets", default="0.6,0.25,0.01")
    ARGS = parser.parse_args()
    warnings.filterwarnings("ignore")
    step = trainer_step if ARGS.setup == "trainer" else loop_step
    os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    _, ref_held, ref_recomputed, ref_grads, ref_rng = step(None)
    ref_bytes = ref_held[1]
    cases = {}
    for budget in ARGS.budgets.split(","):
        if budget == "unset":
            os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
        else:
            os.environ["GCPATCH_MEMORY_BUDGET"] = budget
        model, held_per_step, recomputed, grads, rng_after = step(budget)
        nbytes = held_per_step[1]
        compared = c.compare_grads(grads, ref_grads, atol=0.0)
        cases[budget] = {
            "held_bytes": nbytes,
            "first_step_held_bytes": held_per_step[0],
            "fraction": nbytes / ref_bytes,
            "recomputed": recomputed,
            "flags": [
                bool(getattr(m, "gradient_checkpointing", False)) for m in decoder_layers(model)
            ],
            "wrong": compared["wrong"],
            "grad_none": compared["grad_none"],
            "max_abs_diff": c.max_abs_diff(grads, ref_grads),
            "trainable": compared["trainable"],
            "grads": digest(grads.values()),
            "rng_after": rng_after,
        }
    os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    c.emit(
        {
            "scenario": "budget_train",
            "setup": ARGS.setup,
            "reference_bytes": ref_bytes,
            "reference_recomputed": ref_recomputed,
            "reference_rng_after": ref_rng,
            "cases": cases,
        }
    )


if __name__ == "__main__":
    main()
