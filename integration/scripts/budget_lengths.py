"""A training loop whose batches change length from step to step (32, 64, 128, 256 tokens, then
shorter again), as dynamic padding, length grouping or RL rollouts make them: an 8-layer tiny Llama
(hidden 32, batch 2, attention dropout on), run once without checkpointing and then with
`gradient_checkpointing_enable()` under a memory budget set in the environment before the model is
built. Ordinary user code: nothing here imports gcpatch.

Each step's forward is measured by the script itself (a dispatch mode of its own that notes every
storage an operator allocates and which are still alive after the forward), its gradients compared
with the run without checkpointing (same weights, same batch, same RNG seed; no optimizer step, so
every step sees the same weights), and its layers' checkpointing flags read.

usage: budget_lengths.py --budget size|fraction|auto [--attn eager|sdpa] [--family llama|qwen2]
                         [--hidden N] [--between eval,generate,disable]
  size:      an absolute budget, half of what the 128-token step holds without checkpointing
  fraction:  GCPATCH_MEMORY_BUDGET=0.5
  auto:      auto with a stated capacity (auto:<bytes>B): the model's weights plus the same room
             as `size`, plus the margin
  --mode eval: the model trained while left in eval mode (both runs; dropout off)
  --hidden:  the hidden size (intermediate three times it) instead of 32, the first step's token
             count (at 16 no size of a layer's weights is a token count of the first step)
  --between: an eval forward and/or a generate call of other lengths after the third step;
             disable: checkpointing disabled for a training step of another length, then enabled
prints one line: RESULT {json}
"""

import argparse
import os
import warnings

import _common as c
import torch
from budget_train import CONFIG, HeldBytes

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BATCH = 2
LENGTHS = (32, 64, 128, 256, 128, 64, 32)
AUTO_MARGIN = 0.1  # gcpatch's documented margin under auto (docs/BUDGET.md)


def build(args):
    torch.manual_seed(0)
    common = {**CONFIG, "max_position_embeddings": 512}
    if getattr(args, "hidden", 0):
        common.update(hidden_size=args.hidden, intermediate_size=3 * args.hidden)
    if args.family == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config, cls = Qwen2Config(**common), Qwen2ForCausalLM
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        config, cls = LlamaConfig(**common), LlamaForCausalLM
    config._attn_implementation = args.attn
    return cls(config)


def layers_of(model):
    return [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]


def batch(tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(tokens)
    return torch.randint(0, c.VOCAB, (BATCH, tokens), generator=gen)


def train(args, checkpointing: bool) -> list[dict]:
    model = build(args)
    if checkpointing:
        model.gradient_checkpointing_enable()
    model.train(args.mode == "train")  # eval: a model left in eval mode (dropout off), R5's case
    steps = []
    for index, tokens in enumerate(LENGTHS):
        ids = batch(tokens)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + index)
        with HeldBytes() as held:
            loss = model(input_ids=ids, labels=ids).loss
        held_bytes = held.alive()
        loss.backward()
        steps.append(
            {
                "tokens": tokens,
                "held": held_bytes,
                "flags": [
                    bool(getattr(m, "gradient_checkpointing", False)) for m in layers_of(model)
                ],
                "grads": c.trainable_grads(model),
            }
        )
        if index == 2 and args.between:
            what = args.between.split(",")
            if "disable" in what and checkpointing:
                steps[-1]["disabled_flags"] = disabled_step(model)
            steps[-1]["between_flags"] = between(model, what)
    return steps, model


def disabled_step(model) -> list:
    """Checkpointing disabled, a training step of a length no other step has (96 tokens), enabled
    again: the flags during that step (all off: the budget leaves a disabled model alone); the
    steps after it run the plans again."""
    model.gradient_checkpointing_disable()
    ids = batch(96)
    model(input_ids=ids, labels=ids).loss.backward()
    flags = [bool(getattr(m, "gradient_checkpointing", False)) for m in layers_of(model)]
    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable()
    return flags


ARGS = argparse.Namespace(mode="train")


def between(model, what: list[str]) -> list:
    """An eval forward and a generate call, of lengths no training step has: the flags after."""
    model.eval()
    with torch.no_grad():
        if "eval" in what:
            ids = batch(96)
            model(input_ids=ids, labels=ids)
        if "generate" in what:
            model.generate(batch(48), max_new_tokens=3, do_sample=False, use_cache=True)
    model.train(ARGS.mode == "train")
    return [bool(getattr(m, "gradient_checkpointing", False)) for m in layers_of(model)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--budget", choices=("size", "fraction", "auto"), default="size")
    parser.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    parser.add_argument("--family", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--mode", choices=("train", "eval"), default="train")
    parser.add_argument("--between", default="")
    parser.add_argument("--hidden", type=int, default=0)
    global ARGS
    ARGS = args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    reference, _ = train(args, checkpointing=False)
    room = reference[LENGTHS.index(128)]["held"] // 2
    if args.budget == "fraction":
        os.environ["GCPATCH_MEMORY_BUDGET"] = "0.5"
    elif args.budget == "size":
        os.environ["GCPATCH_MEMORY_BUDGET"] = f"{room}B"
    else:
        probe = build(args)
        weights = sum(p.numel() * p.element_size() for p in probe.parameters())
        # what the job holds at a step's forward (the weights: gradients are set to None before
        # each), the room for activations, and the margin on top
        capacity = int((weights + room) / (1 - AUTO_MARGIN))
        os.environ["GCPATCH_MEMORY_BUDGET"] = f"auto:{capacity}B"
    steps, _ = train(args, checkpointing=True)
    budget = os.environ.pop("GCPATCH_MEMORY_BUDGET")
    out = []
    for step, ref in zip(steps, reference):
        compared = c.compare_grads(step["grads"], ref["grads"], atol=0.0)
        out.append(
            {
                "tokens": step["tokens"],
                "held": step["held"],
                "plain_held": ref["held"],
                "flags": step["flags"],
                "wrong": compared["wrong"],
                "grad_none": compared["grad_none"],
                **{k: step[k] for k in ("between_flags", "disabled_flags") if k in step},
            }
        )
    c.emit({"scenario": "budget_lengths", "budget": budget, "room": room, "steps": out})


if __name__ == "__main__":
    main()
