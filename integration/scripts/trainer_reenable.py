"""Scenario d (X3, transformers#26221): the user enables checkpointing on the model with an
explicit use_reentrant, then trains with TrainingArguments(gradient_checkpointing=True) and no
checkpointing kwargs; the Trainer re-enables checkpointing with its own default. Reports the
use_reentrant the layers hold after one step.

usage: trainer_reenable.py --use-reentrant true|false
"""

import argparse
import tempfile
import warnings

import _common as c
from transformers import Trainer, TrainingArguments


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--use-reentrant", choices=("true", "false"), required=True)
    args = parser.parse_args()
    asked = args.use_reentrant == "true"
    warnings.filterwarnings("ignore")

    model = c.llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": asked})
    before = c.checkpoint_use_reentrant(model)
    seen = c.FirstStepProbe(model)
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(
            output_dir=out,
            gradient_checkpointing=True,
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
            model=model,
            args=targs,
            train_dataset=c.Batch(c.input_ids(batch=2)),
            optimizers=(seen, None),
        ).train()
    c.emit(
        {
            "scenario": "trainer_reenable",
            "asked_use_reentrant": asked,
            "use_reentrant_before_trainer": before,
            "use_reentrant_in_step": seen.use_reentrant,
            "use_reentrant_after": c.checkpoint_use_reentrant(model),
            "trainable_grad_none": seen.grad_none,
        }
    )


if __name__ == "__main__":
    main()
