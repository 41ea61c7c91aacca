"""Scenario 2: QLoRA on CPU. A tiny Llama is saved with save_pretrained, reloaded with
BitsAndBytesConfig(load_in_4bit=True), default checkpointing (no kwargs), LoRA (r=4, q_proj/v_proj).
Ordinary user code: nothing here imports gcpatch.

usage: qlora_4bit.py --prepare no|yes
  no:  model.gradient_checkpointing_enable(); model = get_peft_model(model, cfg)
  yes: model = prepare_model_for_kbit_training(model)  (enables checkpointing itself, no kwargs);
       model = get_peft_model(model, cfg)

The reference is a no-checkpointing run of the same quantized PeftModel (same LoRA weights, copied)
on the same batch, fed input_ids.
"""

import argparse
import os
import tempfile
import warnings

import _common as c
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_4bit(path):
    import transformers
    from packaging.version import Version
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
    # `dtype` from transformers 4.56 (modeling_utils.from_pretrained); `torch_dtype` before
    name = "dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb, device_map="cpu", **{name: torch.float32}
    )


def loss_and_backward(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prepare", choices=("no", "yes"), default="no")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    from peft import prepare_model_for_kbit_training

    tmp = tempfile.mkdtemp(prefix="p5-qlora-", dir=".")  # in the run's own folder
    c.llama().save_pretrained(tmp)
    ids = c.input_ids()

    ref_model = c.lora(load_4bit(tmp))
    ref_model.train()
    c.trained_lora_b(ref_model)
    ref_loss = loss_and_backward(ref_model, ids)
    reference = c.trainable_grads(ref_model)
    quant = type(ref_model.base_model.model.model.layers[0].self_attn.q_proj.base_layer).__name__

    model = load_4bit(tmp)
    if args.prepare == "yes":
        model = prepare_model_for_kbit_training(model)
    else:
        model.gradient_checkpointing_enable()
    model = c.lora(model)
    model.load_state_dict(ref_model.state_dict(), strict=False)
    with torch.no_grad():
        for (name, p), (rname, rp) in zip(model.named_parameters(), ref_model.named_parameters()):
            if "lora_" in name:
                p.copy_(rp)
    model.train()
    error = None
    try:
        loss = loss_and_backward(model, ids)
        got = c.trainable_grads(model)
        cmp = c.compare_grads(got, reference)
        loss_equal = bool(torch.allclose(loss, ref_loss, atol=1e-5))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"[:400]
        cmp, loss_equal = {}, None
    c.emit(
        {
            "scenario": "qlora_4bit",
            "prepare": args.prepare,
            "quantized_linear": quant,
            **cmp,
            "error": error,
            "loss_equal": loss_equal,
            "applied_use_reentrant": c.checkpoint_use_reentrant(model),
            "use_cache": model.config.use_cache,
        }
    )


if __name__ == "__main__":
    main()
