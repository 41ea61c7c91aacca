"""TRL's SFTTrainer with `every_n_layers` in `SFTConfig.gradient_checkpointing_kwargs` (transformers
5.17+ pops it before the checkpoint kwargs reach torch) and use_reentrant=True, on a 4-layer Llama
whose embeddings are frozen (no PEFT). Ordinary user code: nothing here imports gcpatch.

An lr=0 probe optimizer (FirstStepProbe) records the first step's trainable gradients and the
use_reentrant the layers hold; the same trainer without checkpointing gives the reference.
"""

import tempfile
import warnings

import _common as c
import torch
from trl_peft import config, dataset, tokenizer

ASK = {"use_reentrant": True, "every_n_layers": 2}


def build(tok):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            pad_token_id=tok.pad_token_id,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=False,
        )
    )
    for param in model.model.embed_tokens.parameters():
        param.requires_grad_(False)
    return model


def first_step(tok, checkpointing: bool):
    import trl

    model = build(tok)
    probe = c.FirstStepProbe(model)
    with tempfile.TemporaryDirectory() as out:
        targs = config(
            trl.SFTConfig,
            output_dir=out,
            max_steps=1,
            per_device_train_batch_size=8,
            learning_rate=0.0,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            gradient_checkpointing=checkpointing,
            gradient_checkpointing_kwargs=dict(ASK) if checkpointing else None,
            max_length=32,
            dataset_num_proc=None,
            bf16=False,
            fp16=False,
            seed=0,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        trl.SFTTrainer(
            model=model,
            args=targs,
            train_dataset=dataset("sft"),
            processing_class=tok,
            optimizers=(probe, None),
        ).train()
    on = [i for i, layer in enumerate(model.model.layers) if layer.gradient_checkpointing]
    return probe, on


def main() -> None:
    warnings.filterwarnings("ignore")
    import trl

    tok = tokenizer()
    probe, on = first_step(tok, True)
    reference, _ = first_step(tok, False)
    report = c.compare_grads(probe.grads, reference.grads, atol=1e-6)
    c.emit(
        {
            "scenario": "trl_every_n_layers",
            "trl": trl.__version__,
            "checkpointed_layers": on,
            "use_reentrant": probe.use_reentrant,
            **report,
        }
    )


if __name__ == "__main__":
    main()
