"""Scenario 1: LoRA (r=4, q_proj/v_proj) on a frozen tiny Llama, use_reentrant=True, fed
inputs_embeds (which do not require grad). Ordinary user code: nothing here imports gcpatch.

usage: lora_embeds.py --order before|after
  before: model.gradient_checkpointing_enable(...) then get_peft_model(model, ...)
  after:  peft_model = get_peft_model(model, ...) then peft_model.gradient_checkpointing_enable(...)

The reference is a no-checkpointing run of an identical PeftModel (same base weights and the same
LoRA weights, copied by state_dict) on the same batch.
"""

import argparse
import warnings

import _common as c
import torch


def loss_and_backward(model, ids, embeds):
    model.zero_grad(set_to_none=True)
    out = model(inputs_embeds=embeds, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--order", choices=("before", "after"), default="before")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    kwargs = {"use_reentrant": True}

    # reference: same weights, no checkpointing
    ref_model = c.lora(c.llama())
    ref_model.train()
    c.trained_lora_b(ref_model)
    ids = c.input_ids()
    embeds = ref_model.get_input_embeddings()(ids).detach()
    ref_loss = loss_and_backward(ref_model, ids, embeds)
    reference = c.trainable_grads(ref_model)

    base = c.llama()
    base.train()
    model = base
    error = error_type = None
    stage = "set-up"
    try:
        if args.order == "before":
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
            model = c.lora(base)
        else:
            model = c.lora(base)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.load_state_dict(ref_model.state_dict())
        model.train()
        stage = "training step"
        loss = loss_and_backward(model, ids, embeds)
        got = c.trainable_grads(model)
        cmp = c.compare_grads(got, reference)
        loss_equal = bool(torch.allclose(loss, ref_loss, atol=1e-6))
    except Exception as exc:  # report, do not hide (strict mode raises in the set-up)
        error = f"{type(exc).__name__}: {exc}"[:600]
        error_type = type(exc).__name__
        cmp, loss_equal = {}, None
    c.emit(
        {
            "scenario": "lora_embeds",
            "order": args.order,
            **cmp,
            "error": error,
            "error_type": error_type,
            "error_stage": stage if error else None,
            "loss_equal": loss_equal,
            "applied_use_reentrant": c.checkpoint_use_reentrant(model),
            "use_cache": model.config.use_cache,
            "peft": __import__("peft").__version__,
        }
    )


if __name__ == "__main__":
    main()
