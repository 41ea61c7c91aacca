"""The user's "off" leaves no trace: checkpointing switched off after it was on (or never switched
on by a framework asked not to) leaves the model exactly as without gcpatch. Each scenario builds a
Llama, does what a user does, then runs one train-mode forward+backward and reports the bytes
autograd saved, the config, the checkpointing flags and the hooks left on any module. The test
compares the GCPATCH=1 run with the plain one, figure by figure. Nothing here imports gcpatch.

- enable_disable: gradient_checkpointing_enable() then gradient_checkpointing_disable();
- enable_disable_eval: the same on a model left in eval mode, with one training forward between
  (R5 took effect), then model.train();
- reentrant_disable: enable(use_reentrant=True) with frozen embeddings (R1, R2's hooks), disable;
- kbit_false: peft's prepare_model_for_kbit_training(model, use_gradient_checkpointing=False);
- trainer_false: Trainer(gradient_checkpointing=False), one step.

usage: disable_after_enable.py     prints one line: RESULT {json}
"""

import json
import os
import tempfile
import warnings

import _common as c
import torch


def forward_backward(model):
    ids = c.input_ids()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    model.zero_grad(set_to_none=True)
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=ids, labels=ids).loss
    if loss.requires_grad:  # peft's kbit preparation freezes every base weight
        loss.backward()
    return saved[0], float(loss)


def state(model):
    grads = c.trainable_grads(model)
    return {
        "config": json.dumps(model.config.to_dict(), sort_keys=True, default=repr),
        "use_cache": model.config.use_cache,
        "checkpointing": sorted(
            {
                bool(getattr(m, "gradient_checkpointing", False))
                for m in model.modules()
                if hasattr(m, "gradient_checkpointing")
            }
        ),
        "training_flags": [m.training for m in model.modules()],
        "hooks": sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()),
        "grad_sum": float(sum(g.double().sum() for g in grads.values() if g is not None)),
    }


def enable_disable(model):
    model.gradient_checkpointing_enable()
    model.gradient_checkpointing_disable()
    return model


def enable_disable_eval(model):
    model.eval()
    model.gradient_checkpointing_enable()
    forward_backward(model)  # the first training forward in eval mode (R5's moment)
    model.gradient_checkpointing_disable()
    return model.train()


def reentrant_disable(model):
    for p in model.model.embed_tokens.parameters():
        p.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model.gradient_checkpointing_disable()
    return model


def kbit_false(model):
    from peft import prepare_model_for_kbit_training

    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


def trainer_false(model):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    ids = c.input_ids(batch=4)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=2,
            max_steps=1,
            learning_rate=0.0,
            gradient_checkpointing=False,
            report_to=[],
            save_strategy="no",
            use_cpu=True,
            logging_strategy="no",
        )
        Trainer(model=model, args=args, train_dataset=data).train()
    return model


SCENARIOS = (enable_disable, enable_disable_eval, reentrant_disable, kbit_false, trainer_false)


def main():
    warnings.filterwarnings("ignore")
    os.environ.setdefault("WANDB_MODE", "disabled")
    out = {}
    for scenario in SCENARIOS:
        model = scenario(c.llama().train())
        saved, loss = forward_backward(model)
        out[scenario.__name__] = {"saved_bytes": saved, "loss": loss, **state(model)}
    c.emit({"scenario": "disable_after_enable", "results": out})


if __name__ == "__main__":
    main()
