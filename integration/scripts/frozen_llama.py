"""Scenario a: a partially frozen Llama (embeddings and layer 0 frozen) checkpointed with
use_reentrant=True, as a user writes it. Compares every trainable gradient with a
no-checkpointing reference computed on the same model and batch.

usage: frozen_llama.py --api gc|ac --input ids|embeds
  gc: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
  ac: model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": True}) (5.x)
"""

import argparse
import warnings

import _common as c
import torch


def loss_and_backward(model, ids, embeds):
    model.zero_grad(set_to_none=True)
    if embeds is None:
        out = model(input_ids=ids, labels=ids)
    else:
        out = model(inputs_embeds=embeds, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--api", choices=("gc", "ac"), default="gc")
    parser.add_argument("--input", choices=("ids", "embeds"), default="ids")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    model = c.llama()
    c.freeze_embeddings_and_first_layer(model)
    model.train()
    ids = c.input_ids()
    embeds = model.get_input_embeddings()(ids).detach() if args.input == "embeds" else None

    ref_loss = loss_and_backward(model, ids, embeds)
    reference = c.trainable_grads(model)

    kwargs = {"use_reentrant": True}
    if args.api == "gc":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        if not hasattr(model, "activation_checkpointing_enable"):
            c.emit(
                {"skipped": "activation_checkpointing_enable does not exist in this transformers"}
            )
            return
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    try:
        loss = loss_and_backward(model, ids, embeds)
    except Exception as exc:  # report, do not hide (strict mode raises in the step)
        c.emit({"scenario": "frozen_llama", "error": f"{type(exc).__name__}: {exc}"[:600]})
        return
    got = c.trainable_grads(model)

    c.emit(
        {
            "scenario": "frozen_llama",
            "api": args.api,
            "input": args.input,
            **c.compare_grads(got, reference),
            "frozen": sum(1 for p in model.parameters() if not p.requires_grad),
            "loss_equal": bool(torch.allclose(loss, ref_loss, atol=1e-6)),
            "applied_use_reentrant": c.checkpoint_use_reentrant(model),
            "use_cache": model.config.use_cache,
            "is_gradient_checkpointing": bool(getattr(model, "is_gradient_checkpointing", None)),
        }
    )


if __name__ == "__main__":
    main()
