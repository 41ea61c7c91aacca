"""Scenario 4: DeepSpeed ZeRO-3 on CPU, one process, LoRA (r=4, q_proj/v_proj) on a tiny Llama built
under ZeRO-3 (HfDeepSpeedConfig before from_config -> deepspeed.zero.Init), 2 training steps with
deepspeed.initialize. Ordinary user code: nothing here imports gcpatch.

usage: DS_ACCELERATOR=cpu MASTER_ADDR=127.0.0.1 MASTER_PORT=<free> RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 \
       python zero3_lora.py --reentrant false|unset|true|nogc
  false/true: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": X})
  unset:      model.gradient_checkpointing_enable()
  nogc:       no checkpointing (the reference run; its losses are printed too)

Each run prints one RESULT line with the 2 losses (or the exception). Compare the losses of a
checkpointed run with the nogc run's losses: they must match.
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
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    import deepspeed
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    try:
        from transformers.integrations import HfDeepSpeedConfig
    except ImportError:  # older layout
        from transformers.deepspeed import HfDeepSpeedConfig

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
    )
    model = AutoModelForCausalLM.from_config(mconfig)
    partitioned = bool(
        getattr(model.model.layers[0].self_attn.q_proj.weight, "ds_id", None) is not None
    )
    model.train()
    if args.reentrant == "unset":
        model.gradient_checkpointing_enable()
    elif args.reentrant in ("true", "false"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": args.reentrant == "true"}
        )
    torch.manual_seed(123)
    model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )
    applied = c.checkpoint_use_reentrant(model)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    losses, error = [], None
    try:
        for s in range(args.steps):
            ids = c.input_ids(seed=100 + s)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(round(float(loss.detach()), 7))
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        error = error.replace("\n", " ")[:600]
    c.emit(
        {
            "scenario": "zero3_lora",
            "reentrant": args.reentrant,
            "losses": losses,
            "error": error,
            "zero3_partitioned_at_build": partitioned,
            "applied_use_reentrant": applied,
            "deepspeed": deepspeed.__version__,
            "lr": args.lr,
            "peft": __import__("peft").__version__,
        }
    )


if __name__ == "__main__":
    main()
