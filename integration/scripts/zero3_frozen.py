"""DeepSpeed ZeRO-3 on CPU (one process, gloo, DS_ACCELERATOR=cpu, persistence threshold 0, model
built under zero.Init through HfDeepSpeedConfig), a partially frozen tiny Llama without PEFT
(embeddings and every layer's attention frozen, MLPs and norms trained, as `unfrozen_parameters` or a
hand-written freeze does), 2 training
steps with deepspeed.initialize. Ordinary user code: nothing here imports gcpatch.

usage: DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 MASTER_PORT=<free> RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \
       python zero3_frozen.py --reentrant false|unset|true|nogc [--input embeds|ids]
  false/true: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": X})
  unset:      model.gradient_checkpointing_enable()
  nogc:       no checkpointing (the reference run)
  --input embeds (default): the batch goes in as inputs_embeds from the frozen embedding, which
              transformers' own input-grads hook does not cover (5.x covers input_ids models)

The first step's full gradient of every trainable tensor (deepspeed.utils.safe_get_full_grad, after
engine.backward, before engine.step) is saved to grads.pt in the working directory; the RESULT line
names that file and carries the 2 losses (or the exception). Compare a checkpointed run's file with
the nogc run's: every tensor must match.
"""

import argparse
import os
import warnings

import _common as c
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reentrant", choices=("false", "unset", "true", "nogc"), default="false")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--input", choices=("embeds", "ids"), default="embeds")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import AutoModelForCausalLM, LlamaConfig
    from transformers.integrations import HfDeepSpeedConfig

    deepspeed.init_distributed(dist_backend="gloo")
    config = c.zero3_config()
    dschf = HfDeepSpeedConfig(config)  # noqa: F841  (must stay alive: makes from_config use zero.Init)

    torch.manual_seed(0)
    mconfig = LlamaConfig(
        vocab_size=c.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = AutoModelForCausalLM.from_config(mconfig)
    partitioned = getattr(model.model.layers[1].self_attn.q_proj.weight, "ds_id", None) is not None
    # frozen embeddings and attention, trainable MLPs and norms: every checkpointed block holds frozen
    # partitioned parameters that its recompute must gather (DeepSpeed < 0.19.3 raises CheckpointError)
    for param in model.model.embed_tokens.parameters():
        param.requires_grad_(False)
    for layer in model.model.layers:
        for param in layer.self_attn.parameters():
            param.requires_grad_(False)
    model.train()
    if args.reentrant == "unset":
        model.gradient_checkpointing_enable()
    elif args.reentrant in ("true", "false"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.reentrant == "true"}
        )
    applied = c.checkpoint_use_reentrant(model)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW([p for _, p in named], lr=1e-2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    losses, error, grads = [], None, {}
    try:
        for s in range(args.steps):
            ids = c.input_ids(seed=100 + s)
            if args.input == "embeds":
                with torch.no_grad():
                    embeds = engine.module.get_input_embeddings()(ids)
                loss = engine(inputs_embeds=embeds, labels=ids).loss
            else:
                loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            if s == 0:
                for name, param in named:
                    grad = safe_get_full_grad(param)
                    grads[name] = None if grad is None else grad.detach().clone().float()
            engine.step()
            losses.append(round(float(loss.detach()), 7))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}".replace("\n", " ")[:600]
    path = os.path.abspath("grads.pt")
    torch.save(grads, path)
    c.emit(
        {
            "scenario": "zero3_frozen",
            "reentrant": args.reentrant,
            "input": args.input,
            "losses": losses,
            "error": error,
            "zero3_partitioned_at_build": partitioned,
            "applied_use_reentrant": applied,
            "trainable": len(named),
            "grads_file": path if grads else None,
            "grad_none": sum(1 for g in grads.values() if g is None),
            "deepspeed": deepspeed.__version__,
        }
    )


if __name__ == "__main__":
    main()
