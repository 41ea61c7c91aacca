"""Scenario c: a 4-layer GPT2 with dropout, built and left in eval mode (as from_pretrained
leaves it), then gradient_checkpointing_enable() and a forward+backward with grad enabled.

Measures the bytes autograd saves in the forward (saved_tensors_hooks) for three fresh models
of the same seed: eval mode without checkpointing, eval mode with checkpointing, train mode
with checkpointing. Checkpointing that works in eval mode saves about what it saves in train
mode; checkpointing that silently does nothing saves what no checkpointing saves.

usage: eval_mode_gpt2.py
"""
import warnings

import torch
from torch import nn

import _common as c


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


def main() -> None:
    warnings.filterwarnings("ignore")
    ids = c.input_ids(batch=2)

    ref = c.gpt2().eval()
    ref_loss, ref_saved = forward_backward(ref, ids)
    ref_grads = c.trainable_grads(ref)

    model = c.gpt2().eval()
    before = dropout_flags(model)
    modes_before = {name: m.training for name, m in model.named_modules()}
    model.gradient_checkpointing_enable()
    loss, saved = forward_backward(model, ids)
    after = dropout_flags(model)
    changed = sorted(name for name, m in model.named_modules() if m.training != modes_before[name])
    grads = c.compare_grads(c.trainable_grads(model), ref_grads)

    train = c.gpt2().train()
    train.gradient_checkpointing_enable()
    _, train_saved = forward_backward(train, ids)

    c.emit({
        "scenario": "eval_mode_gpt2",
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
    })


if __name__ == "__main__":
    main()
