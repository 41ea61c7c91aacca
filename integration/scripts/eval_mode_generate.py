"""A follow-up of scenario c: a Llama left in eval mode, checkpointing enabled, one
grad-enabled forward+backward (a training step without model.train()), then greedy generation
under no_grad. The tokens are compared with those of the same model never checkpointed.

usage: eval_mode_generate.py
"""
import warnings

import torch

import _common as c


def generate(model, prompt, use_cache=True):
    with torch.no_grad():
        out = model.generate(prompt, max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0,
                             use_cache=use_cache)
    return out[0, prompt.shape[1]:].tolist()


def main() -> None:
    warnings.filterwarnings("ignore")
    ids = c.input_ids(batch=1)
    prompt = ids[:, :6]
    reference = c.llama(3).eval()
    expected = generate(reference, prompt)

    model = c.llama(3).eval()
    model.gradient_checkpointing_enable()
    model(input_ids=ids, labels=ids).loss.backward()
    got = generate(model, prompt)
    got_without_cache = generate(model, prompt, use_cache=False)
    layers = [layer.training for layer in model.model.layers]
    c.emit({
        "scenario": "eval_mode_generate",
        "tokens_expected": expected,
        "tokens_got": got,
        "tokens_equal": expected == got,
        "tokens_equal_without_kv_cache": expected == got_without_cache,
        "model_training": model.training,
        "layers_training": layers,
    })


if __name__ == "__main__":
    main()
