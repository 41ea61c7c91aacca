"""Fault injection into each hookspec of the fault kit's plugin, in one process per mode: for
every (hook, kind) the engine is restarted with the fault set, and the user's code runs as
usual: a tiny Llama with frozen embeddings fed inputs_embeds, checkpointed with use_reentrant=True
(R1's set-up),
one step compared with the same model without checkpointing. One RESULT line per case."""

import json
import logging
import os
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import gcpatch
from gcpatch import engine
from gcpatch.errors import GcpatchError

warnings.filterwarnings("ignore")
CASES = [
    (hook, kind)
    for hook in ("info", "patch_points", "vote")
    for kind in ("raise", "garbage", "wrong_type")
]
# a plugin must never end the job: SystemExit from its hooks and wrappers too
CASES += [("info", "exit"), ("vote", "exit"), ("wrapper", "raise"), ("wrapper", "exit")]
CASES += [("", "")]  # the last: no fault, the control


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        if record.levelno >= logging.WARNING:
            self.lines.append(record.getMessage())


def llama():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    model.model.embed_tokens.requires_grad_(False)
    return model.train()


# fix mode: the user asks reentrant, which R1 must still overrule; strict mode: the user asks the
# right thing, so that only the injected fault can raise
ASK = os.environ.get("GCPATCH_MODE", "fix") != "strict"


def grads(model, checkpoint):
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ASK})
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    # inputs_embeds from the frozen embedding: under reentrant nothing entering the layers needs
    # grad and transformers' own hook covers input_ids only (X2), so the layers lose their grads
    model(inputs_embeds=model.get_input_embeddings()(ids), labels=ids).loss.backward()
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def main():
    reference = grads(llama(), checkpoint=False)
    handler = Lines()
    logging.getLogger("gcpatch").addHandler(handler)
    for hook, kind in CASES:
        os.environ["FAULT_HOOK"], os.environ["FAULT_KIND"] = hook, kind
        gcpatch.deactivate()
        handler.lines.clear()
        result = {"hook": hook, "kind": kind, "error": None, "wrong_grads": None, "work": None}
        try:
            gcpatch.activate()
            engine.start()
            import faulty_target

            result["work"] = [
                faulty_target.work(i) for i in range(4)
            ]  # four calls through the patch point
            got = grads(llama(), checkpoint=True)
            result["wrong_grads"] = sum(
                1 for n, g in got.items() if g is None or not torch.allclose(g, reference[n])
            )
        except GcpatchError as exc:
            result["error"] = f"GcpatchError: {exc}"
        except Exception as exc:  # noqa: BLE001 (the host crashed: the suite counts it)
            result["error"] = f"CRASH {type(exc).__name__}: {exc}"
        result["lines"] = list(handler.lines)
        result["faulty_lines"] = [line for line in handler.lines if "faulty" in line]
        print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
