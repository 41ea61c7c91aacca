"""GCPATCH_RECORD pointing at hazards, one after another in one process (the variable is read at
every decision). Each case: a tiny Llama with frozen embeddings enables checkpointing with
use_reentrant=True and trains one step; the RESULT line says whether it trained, what R1 applied,
and which gcpatch lines appeared. The parent test checks the files around each hazard."""

import json
import logging
import os
import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        if record.levelno >= logging.WARNING and "R1 overrules" not in record.getMessage():
            self.lines.append(record.getMessage())


def step():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    ).train()
    model.model.embed_tokens.requires_grad_(False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    return sum(1 for p in model.parameters() if p.requires_grad and p.grad is None)


def main():
    handler = Lines()
    logging.getLogger("gcpatch").addHandler(handler)
    for case, record_dir in json.loads(sys.argv[1]):
        os.environ["GCPATCH_RECORD"] = record_dir
        handler.lines.clear()
        result = {"case": case, "error": None, "missing_grads": None}
        try:
            result["missing_grads"] = step()
        except BaseException as exc:  # noqa: BLE001 (the host crashed: the test counts it)
            result["error"] = f"{type(exc).__name__}: {exc}"[:500]
        result["lines"] = list(handler.lines)
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
