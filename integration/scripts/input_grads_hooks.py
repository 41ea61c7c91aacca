"""Input-grads hooks on the input embeddings: transformers 5.23's `enable_input_require_grads` adds a
forward hook on every call and keeps the handle of the last one only, so each enable leaves one
more hook (and a disable removes one). Ordinary user code: nothing here imports gcpatch.

usage: input_grads_hooks.py --case double|sft
  double: a tiny Llama with a LoRA adapter, `gradient_checkpointing_enable(use_reentrant=True)`
          twice, then `enable_input_require_grads()` (what peft and TRL call), then one
          forward/backward compared with a no-checkpointing reference.
  sft:    TRL's SFTTrainer with a LoRA `peft_config` and `gradient_checkpointing=True` (TRL enables
          input grads after its own enable, and the Trainer enables again in `train`, trl#480).
Reports the number of forward hooks on the input embeddings after each step.
"""

import argparse
import warnings

import _common as c
import torch


def hooks(model) -> int:
    return len(model.get_input_embeddings()._forward_hooks)


def double() -> dict:
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        model = get_peft_model(
            c.llama(),
            LoraConfig(
                r=4,
                lora_alpha=8,
                target_modules=["q_proj", "v_proj"],
                lora_dropout=0.0,
                task_type="CAUSAL_LM",
            ),
        )
        model.train()
        return model

    ids = c.input_ids()
    ref = build()
    ref(input_ids=ids, labels=ids).loss.backward()
    reference = c.trainable_grads(ref)

    model = build()
    counts = {"after_peft": hooks(model)}
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    counts["after_enable_1"] = hooks(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    counts["after_enable_2"] = hooks(model)
    model.enable_input_require_grads()
    counts["after_enable_input_require_grads"] = hooks(model)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = c.trainable_grads(model)
    wrong = [
        n
        for n, g in reference.items()
        if grads.get(n) is None or not torch.allclose(g, grads[n], atol=1e-6)
    ]
    model.base_model.model.disable_input_require_grads()
    counts["after_disable_input_require_grads"] = hooks(model)
    return {
        "hooks": counts,
        "trainable": len(reference),
        "wrong": wrong,
        "applied_use_reentrant": c.checkpoint_use_reentrant(model),
    }


def sft() -> dict:
    import tempfile

    import trl
    from peft import LoraConfig
    from trl_peft import config, dataset, model_for, tokenizer

    tok = tokenizer()
    targs = config(
        trl.SFTConfig,
        output_dir=tempfile.mkdtemp(prefix="gcpatch-hooks-", dir="."),  # the run's folder
        max_steps=1,
        per_device_train_batch_size=2,
        learning_rate=1e-3,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=True,
        max_length=32,
        dataset_num_proc=None,
        bf16=False,
        fp16=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trainer = trl.SFTTrainer(
        model=model_for(tok),
        args=targs,
        train_dataset=dataset("sft"),
        processing_class=tok,
        peft_config=LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=0.0,
            task_type="CAUSAL_LM",
        ),
    )
    counts = {"after_init": hooks(trainer.model)}
    trainer.train()
    counts["after_train"] = hooks(trainer.model)
    return {
        "hooks": counts,
        "trl": trl.__version__,
        "global_step": trainer.state.global_step,
        "applied_use_reentrant": c.checkpoint_use_reentrant(trainer.model),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("double", "sft"), default="double")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    result = double() if args.case == "double" else sft()
    c.emit({"scenario": "input_grads_hooks", "case": args.case, **result})


if __name__ == "__main__":
    main()
