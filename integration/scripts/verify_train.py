"""A plain training loop (AdamW, dropout on, 2 steps) on one of several checkpointed set-ups, as a
user writes it. Nothing here imports gcpatch. It prints digests of everything the user's job
owns: the first step's gradients, the parameters and optimizer state after training, and the
RNG stream afterwards, so a run with GCPATCH_VERIFY=1 can be compared with one without.

usage: verify_train.py --setup frozen|kwargs|eval|lora|qlora
  frozen: Llama, embeddings + layer 0 frozen, use_reentrant=True (gcpatch's R1 fixes it)
  kwargs: a custom model family whose loop passes hidden states by keyword, use_reentrant=True
          (no gcpatch rule covers it: the gradients stay wrong)
  eval:   GPT-2 left in eval mode (as from_pretrained leaves it), gradient_checkpointing_enable()
  lora:   Llama + LoRA (get_peft_model after gradient_checkpointing_enable, use_reentrant=True)
  qlora:  4-bit Llama (bitsandbytes on CPU) + LoRA, gradient_checkpointing_enable()
"""

import argparse
import hashlib
import os
import random
import tempfile
import warnings

import _common as c
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=c.VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            attention_dropout=0.1,
            tie_word_embeddings=False,
        )
    )


def lora(model, dropout: float = 0.1):
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(123)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj"],
            lora_dropout=dropout,
            task_type="CAUSAL_LM",
        ),
    )
    with torch.no_grad():  # non-zero B, so every LoRA tensor gets a non-trivial gradient
        gen = torch.Generator().manual_seed(7)
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return peft_model


def build(setup: str):
    if setup == "frozen":
        model = llama()
        c.freeze_embeddings_and_first_layer(model)
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model
    if setup == "kwargs":
        import _kwarg_model

        model = _kwarg_model.build()
        model.train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        return model
    if setup == "eval":
        model = c.gpt2().eval()
        model.gradient_checkpointing_enable()
        return model
    if setup == "lora":
        model = llama()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
        model = lora(model)
        model.train()
        return model
    if setup == "qlora":
        from transformers import AutoModelForCausalLM, BitsAndBytesConfig

        path = tempfile.mkdtemp(prefix="verify-qlora-", dir=".")  # the run's own folder
        llama().save_pretrained(path)
        bnb = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=bnb, device_map="cpu", dtype=torch.float32
        )
        model.gradient_checkpointing_enable()
        model = lora(model)
        model.train()
        return model
    raise ValueError(setup)


def digest(tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        h.update(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_tensors(opt):
    for group in opt.state_dict()["state"].values():
        for key in sorted(group):
            value = group[key]
            yield value if isinstance(value, torch.Tensor) else torch.tensor(float(value))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--setup", required=True, choices=("frozen", "kwargs", "eval", "lora", "qlora")
    )
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")

    model = build(args.setup)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([p for _, p in trainable], lr=1e-2)
    torch.manual_seed(2024)
    random.seed(2024)
    losses, first_grads = [], None
    for step in range(args.steps):
        ids = c.input_ids(batch=4, seed=10 + step)
        opt.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if first_grads is None:
            first_grads = [p.grad for _, p in trainable]
            grads_none = sorted(n for n, p in trainable if p.grad is None)
            first_grad_digest = digest(first_grads)
        opt.step()
        losses.append(loss.item())
    c.emit(
        {
            "scenario": "verify_train",
            "setup": args.setup,
            "losses": losses,
            "first_step_grads": first_grad_digest,
            "first_step_grad_none": grads_none,
            "params_after": digest(p for _, p in trainable),
            "optimizer_state": digest(optimizer_tensors(opt)),
            "rng_after": torch.rand(4).tolist(),
            "python_rng_after": random.random(),
            "trainable": len(trainable),
            "training": model.training,
            "applied_use_reentrant": c.checkpoint_use_reentrant(model),
        }
    )


if __name__ == "__main__":
    main()
