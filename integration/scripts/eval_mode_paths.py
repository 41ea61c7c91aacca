"""R5 through every path into the layers: a Llama left in eval mode (as from_pretrained leaves it),
checkpointing enabled, then one grad-enabled forward+backward reaching the layers by a path that
bypasses the model's own `__call__`:

- call: `model(...)`, the ordinary path;
- forward: `model.forward(...)` called directly;
- tuner: a wrapper whose forward calls `inner.forward(...)`, as peft <= 0.13's `BaseTuner.forward`
  does (the path of ColossalAI's `booster.enable_lora` on transformers 4.51);
- peft_first: checkpointing enabled on the base model, then `get_peft_model`;
- config_first: a head whose forward reads `config.use_cache` and hands its stack
  `use_cache=True`, as transformers 5.2.0's T5, BART and Whisper heads do
  (T5ForConditionalGeneration.forward, 5.2.0: `use_cache = use_cache if use_cache is not None
  else self.config.use_cache`); the stack sees a cache asked for.

For each: the bytes autograd saves in the forward against the same path in train mode, and the
gradients against the eval-mode model without checkpointing. Nothing here imports gcpatch.

usage: eval_mode_paths.py     prints one line: RESULT {json}
"""

import warnings

import _common as c
import torch
from torch import nn


class Tuner(nn.Module):
    """What peft <= 0.13's tuner does: the inner model's forward, not its __call__."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs):
        return self.model.forward(*args, **kwargs)


def reads_config_first():
    """A Llama head that resolves `use_cache` from its config before its stack runs."""
    from transformers import LlamaForCausalLM

    class ConfigFirstLlama(LlamaForCausalLM):
        def forward(self, *args, use_cache=None, **kwargs):
            use_cache = use_cache if use_cache is not None else self.config.use_cache
            return super().forward(*args, use_cache=use_cache, **kwargs)

    model = c.llama()
    head = ConfigFirstLlama(model.config)
    head.load_state_dict(model.state_dict())
    return head


def lora(model):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(3)
    return get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            init_lora_weights=False,
        ),
    )


def run(path, mode, checkpointing=True):
    model = reads_config_first() if path == "config_first" else c.llama()
    getattr(model, mode)()
    if path == "peft_first":
        if checkpointing:
            model.gradient_checkpointing_enable()
        model = lora(model)
    elif checkpointing:
        model.gradient_checkpointing_enable()
    runner = {"forward": model.forward, "tuner": Tuner(model)}.get(path, model)
    ids = c.input_ids()
    saved = [0]

    def pack(t):
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = runner(input_ids=ids, labels=ids).loss
    loss.backward()
    return saved[0], c.trainable_grads(model), model


def main():
    warnings.filterwarnings("ignore")
    out = {}
    for path in ("call", "forward", "tuner", "peft_first", "config_first"):
        ref_bytes, ref_grads, _ = run(path, "eval", checkpointing=False)
        eval_bytes, grads, model = run(path, "eval")
        train_bytes, _, _ = run(path, "train")
        cmp = c.compare_grads(grads, ref_grads)
        out[path] = {
            "saved_eval_gc": eval_bytes,
            "saved_train_gc": train_bytes,
            "saved_eval_nogc": ref_bytes,
            "ratio_eval_to_train": round(eval_bytes / train_bytes, 3),
            "grads_wrong": cmp["wrong"],
            "trainable": cmp["trainable"],
            "model_training": getattr(model, "get_base_model", lambda: model)().training,
        }
    c.emit({"scenario": "eval_mode_paths", "paths": out})


if __name__ == "__main__":
    main()
