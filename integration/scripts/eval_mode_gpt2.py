"""Scenario c: a 4-layer GPT2 with dropout, built and left in eval mode (as from_pretrained
leaves it), then gradient_checkpointing_enable() and a forward+backward with grad enabled.

Measures the bytes autograd saves in the forward (saved_tensors_hooks) for three fresh models
of the same seed: eval mode without checkpointing, eval mode with checkpointing, train mode
with checkpointing. Checkpointing that works in eval mode saves about what it saves in train
mode; checkpointing that silently does nothing saves what no checkpointing saves.

With `--model llama`, a 4-layer Llama with attention dropout: on transformers < 4.52 its loop
owner (LlamaModel) holds the checkpoint flag and its forward reads `self.training` elsewhere too.

usage: eval_mode_gpt2.py [--model gpt2|llama]
"""

import argparse
import warnings

import _common as c
import torch
from torch import nn


def forward_backward(model, ids):
    saved = {"bytes": 0, "tensors": 0}

    def pack(tensor):
        saved["bytes"] += tensor.numel() * tensor.element_size()
        saved["tensors"] += 1
        return tensor

    model.zero_grad(set_to_none=True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), saved


def dropout_flags(model):
    return [m.training for m in model.modules() if isinstance(m, nn.Dropout)]


def llama4(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=0.1,
            tie_word_embeddings=False,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    args = parser.parse_args()
    build = c.gpt2 if args.model == "gpt2" else llama4
    warnings.filterwarnings("ignore")
    ids = c.input_ids(batch=2)

    ref = build().eval()
    ref_loss, ref_saved = forward_backward(ref, ids)
    ref_grads = c.trainable_grads(ref)

    model = build().eval()
    before = dropout_flags(model)
    modes_before = {name: m.training for name, m in model.named_modules()}
    model.gradient_checkpointing_enable()
    loss, saved = forward_backward(model, ids)
    after = dropout_flags(model)
    changed = sorted(name for name, m in model.named_modules() if m.training != modes_before[name])
    grads = c.compare_grads(c.trainable_grads(model), ref_grads)

    train = build().train()
    train.gradient_checkpointing_enable()
    _, train_saved = forward_backward(train, ids)

    c.emit(
        {
            "scenario": f"eval_mode_{args.model}",
            "saved_bytes_eval_nogc": ref_saved["bytes"],
            "saved_bytes_eval_gc": saved["bytes"],
            "saved_bytes_train_gc": train_saved["bytes"],
            "ratio_eval_gc_to_train_gc": saved["bytes"] / train_saved["bytes"],
            "ratio_eval_gc_to_eval_nogc": saved["bytes"] / ref_saved["bytes"],
            "dropout_modules": len(before),
            "dropout_flags_unchanged": before == after,
            "dropout_all_off": not any(after),
            "modules_training_flag_changed": changed,
            "loss_equal_eval_nogc": bool(torch.allclose(loss, ref_loss, atol=1e-6, rtol=0)),
            "loss_abs_diff": float((loss - ref_loss).abs()),
            "grads_wrong": grads["wrong"],
            "trainable": grads["trainable"],
            "applied_use_reentrant": c.checkpoint_use_reentrant(model),
            "model_training": model.training,
        }
    )


if __name__ == "__main__":
    main()
