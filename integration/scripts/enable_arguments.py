"""Every argument of the user's enable call survives gcpatch (transformers 5.17+: `every_n_layers`
and `offload`). A 4-layer Llama, embeddings and layer 0 frozen (gcpatch decides, keeps the reentrant
ask with its input-grads hook, and calls the framework's enable with the decided kwargs), asked to
checkpoint every 2nd layer with offloading, by a direct call or through the Trainer. Reports which layers checkpoint and with which function.

usage: enable_arguments.py --path call|trainer
"""

import argparse
import functools
import tempfile
import warnings

import _common as c
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

LAYERS = 4
ASK = {"use_reentrant": True}


def checkpointed(model) -> dict:
    layers = model.model.layers
    on = [i for i, layer in enumerate(layers) if layer.gradient_checkpointing]
    funcs = set()
    for i in on:
        func = layers[i]._gradient_checkpointing_func
        while not isinstance(func, functools.partial) and hasattr(func, "func"):
            func = func.func  # gcpatch's R5 wrapper, if any
        inner = func.func if isinstance(func, functools.partial) else func
        funcs.add(getattr(inner, "__name__", type(inner).__name__))
    return {
        "checkpointed_layers": on,
        "checkpoint_functions": sorted(funcs),
        "use_reentrant": c.checkpoint_use_reentrant(model),
    }


def host_memory_unpinned() -> None:
    """transformers' offloading checkpointer (5.17+) calls save_on_cpu(pin_memory=True), which a
    CPU-only torch cannot allocate. Both runs (plain and gcpatch) get it unpinned, so the training
    step runs here; what is compared is which arguments reach the layers."""
    import transformers.modeling_utils as mu

    original = getattr(mu, "save_on_cpu", None)
    if original is not None:
        mu.save_on_cpu = lambda pin_memory=False, device_type=None: original(
            pin_memory=False, device_type=device_type
        )


def main() -> None:
    host_memory_unpinned()
    parser = argparse.ArgumentParser()
    parser.add_argument("--path", choices=("call", "trainer"), required=True)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=LAYERS,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    c.freeze_embeddings_and_first_layer(model)
    if args.path == "call":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=dict(ASK), every_n_layers=2, offload=True
        )
        seen = checkpointed(model)
    else:
        with tempfile.TemporaryDirectory() as out:
            targs = TrainingArguments(
                output_dir=out,
                gradient_checkpointing=True,
                max_steps=1,
                per_device_train_batch_size=2,
                gradient_checkpointing_kwargs={**ASK, "every_n_layers": 2, "offload": True},
                report_to=[],
                use_cpu=True,
                learning_rate=0.0,
                save_strategy="no",
                logging_strategy="no",
                disable_tqdm=True,
                dataloader_num_workers=0,
                seed=0,
            )
            Trainer(model=model, args=targs, train_dataset=c.Batch(c.input_ids(batch=2))).train()
        seen = checkpointed(model)
    c.emit({"scenario": "enable_arguments", "path": args.path, **seen})


if __name__ == "__main__":
    main()
