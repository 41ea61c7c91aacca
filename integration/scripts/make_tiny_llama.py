"""Build, with no hub access, what the Axolotl and ColossalAI runs load from disk: a tiny Llama (2 layers,
hidden 32) and a byte-level BPE tokenizer trained on the data, both saved with save_pretrained, and a
16-row alpaca JSONL dataset. Ordinary user code: nothing here imports gcpatch.

usage: make_tiny_llama.py OUTDIR    -> OUTDIR/{config.json, model.safetensors, tokenizer.json, ..., alpaca.jsonl}
prints one line: RESULT {json}
"""

import json
import os
import sys

import _common as c
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

ROWS = [
    ("Give a synonym.", "happy", "glad"),
    ("Give a synonym.", "big", "large"),
    ("Give a synonym.", "small", "little"),
    ("Give a synonym.", "fast", "quick"),
    ("Translate to French.", "cat", "chat"),
    ("Translate to French.", "dog", "chien"),
    ("Translate to French.", "house", "maison"),
    ("Translate to French.", "water", "eau"),
    ("Add the numbers.", "two and three", "five"),
    ("Add the numbers.", "one and one", "two"),
    ("Add the numbers.", "four and four", "eight"),
    ("Name the colour of the sky.", "", "blue"),
    ("Name the colour of grass.", "", "green"),
    ("Say hello.", "", "hello there"),
    ("Say goodbye.", "", "goodbye friend"),
    ("Count to three.", "", "one two three"),
]
PROMPTS = [
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.",
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction: ### Input: ### Response:",
]


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    data = os.path.join(out, "alpaca.jsonl")
    with open(data, "w") as handle:
        for instruction, inp, output in ROWS:
            handle.write(
                json.dumps({"instruction": instruction, "input": inp, "output": output}) + "\n"
            )

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text for row in ROWS for text in row] + PROMPTS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=256,
    )
    tokenizer.save_pretrained(out)

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(config).save_pretrained(out)
    c.emit({"dir": out, "vocab": len(tokenizer), "rows": len(ROWS), "dataset": data})


if __name__ == "__main__":
    main(sys.argv[1])
