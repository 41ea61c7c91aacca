"""transformers.Trainer (or TRL's SFTTrainer with a LoRA adapter) with
`gradient_checkpointing=True`, 2 steps on CPU, dropout on. Ordinary user code: nothing here
imports gcpatch. It prints digests of the first step's gradients (captured before the optimizer
runs), the trainable parameters after training, the losses and the RNG stream afterwards, so a
run with GCPATCH_VERIFY=1 can be compared with one without.

usage: verify_trainer.py --trainer hf|sft
   or: python -m torch.distributed.run --nproc_per_node=2 verify_trainer.py --trainer hf  (DDP, gloo)
"""

import argparse
import os
import tempfile
import warnings

import _common as c
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from verify_train import digest, llama


class Batches(torch.utils.data.Dataset):
    def __init__(self, n: int = 8) -> None:
        self.ids = c.input_ids(batch=n, seed=5)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


class FirstStep(TrainerCallback):
    def __init__(self) -> None:
        self.grads = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            model = kwargs["model"]
            self.grads = digest(p.grad for p in model.parameters() if p.requires_grad)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=("hf", "sft"), default="hf")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    capture = FirstStep()
    out = tempfile.mkdtemp(prefix="verify-trainer-", dir=".")  # in the run's own folder
    common = dict(
        output_dir=out,
        gradient_checkpointing=True,
        max_steps=2,
        per_device_train_batch_size=4,
        report_to=[],
        use_cpu=True,
        learning_rate=1e-2,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    if args.trainer == "hf":
        model = llama()
        trainer = Trainer(
            model=model,
            args=TrainingArguments(**common),
            train_dataset=Batches(),
            callbacks=[capture],
        )
    else:
        import trl
        from peft import LoraConfig
        from trl_peft import config, dataset, model_for, tokenizer

        tok = tokenizer()
        model = model_for(tok)
        targs = config(
            trl.SFTConfig, **common, max_length=32, dataset_num_proc=None, bf16=False, fp16=False
        )
        trainer = trl.SFTTrainer(
            model=model,
            args=targs,
            train_dataset=dataset("sft"),
            processing_class=tok,
            peft_config=LoraConfig(
                r=4,
                lora_alpha=8,
                target_modules=["q_proj", "v_proj"],
                lora_dropout=0.1,
                task_type="CAUSAL_LM",
            ),
            callbacks=[capture],
        )
    trainer.train()
    trained = trainer.model
    c.emit(
        {
            "scenario": "verify_trainer",
            "trainer": args.trainer,
            "rank": int(os.environ.get("RANK", 0)),
            "first_step_grads": capture.grads,
            "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
            "params_after": digest(p for p in trained.parameters() if p.requires_grad),
            "rng_after": torch.rand(4).tolist(),
            "trainable": sum(1 for p in trained.parameters() if p.requires_grad),
            "applied_use_reentrant": c.checkpoint_use_reentrant(trained),
        }
    )


if __name__ == "__main__":
    main()
