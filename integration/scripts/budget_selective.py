"""A small Llama (4 layers, hidden 64, vocab 64, sdpa attention, batch 2 x 256 tokens; --layers,
--hidden and --tokens change them) trained three steps under GCPATCH_MEMORY_BUDGET (0.5, or
--budget), against the same model without checkpointing and with full checkpointing. Ordinary user
code: nothing here imports gcpatch. The first step runs fully checkpointed while gcpatch probes it;
the plan holds from the second step on, and the third step's figures are the ones reported.

Per run the script measures by itself: what the forward of the last step holds for the backward
(budget_train's dispatch mode), the FLOPs the step runs beyond the forward's (torch.utils.
flop_counter: a backward with checkpointing recomputes, so its FLOPs minus those of the backward
without checkpointing are the recompute), every gradient against the run without checkpointing,
how each layer runs (plain, whole, checkpointed with a selective `context_fn`: keeping the matmuls
or the attention kernel's output alone, or its feed-forward block alone checkpointed), what share
of full checkpointing's recompute is the fused attention kernel's forward (the part a layer
keeping its attention output does not recompute), and what a layer run plain with its MLP alone
checkpointed recomputes against a whole layer (every layer's MLP checkpointed by hand, as a user
could write it).

usage: budget_selective.py [--setup loop|lora|trainer] [--dropout 0.1]
  loop:    a training loop, `gradient_checkpointing_enable()`
  lora:    the same loop on PEFT LoRA (get_peft_model after the enable)
  trainer: transformers' Trainer (gradient_checkpointing=True) on PEFT LoRA, a probe optimizer
           (lr 0) reading the third step's gradients
  --dropout: the attention's dropout, and LoRA's on the adapters' inputs
  --non-reentrant: the loop's enable asks use_reentrant=False (transformers 4.x defaults to
           reentrant, with which torch's selective checkpointing cannot run)
  --budget: GCPATCH_MEMORY_BUDGET (default 0.5)
  --dtype: the model's dtype (float32 by default; in bfloat16 a layer's norm saves an fp32 copy
           of its input, so only a checkpoint holds the input itself)
  --tokens: each step's token count (default 256,256,256; the Trainer's steps take the first);
           lengths that differ (the loop alone) report each step against the same step without
           checkpointing, and nothing else
  --layers, --hidden: the model's layers and hidden size (intermediate 11/4 of it)
prints one line: RESULT {json}
"""

import argparse
import functools
import os
import resource
import warnings

import _common as c
import torch
from budget_train import HeldBytes, StepProbe
from torch.utils import flop_counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BATCH, TOKENS, LAYERS, HIDDEN, VOCAB = 2, 256, 4, 64, 64


def build(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=args.dropout,
        tie_word_embeddings=False,
        use_cache=False,
        max_position_embeddings=max(args.tokens),
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).to(getattr(torch, args.dtype))


def ids(args):
    return torch.randint(
        0, VOCAB, (BATCH, max(args.tokens)), generator=torch.Generator().manual_seed(3)
    )


def lora(model, args):
    model = c.lora(model, dropout=args.dropout)
    c.trained_lora_b(model)
    return model


def mlps_by_hand(model) -> None:
    """Every layer plain, its MLP alone checkpointed (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    for layer in decoder_layers(model):
        forward = layer.mlp.forward
        layer.mlp.forward = functools.partial(checkpoint, forward, use_reentrant=False)


def run(args, checkpointing) -> dict:
    """`checkpointing`: True (the enable), False, or "mlps" (`mlps_by_hand`)."""
    if args.setup == "trainer":
        return trainer(args, checkpointing)
    model = build(args)
    if checkpointing == "mlps":
        mlps_by_hand(model)
    elif checkpointing:
        kwargs = {"use_reentrant": False} if args.non_reentrant else None
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    if args.setup == "lora":
        model = lora(model, args)
    model.train()
    batch = ids(args)
    out = {"steps": []}
    # the plan is made after the first forward; the later steps run it (each new length its own)
    for step, length in enumerate(args.tokens):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(100 + step)
        cut = batch[:, :length]
        with HeldBytes() as held:
            loss = model(input_ids=cut, labels=cut).loss
        out["held"] = held.alive()
        counter = counting()
        with counter:
            loss.backward()
        out["flops"] = counter.get_total_flops()
        out["attention_flops"] = attention_flops(counter)
        out["grads"] = c.trainable_grads(model)
        out["steps"].append(
            {"tokens": length, "held": out["held"], "modes": modes(model), "grads": out["grads"]}
        )
    out["modes"] = modes(model)
    return out


def trainer(args, checkpointing) -> dict:
    """Three Trainer steps; the third's figures. The step's FLOPs stand for the backward's: its
    forward runs the same matmuls with or without checkpointing, so differences are recompute."""
    import tempfile

    from transformers import Trainer

    model = lora(build(args), args)
    if checkpointing == "mlps":
        mlps_by_hand(model)
        checkpointing = False
    out = {}

    class Measuring(Trainer):
        def compute_loss(self, model, inputs, *rest, **kwargs):
            with HeldBytes() as held:
                loss = super().compute_loss(model, inputs, *rest, **kwargs)
            out["held"] = held.alive()
            return loss

        def training_step(self, *rest, **kwargs):
            counter = counting()
            with counter:
                loss = super().training_step(*rest, **kwargs)
            out["flops"] = counter.get_total_flops()
            out["attention_flops"] = attention_flops(counter)
            return loss

    probe = StepProbe(model, None, at=3)
    out_dir = tempfile.mkdtemp(prefix="budget-selective-", dir=".")
    arguments = c.measured_trainer_args(out_dir, BATCH, 3, checkpointing)
    Measuring(
        model=model,
        args=arguments,
        train_dataset=c.Batch(ids(args)[:, : args.tokens[0]]),
        optimizers=(probe, None),
    ).train()
    out["grads"], out["modes"] = probe.grads, modes(model)
    return out


def counting():
    """torch's FLOP counter, also counting CPU's fused attention kernel (torch.utils.flop_counter
    has formulas for the CUDA kernels only), with the same formulas."""
    aten = torch.ops.aten

    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return flop_counter.sdpa_backward_flop_count(grad_out, query, key, value)

    mapping = {
        getattr(aten, name): formula
        for name, formula in (
            ("_scaled_dot_product_flash_attention_for_cpu", forward),
            ("_scaled_dot_product_flash_attention_for_cpu_backward", backward),
        )
        if hasattr(aten, name)
    }
    return flop_counter.FlopCounterMode(display=False, custom_mapping=mapping)


def attention_flops(counter) -> int:
    """The FLOPs of fused attention kernels' forwards the counter saw: in a backward, recompute."""
    counts = counter.get_flop_counts().get("Global", {})
    return sum(
        n
        for op, n in counts.items()
        if str(op).startswith("aten._scaled_dot_product") and not str(op).endswith("_backward")
    )


