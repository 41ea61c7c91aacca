"""A follow-up of scenario c: a Llama left in eval mode, checkpointing enabled, one
grad-enabled forward+backward (a training step without model.train()), then greedy generation
under no_grad. The tokens are compared with those of the same model never checkpointed.

Then, from transformers 4.56 (whose Llama builds its cache as `DynamicCache(config=...)`, as this
script does), a grad-enabled decode step that passes only the KV cache (no
`use_cache=True`: as a decode loop under autograd does), under the keyword the release names it
(`past_key_values`, `cache` from 5.24): its logits need the cache the prefill filled, which a
checkpointed layer would drop. Compared with the same steps of the never-checkpointed model.

usage: eval_mode_generate.py
"""

import inspect
import warnings

import _common as c
import torch
import transformers
from packaging.version import Version


def generate(model, prompt, use_cache=True):
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=8,
            min_new_tokens=8,
            do_sample=False,
            pad_token_id=0,
            use_cache=use_cache,
        )
    return out[0, prompt.shape[1] :].tolist()


def cached_step(model, ids):
    """Prefill the first 6 tokens into a cache, then one grad-enabled step passing only that cache."""
    from transformers import DynamicCache

    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache = DynamicCache(config=model.config)
    model(input_ids=ids[:, :6], **{name: cache})
    return model(input_ids=ids[:, 6:7], **{name: cache}).logits, name


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
    cached = {}
    if Version(transformers.__version__) >= Version("4.56"):
        (want, _), (step, name) = cached_step(reference, ids), cached_step(model, ids)
        cached = {
            "cache_keyword": name,
            "cached_step_equal": torch.equal(want, step),
            "cached_step_max_err": (want - step).abs().max().item(),
        }
    c.emit(
        {
            **cached,
            "scenario": "eval_mode_generate",
            "tokens_expected": expected,
            "tokens_got": got,
            "tokens_equal": expected == got,
            "tokens_equal_without_kv_cache": expected == got_without_cache,
            "model_training": model.training,
            "layers_training": layers,
        }
    )


if __name__ == "__main__":
    main()
