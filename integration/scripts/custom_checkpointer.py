"""A tool's own checkpoint function in place of torch's (as offloading checkpointers do: they replace
`transformers.modeling_utils.checkpoint` and run reentrant whatever they are asked), a Llama with
frozen embeddings, `gradient_checkpointing_enable(use_reentrant=True)`, one step. Reports the
use_reentrant the custom function was asked for, what it ran, and the gradients against no
checkpointing. Nothing here imports gcpatch.

usage: custom_checkpointer.py     prints one line: RESULT {json}
"""

import warnings

import _common as c
import torch
import torch.utils.checkpoint
import transformers.modeling_utils

asked = []


def offload_checkpoint(function, *args, use_reentrant=None, **kwargs):
    """Reentrant only, like many offloading checkpointers."""
    asked.append(use_reentrant)
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True, **kwargs)


def main():
    warnings.filterwarnings("ignore")
    ids = c.input_ids()
    ref = c.llama().train()
    c.freeze_embeddings_and_first_layer(ref)
    ref(input_ids=ids, labels=ids).loss.backward()

    transformers.modeling_utils.checkpoint = offload_checkpoint
    model = c.llama().train()
    c.freeze_embeddings_and_first_layer(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model(input_ids=ids, labels=ids).loss.backward()
    grads = c.compare_grads(c.trainable_grads(model), c.trainable_grads(ref))
    c.emit(
        {
            "scenario": "custom_checkpointer",
            "asked_custom": sorted({str(a) for a in asked}),
            "wrong": grads["wrong"],
            "trainable": grads["trainable"],
        }
    )


if __name__ == "__main__":
    main()
