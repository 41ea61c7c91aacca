"""An ordinary user's fine-tuning step. It never imports gcpatch: `demo.py` runs it plainly and
with GCPATCH=1. Prints one `RESULT {json}` line with what it measured."""

import json
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM


def llama():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.model.embed_tokens.requires_grad_(
        False
    )  # a partially frozen model: embeddings and layer 0
    model.model.layers[0].requires_grad_(False)
    return model.train()


def frozen_embeds():
    """Partially frozen model, reentrant checkpointing asked for, fed inputs_embeds."""
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))

    def grads(model):
        embeds = model.get_input_embeddings()(ids).detach()
        model(inputs_embeds=embeds, labels=ids).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}

    reference = grads(llama())
    model = llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    got = grads(model)
    errors = [
        float("inf") if got[n] is None else (got[n] - reference[n]).abs().max().item()
        for n in reference
    ]
    return {"wrong": sum(e > 1e-5 for e in errors), "total": len(errors), "max_error": max(errors)}


def eval_mode():
    """A 4-layer model left in eval mode (as from_pretrained returns it), checkpointing enabled."""
    ids = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))

    def saved_bytes(train, checkpoint):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_embd=32, n_layer=4, n_head=4, n_positions=64)
        )
        model.train(train)
        if checkpoint:
            model.gradient_checkpointing_enable()
        total = [0]

        def pack(tensor):
            total[0] += tensor.numel() * tensor.element_size()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return total[0]

    no_checkpointing = saved_bytes(False, False)
    left_in_eval = saved_bytes(False, True)
    return {
        "saved_fraction": 1 - left_in_eval / no_checkpointing,
        "bytes": left_in_eval,
        "train_mode_bytes": saved_bytes(True, True),
    }


if __name__ == "__main__":
    case = {"frozen-embeds": frozen_embeds, "eval-mode": eval_mode}[sys.argv[1]]
    print("RESULT " + json.dumps(case()))
