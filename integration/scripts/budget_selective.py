"""An 8-layer Llama (hidden 256, sdpa attention, batch 2 x 1024 tokens) trained three steps under
GCPATCH_MEMORY_BUDGET=0.5 with `gradient_checkpointing_enable()`, against the same model without
checkpointing and with full checkpointing. Ordinary user code: nothing here imports gcpatch.

Per run the script measures by itself: what the forward of the last step holds for the backward
(budget_train's dispatch mode), the FLOPs its backward runs (torch.utils.flop_counter: a backward
with checkpointing recomputes, so its FLOPs minus those of the backward without checkpointing are
the recompute), every gradient against the run without checkpointing, and how each layer runs
(plain, checkpointed, checkpointed with a selective `context_fn`).

usage: budget_selective.py [--setup loop|lora] [--dropout 0.1]
prints one line: RESULT {json}
"""

import argparse
import os
import warnings

import _common as c
import torch
from budget_train import HeldBytes
from torch.utils.flop_counter import FlopCounterMode

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BATCH, TOKENS, LAYERS = 2, 1024, 8


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=args.dropout,
        tie_word_embeddings=False,
        use_cache=False,
        max_position_embeddings=TOKENS,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def run(args, checkpointing: bool) -> dict:
    model = build(args)
    if checkpointing:
        model.gradient_checkpointing_enable()
    if args.setup == "lora":
        model = c.lora(model)
        for module in model.modules():  # LoRA's own dropout on the adapters' inputs
            if type(module).__name__ == "Dropout" and "lora_dropout" in str(module.__class__):
                module.p = args.dropout
        c.trained_lora_b(model)
    model.train()
    ids = torch.randint(0, 256, (BATCH, TOKENS), generator=torch.Generator().manual_seed(3))
    out = {}
    for step in range(3):  # the plan is made after the first forward; steps 2 and 3 run it
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        with HeldBytes() as held:
            loss = model(input_ids=ids, labels=ids).loss
        out["held"] = held.alive()
        counter = FlopCounterMode(display=False)
        with counter:
            loss.backward()
        out["backward_flops"] = counter.get_total_flops()
    out["grads"] = c.trainable_grads(model)
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    out["modes"] = [_mode(m) for m in layers]
    return out


def _mode(layer) -> str:
    if not getattr(layer, "gradient_checkpointing", False):
        return "plain"
    func = getattr(layer, "_gradient_checkpointing_func", None)
    return "selective" if "context_fn" in getattr(func, "keywords", {}) else "full"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=("loop", "lora"), default="loop")
    parser.add_argument("--dropout", type=float, default=0.0)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    plain = run(args, checkpointing=False)
    full = run(args, checkpointing=True)
    os.environ["GCPATCH_MEMORY_BUDGET"] = "0.5"
    budget = run(args, checkpointing=True)
    os.environ.pop("GCPATCH_MEMORY_BUDGET")
    compared = c.compare_grads(budget["grads"], plain["grads"], atol=0.0)
    full_recompute = full["backward_flops"] - plain["backward_flops"]
    c.emit(
        {
            "scenario": "budget_selective",
            "setup": args.setup,
            "held_fraction": budget["held"] / plain["held"],
            "full_held_fraction": full["held"] / plain["held"],
            "recompute_flops_share": (budget["backward_flops"] - plain["backward_flops"])
            / full_recompute,
            "modes": budget["modes"],
            "wrong": compared["wrong"],
            "grad_none": compared["grad_none"],
            "trainable": compared["trainable"],
        }
    )


if __name__ == "__main__":
    main()
