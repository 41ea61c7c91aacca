"""Scenario TRL: a TRL SFTTrainer or DPOTrainer on a tiny Llama with a LoRA adapter
(`peft_config=LoraConfig(...)`), `gradient_checkpointing=True` and no checkpoint kwargs, 2 steps on
CPU from a tiny in-memory dataset and a tokenizer built here (no hub). Ordinary user code: nothing
here imports gcpatch.

usage: trl_peft.py --trainer sft|dpo

After training it runs TRL's `disable_gradient_checkpointing(model, args.gradient_checkpointing_kwargs)`
context (DPOTrainer also runs it itself for its reference forward when ref_model=None with PEFT), as
TRL does, and reports the `use_reentrant` the checkpointed layers hold before and after it.
TRL 0.24 has no such helper: the script then runs the same two calls it makes (disable, then
`gradient_checkpointing_enable(args.gradient_checkpointing_kwargs)`).
"""

import argparse
import contextlib
import dataclasses
import math
import tempfile
import warnings

import _common as c
import torch

WORDS = (
    "the cat sat on a mat dog ran to park sun is hot cold water blue sky green grass one two three "
    "four five hello there goodbye friend yes no good bad"
).split()


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<s>", "</s>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=64,
    )


def model_for(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def dataset(kind: str):
    from datasets import Dataset

    gen = torch.Generator().manual_seed(3)

    def sentence(n):
        return " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=gen))

    if kind == "sft":
        return Dataset.from_dict({"text": [sentence(10) for _ in range(8)]})
    return Dataset.from_dict(
        {
            "prompt": [sentence(5) for _ in range(8)],
            "chosen": [" " + sentence(4) for _ in range(8)],
            "rejected": [" " + sentence(4) for _ in range(8)],
        }
    )


def config(cls, **kwargs):
    """Only the arguments this TRL version's config knows (0.24 and 1.16 differ)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in kwargs.items() if k in names})


def disable_context(model, kwargs):
    try:
        from trl.models.utils import disable_gradient_checkpointing
    except ImportError:  # TRL 0.24: the same two calls TRL 1.16's helper makes
        disable_gradient_checkpointing = None
    if disable_gradient_checkpointing is not None:
        return "trl.models.utils.disable_gradient_checkpointing", disable_gradient_checkpointing(
            model, kwargs
        )

    @contextlib.contextmanager
    def same_as_trl():
        was = model.is_gradient_checkpointing
        if was:
            model.gradient_checkpointing_disable()
        try:
            yield
        finally:
            if was:
                model.gradient_checkpointing_enable(kwargs)

    return (
        "emulated (disable; gradient_checkpointing_enable(args.gradient_checkpointing_kwargs))",
        same_as_trl(),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trainer", choices=("sft", "dpo"), default="sft")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import trl
    from peft import LoraConfig

    tok = tokenizer()
    model = model_for(tok)
    out = tempfile.mkdtemp(prefix="gcpatch-trl-", dir=".")  # in the run's own folder
    common = dict(
        output_dir=out,
        max_steps=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        learning_rate=1e-3,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        gradient_checkpointing=True,
        max_length=32,
        max_prompt_length=16,
        dataset_num_proc=None,
        bf16=False,
        fp16=False,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft_config = LoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "v_proj"],
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    if args.trainer == "sft":
        targs = config(trl.SFTConfig, **common)
        trainer = trl.SFTTrainer(
            model=model,
            args=targs,
            train_dataset=dataset("sft"),
            processing_class=tok,
            peft_config=peft_config,
        )
    else:
        targs = config(trl.DPOConfig, **common)
        trainer = trl.DPOTrainer(
            model=model,
            ref_model=None,
            args=targs,
            train_dataset=dataset("dpo"),
            processing_class=tok,
            peft_config=peft_config,
        )
    user_kwargs = dict(targs.gradient_checkpointing_kwargs or {})
    trainer.train()
    losses = [round(h["loss"], 6) for h in trainer.state.log_history if "loss" in h]
    trained = trainer.model
    after_train = c.checkpoint_use_reentrant(trained)
    kwargs_after = dict(targs.gradient_checkpointing_kwargs or {})
    how, ctx = disable_context(trained, targs.gradient_checkpointing_kwargs)
    with ctx:
        inside = c.checkpoint_use_reentrant(trained)
    after_ctx = c.checkpoint_use_reentrant(trained)
    c.emit(
        {
            "scenario": "trl_peft",
            "trainer": type(trainer).__name__,
            "trl": trl.__version__,
            "peft": __import__("peft").__version__,
            "train_losses": losses,
            "losses_finite": bool(losses) and all(math.isfinite(x) for x in losses),
            "global_step": trainer.state.global_step,
            "peft_model": type(trained).__name__,
            "trainable": sum(1 for p in trained.parameters() if p.requires_grad),
            "user_gc_kwargs": user_kwargs,
            "gc_kwargs_after_train": kwargs_after,
            "use_reentrant_after_train": after_train,
            "disable_context": how,
            "use_reentrant_inside_disable": inside,
            "use_reentrant_after_disable": after_ctx,
        }
    )


if __name__ == "__main__":
    main()
