"""Scenario b: the partially frozen Llama trained through transformers.Trainer with
TrainingArguments(gradient_checkpointing=True) and no checkpointing kwargs. The first step's
gradients (captured by the optimizer's first step, before it touches anything) are
compared with those of the same Trainer set-up without checkpointing, on the same batch.

usage: frozen_llama_trainer.py
"""

import tempfile
import warnings

import _common as c
import torch
from transformers import Trainer, TrainingArguments


def train_one_step(checkpointing: bool, ids: torch.Tensor) -> c.FirstStepProbe:
    model = c.llama()
    c.freeze_embeddings_and_first_layer(model)
    capture = c.FirstStepProbe(model)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            gradient_checkpointing=checkpointing,
            max_steps=1,
            per_device_train_batch_size=2,
            report_to=[],
            use_cpu=True,
            learning_rate=0.0,
            max_grad_norm=0.0,
            save_strategy="no",
            logging_strategy="no",
            disable_tqdm=True,
            dataloader_num_workers=0,
            seed=0,
        )
        Trainer(
            model=model, args=args, train_dataset=c.Batch(ids), optimizers=(capture, None)
        ).train()
    assert capture.grads is not None, "the optimizer never stepped"
    return capture


def main() -> None:
    warnings.filterwarnings("ignore")
    ids = c.input_ids(batch=2)
    reference = train_one_step(False, ids)
    checkpointed = train_one_step(True, ids)
    c.emit(
        {
            "scenario": "frozen_llama_trainer",
            **c.compare_grads(checkpointed.grads, reference.grads),
            "applied_use_reentrant": checkpointed.use_reentrant,
        }
    )


if __name__ == "__main__":
    main()
