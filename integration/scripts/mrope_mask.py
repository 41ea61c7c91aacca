"""A tiny Qwen3-VL (or Qwen3-VL-MoE, Qwen3.5, Qwen3.5-MoE) trained on an image batch that carries
no attention_mask, as a user's own batch may: input_ids, pixel_values and image_grid_thw. Ordinary
user code: nothing here imports gcpatch.

The reference is the same model without checkpointing (its forward builds a KV cache, so its
causal mask looks for no packed sequences). Then `gradient_checkpointing_enable()`, one training
step compared with the reference's gradients, and an evaluation forward's logits compared with
the reference's own evaluation forward. On transformers 4.57-5.2, without a cache these models
read the multimodal rope's temporal row as text positions and each image's still positions as a
new packed sequence (transformers#44158).

usage: mrope_mask.py [--model qwen3_vl|qwen3_vl_moe|qwen3_5|qwen3_5_moe] [--packed]
  --packed: the batch also carries 2-D position_ids that restart halfway along each row, as a
            packing collator's do (no attention_mask): the user's packing, which the masks of
            the checkpointed run follow
prints one line: RESULT {json}
"""

import argparse
import os

import _common as c
import families
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def loss_of(model, batch):
    torch.manual_seed(5)
    return model(**batch).logits.float().pow(2).mean()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--model",
        default="qwen3_vl",
        choices=("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"),
    )
    parser.add_argument("--packed", action="store_true")
    args = parser.parse_args()

    batch = families._grid_pixels(4, 16)  # no attention_mask
    if args.packed:
        length = batch["input_ids"].shape[1]
        half = length // 2
        positions = torch.cat([torch.arange(half), torch.arange(length - half)])
        batch["position_ids"] = positions.expand(batch["input_ids"].shape[0], -1).clone()

    model = families.build(args.model)
    model.eval()
    with torch.no_grad():
        eval_reference = model(**batch).logits
    model.train()
    loss_of(model, batch).backward()
    reference = c.trainable_grads(model)

    model.zero_grad(set_to_none=True)
    model.gradient_checkpointing_enable()
    loss_of(model, batch).backward()
    grads = c.trainable_grads(model)
    model.eval()
    with torch.no_grad():
        logits = model(**batch).logits

    compared = c.compare_grads(grads, reference)
    c.emit(
        {
            "scenario": "mrope_mask",
            "model": args.model,
            "packed": args.packed,
            **{k: v for k, v in compared.items() if k != "wrong_names"},
            # the checkpointed run's own gradients, so two runs can be told apart exactly
            "grad_digest": sum(float(g.double().abs().sum()) for g in grads.values()),
            "eval_max_diff": float((logits - eval_reference).abs().max()),
            "use_cache": model.config.get_text_config().use_cache,
        }
    )


if __name__ == "__main__":
    main()