def decoder_layers(model) -> list:
    return [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]


def modes(model) -> list[str]:
    return [_mode(m) for m in decoder_layers(model)]


def _mode(layer) -> str:
    """How the layer runs, read off its flag and checkpoint function: plain, whole, its feed-forward
    block alone checkpointed, or a selective policy keeping the matmuls (the matmul operators among
    those it keeps) or the attention kernel's output alone."""
    if not getattr(layer, "gradient_checkpointing", False):
        return "plain"
    func = getattr(layer, "_gradient_checkpointing_func", None)
    if type(func).__name__ == "FeedForward":  # the layer plain, its MLP alone checkpointed
        return "feed-forward"
    context_fn = getattr(func, "keywords", {}).get("context_fn")
    if context_fn is None:
        return "whole"
    kept = getattr(getattr(context_fn, "__self__", None), "ops", None)
    if kept is None:
        return "selective"
    return "keep-matmuls" if torch.ops.aten.mm.default in kept else "keep-attention"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--setup", choices=("loop", "lora", "trainer"), default="loop")
    parser.add_argument("--dropout", type=float, default=0.0)
    parser.add_argument("--non-reentrant", action="store_true")
    parser.add_argument("--budget", default="0.5")
    parser.add_argument("--tokens", default=f"{TOKENS},{TOKENS},{TOKENS}")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--layers", type=int, default=LAYERS)
    args = parser.parse_args()
    args.tokens = [int(t) for t in args.tokens.split(",")]
    warnings.filterwarnings("ignore")
    os.environ.pop("GCPATCH_MEMORY_BUDGET", None)
    if len(set(args.tokens)) > 1:
        return steps(args)
    plain = run(args, checkpointing=False)
    full = run(args, checkpointing=True)
    mlps = run(args, checkpointing="mlps")
    os.environ["GCPATCH_MEMORY_BUDGET"] = args.budget
    budget = run(args, checkpointing=True)
    os.environ.pop("GCPATCH_MEMORY_BUDGET")
    compared = c.compare_grads(budget["grads"], plain["grads"], atol=0.0)
    dtype = getattr(torch, args.dtype)
    full_recompute = full["flops"] - plain["flops"]
    c.emit(
        {
            "scenario": "budget_selective",
            "setup": args.setup,
            "held_fraction": budget["held"] / plain["held"],
            "full_held_fraction": full["held"] / plain["held"],
            "recompute_flops_share": (budget["flops"] - plain["flops"]) / full_recompute,
            "attention_flops_share": full["attention_flops"] / full_recompute,
            "feed_forward_flops_share": (mlps["flops"] - plain["flops"]) / full_recompute,
            # the process's peak resident memory over the runs, MiB (Linux: KiB)
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "modes": budget["modes"],
            "layers": args.layers,
            # one layer's input: batch x tokens x hidden
            "hidden_state_bytes": BATCH * args.tokens[-1] * args.hidden * dtype.itemsize,
            "wrong": compared["wrong"],
            "grad_none": compared["grad_none"],
            "trainable": compared["trainable"],
        }
    )


def steps(args) -> None:
    """Batches of each length in turn (the loop alone): per step, what the forward held against
    the same step without checkpointing, how each layer ran, and whether every gradient is exact."""
    plain = run(args, checkpointing=False)
    os.environ["GCPATCH_MEMORY_BUDGET"] = args.budget
    budget = run(args, checkpointing=True)
    os.environ.pop("GCPATCH_MEMORY_BUDGET")
    c.emit(
        {
            "scenario": "budget_selective_steps",
            "steps": [
                {
                    "tokens": b["tokens"],
                    "held": b["held"],
                    "plain_held": p["held"],
                    "modes": b["modes"],
                    "wrong": c.compare_grads(b["grads"], p["grads"], atol=0.0)["wrong"],
                }
                for b, p in zip(budget["steps"], plain["steps"])
            ],
        }
    )


if __name__ == "__main__":
    main()
