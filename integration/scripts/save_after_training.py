"""Saving after training with checkpointing on, as users do: one training step, then
`save_pretrained` (a Llama; a Llama left in eval mode while it trains; a LoRA model merged into
its base), the saved config.json and
generation_config.json read back, and the reloaded model run under no_grad asking for nothing:
does its forward return a KV cache? Ordinary user code: nothing here imports gcpatch.

usage: save_after_training.py    prints one line: RESULT {json}
"""

from __future__ import annotations

import json
import os
import tempfile

import _common as c
import torch


def saved(model, directory: str) -> dict:
    model.save_pretrained(directory)
    out = {}
    for name in ("config.json", "generation_config.json"):
        path = os.path.join(directory, name)
        if os.path.exists(path):
            with open(path) as f:
                out[name] = json.load(f)
    return out


def reloaded_returns_cache(directory: str) -> bool:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory)
    with torch.no_grad():
        return model(input_ids=c.input_ids()).past_key_values is not None


def trained(model, mode: str = "train", **enable):
    model.train(mode == "train")
    model.gradient_checkpointing_enable(**enable)
    ids = c.input_ids()
    model(input_ids=ids, labels=ids).loss.backward()
    return model


def main() -> None:
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode in (("llama", "train"), ("llama_eval", "eval")):
            model = trained(c.llama(), mode=mode)
            result[name] = {
                "files": saved(model, os.path.join(tmp, name)),
                "live_use_cache": model.config.use_cache,
                "json_string_use_cache": json.loads(model.config.to_json_string())["use_cache"],
                "reload_cache": reloaded_returns_cache(os.path.join(tmp, name)),
            }
        # LoRA, asked non-reentrant so that plain transformers 4.x trains it too
        peft_model = trained(
            c.lora(c.llama()), gradient_checkpointing_kwargs={"use_reentrant": False}
        )
        merged = peft_model.merge_and_unload()
        files = saved(merged, os.path.join(tmp, "merged"))
        result["lora_merged"] = {
            "files": files,
            "live_use_cache": merged.config.use_cache,
            "reload_cache": reloaded_returns_cache(os.path.join(tmp, "merged")),
        }
    c.emit(result)


if __name__ == "__main__":
    main()
